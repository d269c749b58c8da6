"""Exact single-position effects for every token at the cost of about one patched pass.

With only token t's state replaced after block l, every later block sees, at positions before t,
the unpatched states (a causal model: t cannot reach them), so their keys and values are the
unpatched pass's; at t the query, key and value come from the patched state. One pass therefore
gives every position's single-position effect at once: run the unpatched stream and the patched
streams side by side in one batch, and in every attention layer after l let a patched row's query
attend to the unpatched row's keys and values except on the diagonal, where its own key and value
stand. The position-wise parts of a block (norms, MLP) act on each position alone, so they need no
change. Exact, not an approximation: equal to patching one position per forward pass
(tests: every supported architecture against that brute force).

Attention is swapped through transformers' attention interface (an attention function registered
under its own name, with the eager causal/sliding-window mask), so it applies to the architectures
whose attention layers dispatch through that interface with the standard arguments (query, key,
value [b, heads, T, head_dim], additive mask, `scaling`): Llama/SmolLM2, Mistral, Qwen2, Gemma 3,
GPT-NeoX, GPT-2. Others (Mamba: no attention) are measured with every position patched at once
(`patch_mode="auto"`), or one position per pass on a subsample (`"single"`); the rows say which.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from updatelens.models import LoadedModel
from updatelens.perturbation import OriginalOutput, Variant, patched_outputs

NAME = "updatelens_single_position"
# model types whose attention layers take the standard interface arguments (checked in the tests
# against brute-force single-position patching)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gemma2", "gemma", "gpt_neox", "gpt2")


@dataclass
class _Streams:
    """How the rows of the current batch are grouped: `groups` groups of `size` rows, the first the
    unpatched stream, each other one a patched stream of the same sequences in the same order."""

    first_layer: int  # attention layers from here on substitute the diagonal
    size: int = 0
    active: bool = False
    seen: set[int] = field(default_factory=set)


_STATE = _Streams(first_layer=0)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def diagonal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       softcap: float | None = None, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention where the rows of each patched stream attend to the unpatched stream's keys and
    values off the diagonal (layers after the patched one); plain eager attention otherwise."""
    heads, head_dim = query.shape[1], query.shape[-1]
    scale = scaling if scaling is not None else head_dim ** -0.5
    key, value = _repeat_kv(key, heads), _repeat_kv(value, heads)
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx: single-position attention cannot place it")
    _STATE.seen.add(int(layer))
    size = _STATE.size
    if _STATE.active and layer > _STATE.first_layer and size and query.shape[0] > size:
        groups = query.shape[0] // size
        ref_key = key[:size].repeat(groups, 1, 1, 1)
        ref_value = value[:size].repeat(groups, 1, 1, 1)
        scores = query @ ref_key.transpose(-1, -2) * scale
        own = (query * key).sum(dim=-1) * scale  # [b, heads, T]: each position's own key
        scores = scores.clone()
        scores.diagonal(dim1=-2, dim2=-1).copy_(own)
        own_value_delta = value - ref_value
    else:
        ref_value = value
        scores = query @ key.transpose(-1, -2) * scale
        own_value_delta = None
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
    out = weights @ ref_value
    if own_value_delta is not None:
        out = out + weights.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * own_value_delta
    return out.transpose(1, 2).contiguous(), weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, diagonal_attention)
    AttentionMaskInterface.register(NAME, eager_mask)


def supported(lm: LoadedModel) -> bool:
    """Whether this model's attention layers take the single-position attention (GPT-2's only without
    its reordered, upcast attention, which bypasses the interface)."""
    config = lm.model.config
    return getattr(config, "model_type", "") in SUPPORTED and not getattr(config, "reorder_and_upcast_attn", False)


def resolve_patch_mode(lm: LoadedModel, patch_mode: str) -> str:
    """The patch mode a model is measured with: "auto" is "exact" where supported, else "all"."""
    if patch_mode == "auto":
        return "exact" if supported(lm) else "all"
    return patch_mode


@contextmanager
def diagonal_streams(lm: LoadedModel, layer: int) -> Iterator[_Streams]:
    """Within the context the model's attention is the single-position attention for layers after
    `layer` (set `streams.size` and `streams.active` per batch); restored on exit."""
    _register()
    config = lm.model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    _STATE.first_layer, _STATE.size, _STATE.active = layer, 0, False
    _STATE.seen.clear()
    try:
        yield _STATE
    finally:
        config._attn_implementation = before
        _STATE.active, _STATE.size = False, 0


def all_single_position_kl(lm: LoadedModel, input_ids: np.ndarray, layer: int, variants: list[Variant],
                           y_state: np.ndarray, orig: OriginalOutput, batch: int,
                           returns_tuple: bool = False) -> list[np.ndarray]:
    """KL at every position when that position alone is patched, one array [n_seq, T] per variant:
    for each block of sequences one pass of 1 + len(variants) streams (the unpatched one first).
    `batch`: about how many rows a pass takes (at least one sequence's streams)."""
    if not supported(lm):
        raise ValueError(f"{lm.slug}: single-position attention is not supported for "
                         f"{getattr(lm.model.config, 'model_type', '?')}; use patch_mode='single' (subsampled)")
    n_seq = len(input_ids)
    per_pass = max(1, batch // (1 + len(variants)))
    out = [np.zeros(input_ids.shape, dtype=np.float64) for _ in variants]
    with torch.inference_mode(), diagonal_streams(lm, layer) as streams:
        for start in range(0, n_seq, per_pass):
            seqs = list(range(start, min(n_seq, start + per_pass)))
            states = np.concatenate([y_state[seqs]] + [v.state[seqs] for v in variants])
            ids = torch.as_tensor(np.tile(input_ids[seqs], (1 + len(variants), 1)), device=lm.device)
            streams.size, streams.active = len(seqs), True
            result = patched_outputs(lm, ids, layer, torch.as_tensor(states, device=lm.device), orig, returns_tuple)
            streams.active = False
            for i in range(len(variants)):
                rows = result[(i + 1) * len(seqs) : (i + 2) * len(seqs)]
                out[i][seqs] = orig.kl(seqs, rows).cpu().numpy()
        expected = set(range(layer + 1, lm.n_layers))
        if not expected <= streams.seen:
            raise RuntimeError(f"{lm.slug}: the attention of layers {sorted(expected - streams.seen)} did not go "
                               f"through the single-position attention; its effects would be wrong")
    return out
