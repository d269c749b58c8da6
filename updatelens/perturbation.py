"""Output perturbation: replace block l's output, measure KL(p_orig || p_patched) per token.

The patched forward *resumes* from block l: blocks 0..l-1 are bypassed (their forward returns its
input unchanged) and block l's forward returns the patched state, so only blocks l+1..L-1, the
final norm and the head do work. Because block l's output is the only thing that reaches block
l+1, this is exactly the full model with h_{l+1} replaced, at about (L-l)/L of the cost. The
replacement is a `forward` attribute on the block instance (not a hook), so transformers' own
output recorders see the patched value; it is removed on exit even when the pass fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
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
            block.forward = identity  # type: ignore[method-assign]
        touched[-1].forward = replaced  # type: ignore[method-assign]
        yield
    finally:
        for block in touched:
            if "forward" in block.__dict__:
                del block.forward


def _forward_logp(lm: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    kwargs = {"attention_mask": torch.ones_like(ids)} if lm.allows_padding else {}
    logits = lm.model(input_ids=ids, use_cache=False, **kwargs).logits
    return torch.log_softmax(logits.float(), dim=-1)


# ---- the reference distributions and the KL against them ---------------------------------------
# KL(p || q) over a 49k vocabulary costs as much in memory passes as the head's matmul itself. When
# the logits are a plain linear map of the head's input h (z = W h + b: checked per model, not
# assumed), the patched logits differ from the original ones by δ = W (h_q - h_p), the bias
# cancels, and
#     KL(p || q) = logsumexp(log p + δ) - logsumexp(log p) - Σ_v p_v δ_v,
# with Σ_v p_v δ_v = (Wᵀ p) · (h_q - h_p) computed in model space. That is one matmul and two
# passes over the vocabulary instead of a log-softmax and four, it is exactly 0 when nothing
# changed (δ = 0), and it is worked in token chunks that stay in cache.
KL_TOKEN_CHUNK = 64


@dataclass
class OutputReference:
    """log p_orig per position, and (fast path) the head's input and Wᵀp of the original pass."""

    logp: torch.Tensor  # [n_seq, T, V] float32
    head_input: torch.Tensor | None = None  # [n_seq, T, d], None: the logits are not a plain linear map
    expected_weight: torch.Tensor | None = None  # [n_seq, T, d] Wᵀ p per position
    lse0: torch.Tensor | None = None  # [n_seq, T] logsumexp(log p), ~0 up to rounding

    def select(self, seqs: list[int] | slice) -> OutputReference:
        pick = (lambda t: t[seqs] if t is not None else None)  # noqa: E731
        return OutputReference(self.logp[seqs], pick(self.head_input), pick(self.expected_weight), pick(self.lse0))

    @property
    def fast(self) -> bool:
        return self.head_input is not None


def _model_inputs(lm: LoadedModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    kwargs = {"attention_mask": torch.ones_like(ids)} if lm.allows_padding else {}
    return {"input_ids": ids, "use_cache": False, **kwargs}  # type: ignore[dict-item]


def _head(lm: LoadedModel) -> nn.Linear | None:
    head = lm.model.get_output_embeddings() if hasattr(lm.model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Linear) else None


def _head_input(lm: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The final hidden state that the output head reads (the base model's last_hidden_state)."""
    return lm.model.base_model(**_model_inputs(lm, ids)).last_hidden_state


def plain_head(lm: LoadedModel, ids: torch.Tensor, tol: float = 1e-4) -> bool:
    """Whether logits == head(base_model(...).last_hidden_state) for this model (no soft-capping,
    scaling or other post-processing), checked on `ids`; the fast KL is used only then."""
    head = _head(lm)
    if head is None or getattr(lm.model, "base_model", None) is lm.model:
        return False
    try:
        with torch.inference_mode():
            logits = lm.model(**_model_inputs(lm, ids)).logits.float()
            mine = head(_head_input(lm, ids)).float()
    except (AttributeError, TypeError, RuntimeError):
        return False
    return mine.shape == logits.shape and bool(torch.allclose(mine, logits, rtol=tol, atol=tol * logits.abs().max()))


def original_log_probs(lm: LoadedModel, input_ids: np.ndarray, batch: int, fast: bool = True) -> OutputReference:
    """log p_orig for every position of the sample (float32 on the CPU), and what the fast KL needs."""
    ids_all = torch.as_tensor(input_ids, device=lm.device)
    use_fast = fast and plain_head(lm, ids_all[:1])
    head = _head(lm)
    logps, inputs, weights = [], [], []
    with torch.inference_mode():
        for start in range(0, len(input_ids), batch):
            ids = ids_all[start : start + batch]
            if use_fast:
                assert head is not None
                h = _head_input(lm, ids)
                logp = torch.log_softmax(head(h).float(), dim=-1)
                inputs.append(h.float().cpu())
                weights.append((logp.exp() @ head.weight.float()).cpu())
            else:
                logp = _forward_logp(lm, ids)
            logps.append(logp.cpu())
    logp_all = torch.cat(logps)
    if not use_fast:
        return OutputReference(logp_all)
    return OutputReference(logp_all, torch.cat(inputs), torch.cat(weights), torch.logsumexp(logp_all, dim=-1))


def kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, natural log; clamped at 0 against rounding (the reference)."""
    return (logp.exp() * (logp - logq)).sum(dim=-1).clamp_min(0.0)


def kl_from_head_inputs(ref: OutputReference, h_q: torch.Tensor, weight: torch.Tensor,
                        chunk: int = KL_TOKEN_CHUNK) -> torch.Tensor:
    """KL(p || q) [B, T] from the patched head inputs h_q [B, T, d] (fast path; see above)."""
    assert ref.head_input is not None and ref.expected_weight is not None and ref.lse0 is not None
    dh = (h_q.float() - ref.head_input.to(h_q.device)).reshape(-1, h_q.shape[-1])
    logp = ref.logp.reshape(-1, ref.logp.shape[-1])
    expected = (ref.expected_weight.reshape(dh.shape).to(dh.device) * dh).sum(-1)
    out = torch.empty(len(dh), dtype=torch.float32, device=dh.device)
    w = weight.float()
    for start in range(0, len(dh), chunk):
        part = slice(start, start + chunk)
        delta = dh[part] @ w.T
        delta += logp[part].to(delta.device)
        out[part] = torch.logsumexp(delta, dim=-1)
    kl = out - ref.lse0.reshape(-1).to(out.device) - expected
    return kl.reshape(h_q.shape[:2]).clamp_min(0.0)


def _patched_kl_batch(lm: LoadedModel, ids: torch.Tensor, ref: OutputReference) -> torch.Tensor:
    """KL [B, T] of one forward pass (the patch is already installed)."""
    head = _head(lm)
    if ref.fast and head is not None:
        return kl_from_head_inputs(ref, _head_input(lm, ids), head.weight).cpu()
    return kl_rows(ref.logp, _forward_logp(lm, ids).cpu())


@dataclass
class Variant:
    """One patched version of block l's output for every sequence of the sample."""

    name: str  # "patch", "random", "crude", "identity"
    fn_class: str
    state: np.ndarray  # [n_seq, T, d] the full patched h_{l+1}


def patched_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
               orig: OutputReference, batch: int, returns_tuple: bool = False) -> list[np.ndarray]:
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
            with resume_at_block(lm.blocks, layer, state, returns_tuple):
                kl = _patched_kl_batch(lm, ids, orig.select(seqs)).double().numpy()
            for i, (v, s) in enumerate(chunk):
                out[v][s] = kl[i]
    return out


def single_position_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
                       y_state: np.ndarray, positions: np.ndarray, orig: OutputReference,
                       batch: int, returns_tuple: bool = False) -> list[np.ndarray]:
    """Single-position patches: for each (sequence s, position p) in `positions` [P, 2], only
    position p is patched, and the KL is read at p. Other entries of the result are NaN."""
    out = [np.full(input_ids.shape, np.nan) for _ in variants]
    rows = [(v, int(s), int(p)) for v in range(len(variants)) for s, p in positions]
    with torch.inference_mode():
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            seqs = [s for _, s, _ in chunk]
            states = np.stack([y_state[s] for s in seqs]).copy()
            for i, (v, s, p) in enumerate(chunk):
                states[i, p] = variants[v].state[s, p]
            ids = torch.as_tensor(input_ids[seqs], device=lm.device)
            with resume_at_block(lm.blocks, layer, torch.as_tensor(states, device=lm.device), returns_tuple):
                kl = _patched_kl_batch(lm, ids, orig.select(seqs))
            for i, (v, s, p) in enumerate(chunk):
                out[v][s, p] = float(kl[i, p])
    return out


def random_control(y: np.ndarray, residual_norm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """y + ||r|| u with u a random unit vector per token: exactly as far from y as T(x) is."""
    u = rng.standard_normal(y.shape)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    return y + residual_norm[..., None] * u


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
