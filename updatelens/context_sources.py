"""Where the context part of an update comes from: per attention head and per source distance
(docs/method.md, "The exact split").

Every window starts with one fixed token, so block l run with each token attending to itself and the
window's first position gives y_ctl, tokenwise by construction, and a = y - y_ctl is exactly what
attention to the rest of the context adds. Its sources, measured with the block's own code:

- **per head** h: the block with head h attending as the model lets it (causally) and every other head
  to itself and the first position: a_h = y_h - y_ctl is head h's context restored alone. After
  attention comes the MLP, so the block is not linear in its heads and the a_h need not add up to a:
  each head's share is the part of a along a_h, <a_h, a> / ||a||^2, and what the shares leave (1 less
  their sum) is what heads add only together;
- **per source distance** (1, 2-4, 5-16, more than 16 positions back): the context restored nearest
  first, every head attending to itself, the first position and the sources up to 1, 4, 16 positions back,
  then to all: a bin's part is what its sources add to the nearer ones (a_{<=4} - a_{<=1}, ...), so the
  parts add up to a exactly and their shares <part, a> / ||a||^2 to 1. (Restoring one bin alone would
  count twice: attention's softmax gives a lone bin the weight the others had.)
- **the attention itself**: each head's attention mass on the first position, on itself and on each
  distance, and the three sources (besides the first position and itself) with the most mass, averaged
  over the heads.

The block is called with 4D masks in the form the model gives its blocks (boolean, or additive: 0
where allowed, the dtype's minimum elsewhere), one [batch, heads, T, T] mask per restored head; the
attention probabilities come from the same block run once with eager attention on the model's own
(causal) mask, whose output must be the layer's y.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from updatelens.errors import ModelError

# (nearest, farthest) positions back of each source-distance bin; None: no farthest
DISTANCE_BINS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 4), (5, 16), (17, None))
DISTANCE_LABELS: tuple[str, ...] = ("1", "2-4", "5-16", ">16")
MASS_LABELS: tuple[str, ...] = ("first", "self", *DISTANCE_LABELS)  # where a head's attention mass goes
TOP_SOURCES = 3  # the sources with most attention kept per token (the first position and itself aside)
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")  # the block's attention module


@dataclass
class SourceAttribution:
    """Per token of a batch [b, T, ...] (float32 unless said): where a = y - y_ctl comes from."""

    head_dot: np.ndarray  # [b, T, H] <a_h, a>, a_h head h's context restored alone
    head_norm: np.ndarray  # [b, T, H] ||a_h||
    dist_dot: np.ndarray  # [b, T, 4] <c_d, a>, c_d what the sources of distance bin d add to the nearer ones
    dist_norm: np.ndarray  # [b, T, 4] ||c_d||
    mass: np.ndarray  # [b, T, H, 6] each head's attention mass on MASS_LABELS
    top_pos: np.ndarray  # [b, T, 3] int32: positions with most head-mean attention (-1: fewer sources)
    top_weight: np.ndarray  # [b, T, 3] their head-mean attention (0 where top_pos is -1)

    @property
    def n_heads(self) -> int:
        return int(self.head_dot.shape[-1])


def concat_sources(parts: list[SourceAttribution]) -> SourceAttribution:
    """Batches' attributions as one, sequences in order."""
    return SourceAttribution(*(np.concatenate([getattr(p, f.name) for p in parts])
                               for f in dataclasses.fields(SourceAttribution)))


def attention_module(block: nn.Module) -> nn.Module:
    """The block's attention module (its first child named like one of ATTENTION_NAMES)."""
    for name in ATTENTION_NAMES:
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ModelError(f"block {type(block).__name__} has no attention module named one of {', '.join(ATTENTION_NAMES)}: "
                     f"the context's sources per head cannot be measured")


def n_heads_of(attention: nn.Module) -> int:
    """The number of query heads of an attention module (its config's, or its own attribute)."""
    config = getattr(attention, "config", None)
    for owner, name in ((config, "num_attention_heads"), (config, "n_head"), (attention, "num_heads"),
                        (attention, "num_attention_heads")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelError(f"{type(attention).__name__}: no number of attention heads found")


def allowed_by_model(given: object, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch, 1, T, T] bool: where the model lets each position attend (its mask given to the block;
    causal where it gave none, attention then being causal by flag)."""
    if given is None:
        return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril().expand(batch, 1, seq_len, seq_len)
    if not isinstance(given, torch.Tensor) or given.ndim != 4:
        raise ModelError(f"the context's sources need a 4D attention mask; the model passes "
                         f"{type(given).__name__} to its blocks")
    allowed = given if given.dtype == torch.bool else given > torch.finfo(given.dtype).min / 2
    return allowed[..., :seq_len, :seq_len].expand(batch, 1, seq_len, seq_len)


def self_first_allowed(seq_len: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool: each position attends to itself and the window's first position."""
    allowed = torch.eye(seq_len, dtype=torch.bool, device=device)
    allowed[:, 0] = True
    return allowed


def distance_allowed(seq_len: int, nearest: int, farthest: int | None, device: torch.device) -> torch.Tensor:
    """[T, T] bool: the sources `nearest`..`farthest` positions back (farthest None: any further)."""
    back = torch.arange(seq_len, device=device)[:, None] - torch.arange(seq_len, device=device)[None, :]
    allowed = back >= nearest
    return allowed & (back <= farthest) if farthest is not None else allowed


def in_model_form(allowed: torch.Tensor, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the model's attention takes it: itself, or additive (0 / the dtype's minimum)."""
    if boolean:
        return allowed.contiguous()
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device),
                       torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


@contextmanager
def eager_attention(attention: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the context the attention module runs eager attention and each call's probabilities
    [b, H, T, T] are appended to the yielded list; its implementation is put back on exit."""
    config = getattr(attention, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ModelError(f"{type(attention).__name__} has no config naming its attention implementation: its "
                         f"attention probabilities cannot be read")
    before = config._attn_implementation
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
        if not isinstance(weights, torch.Tensor):
            raise ModelError(f"{type(module).__name__} returned no attention probabilities with eager attention")
        seen.append(weights.detach().to("cpu", torch.float32))

    handle = attention.register_forward_hook(hook)
    config._attn_implementation = "eager"
    try:
        yield seen
    finally:
        config._attn_implementation = before
        handle.remove()


def attention_mass(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From probabilities [b, H, T, T]: the mass per head on MASS_LABELS [b, T, H, 6], and per token the
    TOP_SOURCES positions (not the first, not itself) with most head-mean attention and that attention
    ([b, T, 3] each; -1 and 0 where a token has fewer such sources)."""
    b, h, t, _ = probs.shape
    back = np.arange(t)[:, None] - np.arange(t)[None, :]  # [T(query), T(source)]
    first = np.zeros((t, t), bool)
    first[:, 0] = True
    regions = [first, (back == 0) & ~first]
    regions += [(back >= lo) & (back <= (hi if hi is not None else t)) & ~first for lo, hi in DISTANCE_BINS]
    mass = np.stack([(probs * region).sum(-1) for region in regions], axis=-1)  # [b, H, T, 6]
    mean = probs.mean(axis=1)  # [b, T, T]
    others = (back > 0) & ~first
    scored = np.where(others[None], mean, -1.0)
    k = min(TOP_SOURCES, t)
    top = np.argsort(-scored, axis=-1, kind="stable")[..., :k]
    weight = np.take_along_axis(scored, top, axis=-1)
    top_pos = np.full((b, t, TOP_SOURCES), -1, np.int32)
    top_weight = np.zeros((b, t, TOP_SOURCES), np.float32)
    valid = weight >= 0
    top_pos[..., :k] = np.where(valid, top, -1)
    top_weight[..., :k] = np.where(valid, weight, 0.0)
    return mass.transpose(0, 2, 1, 3).astype(np.float32), top_pos, top_weight


def attribute_sources(run: Callable[[torch.Tensor], np.ndarray], attention: nn.Module, given: object,
                      y: np.ndarray, y_ctl: np.ndarray, boolean: bool, dtype: torch.dtype,
                      device: torch.device) -> SourceAttribution:
    """The sources of a = y - y_ctl for one batch of one block. `run(mask)`: the block's output [b, T, d]
    (float32) on its input with that 4D attention mask in the model's form; `given`: the mask the model
    gave the block; `y`, `y_ctl` [b, T, d]: the block's output and its self-and-first output."""
    b, t = y.shape[:2]
    heads = n_heads_of(attention)
    full = allowed_by_model(given, b, t, device)  # [b, 1, T, T]
    ctl = self_first_allowed(t, device).expand(b, 1, t, t)  # as y_ctl was made (capture.self_first_mask)
    a = y.astype(np.float64) - y_ctl.astype(np.float64)

    def restored(allowed: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        part = run(in_model_form(allowed, boolean, dtype)).astype(np.float64) - y_ctl
        return np.einsum("btd,btd->bt", part, a), np.linalg.norm(part, axis=-1)

    head_dot, head_norm = np.empty((b, t, heads)), np.empty((b, t, heads))
    for h in range(heads):
        per_head = ctl.expand(b, heads, t, t).clone()
        per_head[:, h] = full[:, 0]
        head_dot[..., h], head_norm[..., h] = restored(per_head)
    dist_dot, dist_norm = np.empty((b, t, len(DISTANCE_BINS))), np.empty((b, t, len(DISTANCE_BINS)))
    before = np.zeros_like(a)  # a_{<= previous bin}: the context up to the previous bin's farthest source
    for i, (_, farthest) in enumerate(DISTANCE_BINS):
        if farthest is None:  # every source restored: the model's own mask, whose output is y (checked below)
            window = a
        else:
            window = (run(in_model_form(ctl | (distance_allowed(t, 1, farthest, device) & full), boolean, dtype))
                      .astype(np.float64) - y_ctl)
        part = window - before  # what the sources of this bin add to the nearer ones (the last: a - a_{<= 16})
        dist_dot[..., i], dist_norm[..., i] = np.einsum("btd,btd->bt", part, a), np.linalg.norm(part, axis=-1)
        before = window
    with eager_attention(attention) as seen:
        again = run(in_model_form(full, False, dtype))
    scale = float(np.abs(y).max()) or 1.0
    gap = float(np.abs(again - y).max())
    if not np.isfinite(gap) or gap > 1e-3 * scale or len(seen) != 1:
        raise ModelError(f"block {type(attention).__name__}: with eager attention on the model's own mask the block's "
                         f"output differs from its output in the forward pass (largest change {gap:.3g}): its "
                         f"attention probabilities would not be the ones that made y")
    mass, top_pos, top_weight = attention_mass(seen[0].numpy())
    return SourceAttribution(head_dot.astype(np.float32), head_norm.astype(np.float32), dist_dot.astype(np.float32),
                             dist_norm.astype(np.float32), mass, top_pos, top_weight)
