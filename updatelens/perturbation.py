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


def original_log_probs(lm: LoadedModel, input_ids: np.ndarray, batch: int) -> torch.Tensor:
    """log p_orig for every position of the sample: [n_seq, T, V] float32 on the CPU."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(input_ids), batch):
            ids = torch.as_tensor(input_ids[start : start + batch], device=lm.device)
            out.append(_forward_logp(lm, ids).cpu())
    return torch.cat(out)


def kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, natural log; clamped at 0 against rounding."""
    return (logp.exp() * (logp - logq)).sum(dim=-1).clamp_min(0.0)


@dataclass
class Variant:
    """One patched version of block l's output for every sequence of the sample."""

    name: str  # "patch", "random", "crude", "identity"
    fn_class: str
    state: np.ndarray  # [n_seq, T, d] the full patched h_{l+1}


def patched_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
               orig_logp: torch.Tensor, batch: int, returns_tuple: bool = False) -> list[np.ndarray]:
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
                logq = _forward_logp(lm, ids).cpu()
            kl = kl_rows(orig_logp[seqs], logq).double().numpy()
            for i, (v, s) in enumerate(chunk):
                out[v][s] = kl[i]
    return out


def single_position_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
                       y_state: np.ndarray, positions: np.ndarray, orig_logp: torch.Tensor,
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
                logq = _forward_logp(lm, ids).cpu()
            for i, (v, s, p) in enumerate(chunk):
                out[v][s, p] = float(kl_rows(orig_logp[s, p], logq[i, p]))
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
