"""Output perturbation: replace block l's output, measure KL(p_orig || p_patched) per token.

The patched forward *resumes* from block l: blocks 0..l-1 are bypassed (their forward returns its
input unchanged) and block l's forward returns the patched state, so only blocks l+1..L-1, the
final norm and the head do work. Because block l's output is the only thing that reaches block
l+1, this is exactly the full model with h_{l+1} replaced, at about (L-l)/L of the cost. The
replacement is a `forward` attribute on the block instance (not a hook), so transformers' own
output recorders see the patched value; it is removed on exit even when the pass fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from updatelens.models import LoadedModel


@contextmanager
def resume_at_block(blocks: nn.ModuleList, layer: int, patched: torch.Tensor,
                    returns_tuple: bool = False) -> Iterator[None]:
    """Within the context, the model's forward starts at block layer+1 from `patched`."""

    def wrap(t: torch.Tensor) -> object:
        return (t,) if returns_tuple else t

    def identity(*args: object, **kwargs: object) -> object:
        hidden = args[0] if args else kwargs["hidden_states"]
        return wrap(hidden)  # type: ignore[arg-type]

    def replaced(*args: object, **kwargs: object) -> object:
        hidden = args[0] if args else kwargs["hidden_states"]
        assert isinstance(hidden, torch.Tensor)
        if hidden.shape != patched.shape:
            raise ValueError(f"patched state has shape {tuple(patched.shape)}, block {layer} sees "
                             f"{tuple(hidden.shape)}")
        return wrap(patched.to(hidden.dtype))

    touched = list(blocks[: layer + 1])
    try:
        for block in touched[:-1]:
            block.forward = identity
        touched[-1].forward = replaced
        yield
    finally:
        for block in touched:
            if "forward" in block.__dict__:
                del block.forward


def _padding_kwargs(lm: LoadedModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"attention_mask": torch.ones_like(ids)} if lm.allows_padding else {}


def kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis from full log-probabilities, natural log: the plain definition,
    used for output layers that are not a plain linear map (and by tests). Not clamped: rounding can
    leave it slightly below 0, and the functional stage records how far before clamping."""
    return (logp.exp() * (logp - logq)).sum(dim=-1)


# ---- the output layer ---------------------------------------------------------------------------
@dataclass
class LinearHead:
    """An output layer that is exactly logits = h W^T + b (checked against the model's own logits).

    For such a head the patched logits are z_q = z_p + delta with delta_v = (h_q - h_p) . w_v (the
    bias cancels), so with p the original distribution at the same position
        KL(p || q) = logsumexp_v(log p_v + delta_v) - sum_v p_v delta_v,
        sum_v p_v delta_v = (h_q - h_p) . (sum_v p_v w_v).
    A patched pass then needs one head product of the *difference* of the head inputs (rounding
    relative to the change, not to the logits: float32 logits near 36 carry ~1e-5 of error, more
    than the smallest KLs) and one log-sum-exp, made and reduced a vocabulary chunk at a time
    (cache-sized) without materialising the logits or log q. The identity patch gives <= 3e-7
    (SmolLM2; the old float32 log-softmax difference gave up to 1.6e-5).
    """

    weight: torch.Tensor  # [V, d]
    chunk: int = 2048

    def expected_row(self, logp: torch.Tensor) -> torch.Tensor:
        """sum_v p_v w_v for log-probabilities [m, V], in float64, p and the weight made a chunk of the
        vocabulary at a time (no [m, V] temporary): [m, d]."""
        out = torch.zeros((logp.shape[0], self.weight.shape[1]), dtype=torch.float64, device=logp.device)
        for start in range(0, self.weight.shape[0], self.chunk):
            out += logp[:, start : start + self.chunk].double().exp_() @ self.weight[start : start + self.chunk].double()
        return out

    def shifted_logsumexp(self, delta_h: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """logsumexp_v(logp_v + delta_h . w_v) for delta_h [m, d], logp [m, V]: float64 [m]. Reduced in
        float32, or in float64 for a float64 model (whose comparisons see the method, not rounding), as
        `OriginalOutput.kl` does for other heads."""
        delta_h = delta_h.to(self.weight.dtype)
        exact = torch.promote_types(self.weight.dtype, torch.float32)
        parts = []
        for start in range(0, self.weight.shape[0], self.chunk):
            t = F.linear(delta_h, self.weight[start : start + self.chunk]).to(exact)
            t += logp[:, start : start + self.chunk]
            top = t.amax(dim=-1, keepdim=True)  # kept exact; the sum of exp is rounded relative to 1
            parts.append(top.squeeze(-1).double() + t.sub_(top).exp_().sum(dim=-1).double().log())
        return torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)


def output_layer(lm: LoadedModel) -> nn.Module | None:
    head = lm.model.get_output_embeddings() if hasattr(lm.model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Module) else None


@contextmanager
def recording_head(head: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the context, `seen["input"]`/`seen["output"]` hold the output layer's last call."""
    seen: dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = args[0], output

    handle = head.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def head_bypassed(head: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the context the output layer returns its input unchanged and records it in
    `seen["input"]`: the forward stops before the logits (the caller reduces them itself)."""
    seen: dict[str, torch.Tensor] = {}

    def bypass(hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen["input"] = hidden
        return hidden

    try:
        head.forward = bypass
        yield seen
    finally:
        if "forward" in head.__dict__:
            del head.forward


# ---- the original distributions -----------------------------------------------------------------
@dataclass
class OriginalOutput:
    """The unpatched next-token distributions of the sample, and what the fast KL needs besides.

    `logp` always; with a `LinearHead` also the head's input h_p and the p-weighted mean head row
    (float64), so a patched pass reduces chunk by chunk (see `LinearHead`)."""

    logp: torch.Tensor  # [n_seq, T, V] float32
    head: LinearHead | None = None
    head_input: torch.Tensor | None = None  # [n_seq, T, d] h_p, the head's input
    mean_row: torch.Tensor | None = None  # [n_seq, T, d] float64: sum_v p_v w_v

    def subset(self, seqs: slice | list[int]) -> OriginalOutput:
        """The same for a subset of the sequences."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[seqs]

        return OriginalOutput(self.logp[seqs], self.head, pick(self.head_input), pick(self.mean_row))

    def kl(self, seqs: list[int], out: torch.Tensor, positions: list[int] | None = None) -> torch.Tensor:
        """KL(p_orig || q) [b, T] (or [b] at one position per row), float64, not clamped (rounding can
        leave it slightly below 0; a clearly negative value means the distributions are wrong).

        `out` is what `patched_outputs` returned for rows of sequences `seqs`: the head's input
        [b, T, d] (linear head) or the logits [b, T, V]."""
        index: tuple = (_as_index(seqs),) if positions is None else (seqs, positions)
        if positions is not None:
            out = out[torch.arange(len(seqs)), positions]
        if self.head is None:
            logp = self.logp[index]
            logq = torch.log_softmax(out.to(torch.promote_types(out.dtype, torch.float32)), dim=-1).to(logp.device)
            return kl_rows(logp, logq).double()
        assert self.head_input is not None and self.mean_row is not None
        delta_h = out - self.head_input[index]
        shape, d = delta_h.shape[:-1], delta_h.shape[-1]
        if positions is not None:  # [b, V]: one row per patched position
            lse = self.head.shifted_logsumexp(delta_h, self.logp[index])
        else:  # rows of consecutive sequences read as views of logp: a list index would copy b x T x V floats
            lse = torch.cat([self.head.shifted_logsumexp(delta_h[i:j].reshape(-1, d),
                                                         self.logp[rows].reshape(-1, self.logp.shape[-1]))
                             for i, j, rows in _consecutive_runs(seqs)])
        return lse.reshape(shape) - (delta_h.double() * self.mean_row[index]).sum(dim=-1)


    def kl_from(self, seq: int, out: torch.Tensor, start: int) -> torch.Tensor:
        """KL(p_orig || q) at positions start .. T-1 of sequence `seq` (float64 [T - start], not clamped),
        `out` that sequence's row of what `patched_outputs` returned ([T, d] head input or [T, V] logits):
        the head's work only where it is read."""
        if self.head is None:
            logq = torch.log_softmax(out[start:].to(torch.promote_types(out.dtype, torch.float32)), dim=-1)
            return kl_rows(self.logp[seq, start:], logq.to(self.logp.device)).double()
        assert self.head_input is not None and self.mean_row is not None
        delta_h = out[start:] - self.head_input[seq, start:]
        lse = self.head.shifted_logsumexp(delta_h, self.logp[seq, start:])
        return lse - (delta_h.double() * self.mean_row[seq, start:]).sum(dim=-1)


def _consecutive_runs(seqs: list[int]) -> list[tuple[int, int, slice]]:
    """(first row, end row, the sequences as a slice) for each run of consecutive sequences in `seqs`."""
    runs, start = [], 0
    for i in range(1, len(seqs) + 1):
        if i == len(seqs) or seqs[i] != seqs[i - 1] + 1:
            runs.append((start, i, slice(seqs[start], seqs[i - 1] + 1)))
            start = i
    return runs


def _as_index(seqs: list[int]) -> slice | list[int]:
    """A run of consecutive sequences as a slice (a view: no copy of the V-sized rows)."""
    if seqs and list(seqs) == list(range(seqs[0], seqs[0] + len(seqs))):
        return slice(seqs[0], seqs[0] + len(seqs))
    return seqs


def original_output(lm: LoadedModel, input_ids: np.ndarray, batch: int, fast_head: bool = True,
                    resume: tuple[int, np.ndarray] | None = None, returns_tuple: bool = False) -> OriginalOutput:
    """The unpatched pass over the sample. The head takes the fast path only if it is a bias-free
    or biased `nn.Linear` whose output is exactly the model's logits (no scaling or soft-capping
    after it: checked on the first sequence); `fast_head=False` forces the plain definition.

    On the fast path the forward stops before the head and the logits are made one sequence at a
    time from the head's input, so memory holds one sequence's logits beside the log-probabilities
    kept (a 262,144-token vocabulary makes a 16-sequence batch's logits 2 GiB).

    resume=(layer, h) with h [n_seq, T, d] the captured output of block `layer` starts the pass
    after that block (as the patched passes do, see `resume_at_block`): the same distributions
    for (L - layer - 1) / L of the blocks; the functional stage checks it against a full forward."""
    module = output_layer(lm)
    head = LinearHead(module.weight) if fast_head and isinstance(module, nn.Linear) else None

    def forward(start: int, stop: int, bypass: bool, positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, None), or with `bypass` (head input, None); the head's recorded output beside
        the logits when `head` is set and not bypassed (the check). `positions`: only the first ones
        (a causal model's outputs there do not depend on the later ones)."""
        ids = torch.as_tensor(input_ids[start:stop, :positions], device=lm.device)
        resumed = (resume_at_block(lm.blocks, resume[0],
                                   torch.as_tensor(resume[1][start:stop, :positions], device=lm.device),
                                   returns_tuple) if resume is not None else nullcontext())
        if bypass:
            assert module is not None
            with resumed, head_bypassed(module) as seen:
                lm.model(input_ids=ids, use_cache=False, **_padding_kwargs(lm, ids))
            return seen["input"], None
        recorded: Any = recording_head(module) if head is not None and module is not None else nullcontext({})
        with resumed, recorded as seen:
            logits = lm.model(input_ids=ids, use_cache=False, **_padding_kwargs(lm, ids)).logits
        return logits, seen.get("output")

    with torch.inference_mode():
        if head is not None:  # is the head's output the model's logits? (the first positions of one sequence)
            logits, recorded = forward(0, 1, bypass=False, positions=HEAD_CHECK_POSITIONS)
            if recorded is None or not torch.equal(recorded.to(logits.dtype), logits):
                return original_output(lm, input_ids, batch, False, resume, returns_tuple)  # post-processed logits
            del logits, recorded
        logp: torch.Tensor | None = None  # [n_seq, T, V] filled in place: no second copy from a cat
        inputs, mean_rows = [], []
        for start in range(0, len(input_ids), batch):
            stop = min(len(input_ids), start + batch)
            out, _ = forward(start, stop, bypass=head is not None)
            if head is not None:
                inputs.append(out)
            for i in range(stop - start):  # a sequence at a time, in runs of positions: float64 [t, V] temporaries
                for p0, p1 in _position_runs(out.shape[1], vocab_size(lm)):  # of at most TEMP_BYTES
                    row = module(out[i, p0:p1]) if head is not None else out[i, p0:p1]  # type: ignore[misc]
                    if logp is None:
                        logp = torch.empty((len(input_ids), out.shape[1], row.shape[-1]), dtype=torch.float32,
                                           device=row.device)
                    row_logp = torch.log_softmax(row.double(), dim=-1)
                    del row
                    logp[start + i, p0:p1] = row_logp
                    del row_logp
                if head is not None:  # from the stored float32 log p (a relative 6e-8), summed in float64
                    assert logp is not None
                    mean_rows.append(head.expected_row(logp[start + i]))
    assert logp is not None, "empty sample"
    if head is None:
        return OriginalOutput(logp)
    return OriginalOutput(logp, head, torch.cat(inputs), torch.stack(mean_rows))


TEMP_BYTES = 2**24  # float64 log-probabilities made at once by the unpatched pass: 16 MiB
HEAD_CHECK_POSITIONS = 8  # the head's fast path is checked on this many positions (Gemma: 8 MiB of logits, not 128)


def vocab_size(lm: LoadedModel) -> int:
    return int(lm.model.config.get_text_config().vocab_size)


def _position_runs(n_positions: int, vocab: int) -> list[tuple[int, int]]:
    """Runs of positions whose float64 log-probabilities take about TEMP_BYTES (Gemma's 262,144-token
    vocabulary: 8 positions; SmolLM2's 49,152: 4 runs of 32 for a 128-token sequence). The runs are of
    equal length, a multiple of 8 positions where it can be: the head's product then gives each position
    the bits that one product over the whole sequence gives (measured with SmolLM2's head on this
    project's CPU builds; a last run of 2 positions moved log-probabilities by up to 2e-5)."""
    step = max(1, TEMP_BYTES // (vocab * 8))
    runs = math.ceil(n_positions / step)
    size = min(n_positions, math.ceil(math.ceil(n_positions / runs) / 8) * 8)
    return [(p, min(n_positions, p + size)) for p in range(0, n_positions, size)]


def patched_outputs(lm: LoadedModel, ids: torch.Tensor, layer: int, state: torch.Tensor,
                    orig: OriginalOutput, returns_tuple: bool = False) -> torch.Tensor:
    """One patched pass from block `layer` on: what `OriginalOutput.kl` reduces (head input or logits)."""
    module = output_layer(lm)
    with resume_at_block(lm.blocks, layer, state, returns_tuple):
        if orig.head is not None and module is not None:
            with head_bypassed(module) as seen:
                lm.model(input_ids=ids, use_cache=False, **_padding_kwargs(lm, ids))
            return seen["input"]
        return lm.model(input_ids=ids, use_cache=False, **_padding_kwargs(lm, ids)).logits


@dataclass
class Variant:
    """One patched version of block l's output for every sequence of the sample."""

    name: str  # "patch", "random", "crude", "identity"
    fn_class: str
    state: np.ndarray  # [n_seq, T, d] the full patched h_{l+1}


def patched_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
               orig: OriginalOutput, batch: int, returns_tuple: bool = False) -> list[np.ndarray]:
    """All-positions patch: KL at every position, one array [n_seq, T] per variant.

    Rows (variant, sequence) are batched together, `batch` rows per forward pass.
    """
    n_seq = len(input_ids)
    rows = [(v, s) for v in range(len(variants)) for s in range(n_seq)]
    out = [np.zeros(input_ids.shape, dtype=np.float64) for _ in variants]
    with torch.inference_mode():
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            seqs = [s for _, s in chunk]
            ids = torch.as_tensor(input_ids[seqs], device=lm.device)
            state = torch.as_tensor(np.stack([variants[v].state[s] for v, s in chunk]), device=lm.device)
            kl = orig.kl(seqs, patched_outputs(lm, ids, layer, state, orig, returns_tuple)).cpu().numpy()
            for i, (v, s) in enumerate(chunk):
                out[v][s] = kl[i]
    return out


def single_position_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
                       y_state: np.ndarray, positions: np.ndarray, orig: OriginalOutput,
                       batch: int, returns_tuple: bool = False) -> list[np.ndarray]:
    """Single-position patches: for each (sequence s, position p) in `positions` [P, 2], only
    position p is patched, and the KL is read at p. Other entries of the result are NaN."""
    out = [np.full(input_ids.shape, np.nan) for _ in variants]
    rows = [(v, int(s), int(p)) for v in range(len(variants)) for s, p in positions]
    with torch.inference_mode():
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            seqs = [s for _, s, _ in chunk]
            at = [p for _, _, p in chunk]
            states = np.stack([y_state[s] for s in seqs]).copy()
            for i, (v, s, p) in enumerate(chunk):
                states[i, p] = variants[v].state[s, p]
            ids = torch.as_tensor(input_ids[seqs], device=lm.device)
            result = patched_outputs(lm, ids, layer, torch.as_tensor(states, device=lm.device), orig, returns_tuple)
            kl = orig.kl(seqs, result, at).cpu().numpy()
            for i, (v, s, p) in enumerate(chunk):
                out[v][s, p] = float(kl[i])
    return out


def later_position_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, patched: np.ndarray,
                      y_state: np.ndarray, positions: np.ndarray, orig: OriginalOutput,
                      batch: int, returns_tuple: bool = False, horizon: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For each (sequence s, position p) of `positions` [P, 2], block l's output with only position p
    replaced by `patched[s, p]`: (KL at p [P], the mean KL per position over the `horizon` positions after
    p [P]; None: over every position after p). The first is the single-position effect (as
    `single_position_kl`); the second is what removing r at p does to the rest of the sequence through
    attention, which the per-position KL does not see, per later position (a sum would grow with how
    early p sits)."""
    at, later = np.full(len(positions), np.nan), np.full(len(positions), np.nan)
    with torch.inference_mode():
        for start in range(0, len(positions), batch):
            chunk = positions[start : start + batch]
            seqs = [int(s) for s, _ in chunk]
            states = np.stack([y_state[s] for s in seqs]).copy()
            for i, (s, p) in enumerate(chunk):
                states[i, p] = patched[s, p]
            ids = torch.as_tensor(input_ids[seqs], device=lm.device)
            result = patched_outputs(lm, ids, layer, torch.as_tensor(states, device=lm.device), orig, returns_tuple)
            for i, (s, p) in enumerate(chunk):  # the head at p and after only (the positions before p do not move)
                kl = orig.kl_from(int(s), result[i], int(p)).cpu().numpy()
                at[start + i] = kl[0]
                after = np.maximum(kl[1:] if horizon is None else kl[1 : 1 + horizon], 0.0)
                later[start + i] = float(after.mean()) if len(after) else float("nan")
    return at, later


@dataclass
class SpearmanResult:
    rho: float
    p_value: float
    n: int


def spearman(err: np.ndarray, kl: np.ndarray, min_n: int = 3) -> SpearmanResult:
    """Spearman correlation over the tokens where both figures are finite."""
    ok = np.isfinite(err) & np.isfinite(kl)
    n = int(ok.sum())
    if n < min_n or np.ptp(err[ok]) == 0 or np.ptp(kl[ok]) == 0:
        return SpearmanResult(float("nan"), float("nan"), n)
    res = stats.spearmanr(err[ok], kl[ok])
    return SpearmanResult(float(res.statistic), float(res.pvalue), n)
