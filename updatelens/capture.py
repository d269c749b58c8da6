"""Record h_0 (the input of block 0) and h_{l+1} (the raw output of block l) with hooks.

Hooks are context managers in the spirit of baukit's nethook: they are removed on exit even when
the forward pass fails. Each captured tensor leaves the model device at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from updatelens.context_sources import (
    SourceAttribution,
    attention_module,
    attribute_sources,
    concat_sources,
    in_model_form,
    self_first_allowed,
)
from updatelens.errors import ModelError
from updatelens.models import LoadedModel
from updatelens.progress import Progress, progress


def first_tensor(output: object) -> torch.Tensor:
    """Blocks return a tensor in transformers 5.x and a tuple in older code: handle both."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"block output of type {type(output).__name__} holds no hidden-state tensor")


@dataclass
class Captured:
    states: np.ndarray  # [L+1, n_seq, seq_len, d] float32: h_0 .. h_L
    input_ids: np.ndarray  # [n_seq, seq_len]
    attention_mask: np.ndarray  # [n_seq, seq_len]
    block_returns_tuple: bool
    # block l run on h_l with each token attending to itself and the window's first position, per layer
    # asked for: [n_seq, seq_len, d]
    self_first: dict[int, np.ndarray] = field(default_factory=dict)
    sources: dict[int, SourceAttribution] = field(default_factory=dict)  # per such layer, where asked for

    @property
    def n_layers(self) -> int:
        return self.states.shape[0] - 1


@contextmanager
def record_block_states(blocks: nn.ModuleList, sink: list[list[torch.Tensor]]) -> Iterator[None]:
    """sink[0] receives block 0's input, sink[l+1] block l's output, one tensor per forward pass."""
    handles = []

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        sink[0].append(hidden.detach().to("cpu", torch.float32))

    def make_hook(index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            sink[index + 1].append(first_tensor(output).detach().to("cpu", torch.float32))

        return hook

    try:
        handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_hook(make_hook(i)))
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class CapturedBatch:
    """Every block's raw state for one batch of sequences: rows [start, start + len) of the sample."""

    start: int
    states: np.ndarray  # [L+1, b, seq_len, d] float32: h_0 .. h_L
    input_ids: np.ndarray  # [b, seq_len]
    attention_mask: np.ndarray  # [b, seq_len]
    block_returns_tuple: bool
    # block l run on h_l with each token attending to itself and the window's first position (the positive control), per layer
    # asked for: [b, seq_len, d] float32
    self_first: dict[int, np.ndarray] = field(default_factory=dict)
    # where the context part of each such layer's update comes from, where asked for
    sources: dict[int, SourceAttribution] = field(default_factory=dict)


class _StopForward(Exception):
    """Raised by a hook once the last needed block has run: the rest of the forward is skipped."""


@contextmanager
def stop_after_block(blocks: nn.ModuleList, last: int) -> Iterator[None]:
    """Within the context a forward pass ends (with _StopForward) right after block `last`, the last
    block included: a capture never pays for the final norm and the output head (for Gemma's
    262,144-token vocabulary, 30 times a block, and 1 MiB of logits per token)."""
    def hook(module: nn.Module, args: tuple, output: object) -> None:
        raise _StopForward

    handle = blocks[last].register_forward_hook(hook)
    try:
        yield
    except _StopForward:
        pass
    finally:
        handle.remove()


def capture_batches(lm: LoadedModel, input_ids: np.ndarray, attention_mask: np.ndarray,
                    batch_size: int = 8, last_block: int | None = None,
                    self_first: Iterable[int] = (), sources: bool = False) -> Iterator[CapturedBatch]:
    """Run the sample through the model a batch at a time, yielding each batch's states: memory
    holds one batch (L+1 x b x seq_len x d), whatever the sample size. With `last_block`, each
    forward stops after that block (transition l needs blocks 0..l only) and the states after it
    are absent (shape [last_block + 2, ...]). For each layer in `self_first` the batch also carries
    block l run again on h_l with each token attending to itself and the window's first position (`self_first_outputs`),
    and with `sources`, where the context part of its update comes from (`context_sources`)."""
    self_first = sorted(set(self_first))
    if self_first and not lm.self_attention:
        raise ModelError(f"{lm.slug}: the self-and-first block control needs attention blocks (adapter {lm.adapter!r} "
                         f"has none that take a mask)")
    last = lm.n_layers - 1 if last_block is None else last_block
    if not lm.allows_padding and not np.all(attention_mask == 1):
        raise ValueError(f"{lm.slug}: this architecture has no attention mask; pass unpadded windows")
    returns_tuple = False

    def probe(module: nn.Module, args: tuple, output: object) -> None:
        nonlocal returns_tuple
        returns_tuple = not isinstance(output, torch.Tensor)

    device = lm.device
    probe_handle = lm.blocks[0].register_forward_hook(probe)
    try:
        # counted block by block (a hook per block), so a batch as large as the sample still reports
        # its progress every few percent
        with progress(f"{lm.slug}: capture", len(input_ids) * (last + 1), "seq x block") as bar, \
                _counting_blocks(lm.blocks[: last + 1], bar):
            for start in range(0, len(input_ids), batch_size):
                sink: list[list[torch.Tensor]] = [[] for _ in range(lm.n_layers + 1)]
                ids = torch.as_tensor(input_ids[start : start + batch_size], device=device)
                mask = torch.as_tensor(attention_mask[start : start + batch_size], device=device)
                kwargs = {"attention_mask": mask} if lm.allows_padding else {}
                calls: dict[int, tuple[tuple, dict]] = {}
                with torch.inference_mode(), record_block_states(lm.blocks, sink), \
                        record_block_calls(lm.blocks, self_first, calls), stop_after_block(lm.blocks, last):
                    lm.model(input_ids=ids, use_cache=False, **kwargs)
                states = np.stack([chunks[0].numpy() for chunks in sink[: last + 2]])
                alone, found = self_first_outputs(lm, states, calls, verify=start == 0, sources=sources)
                yield CapturedBatch(start, states, input_ids[start : start + batch_size],
                                    attention_mask[start : start + batch_size], returns_tuple, alone, found)
    finally:
        probe_handle.remove()


@contextmanager
def record_block_calls(blocks: nn.ModuleList, layers: Iterable[int], calls: dict[int, tuple[tuple, dict]]) -> Iterator[None]:
    """calls[l] receives the arguments block l was called with (after its hidden-state input): the
    masks, position embeddings and positions the model built for it."""
    def make_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # by name, whether the model passed them by position (GPT-2's mask) or by keyword
            signature = inspect.signature(module.forward)
            bound = signature.bind(*args, **kwargs).arguments
            named: dict[str, object] = {}
            for position, (key, value) in enumerate(bound.items()):
                if position == 0:
                    continue  # the hidden states
                if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
                    named.update(value)
                elif signature.parameters[key].kind is not inspect.Parameter.VAR_POSITIONAL:
                    named[key] = value
            calls[index] = ((), named)

        return hook

    handles = [blocks[layer].register_forward_pre_hook(make_hook(layer), with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def mask_is_boolean(given: object, implementation: str) -> bool:
    """Whether the model's attention takes a boolean 4D mask (True: attend): where it was given one, or runs
    SDPA without one (causal by flag); False (additive: 0 where allowed, the dtype's minimum elsewhere)
    where it was given a float mask or runs eager attention."""
    if isinstance(given, torch.Tensor):
        return given.dtype == torch.bool
    if given is None:
        if implementation not in ("sdpa", "eager"):
            raise ModelError(f"the self-and-first block control needs eager or sdpa attention, not {implementation!r}")
        return implementation == "sdpa"
    raise ModelError(f"the self-and-first block control needs a tensor attention mask; the model passes "
                     f"{type(given).__name__} to its blocks")


def self_first_mask(given: object, batch: int, seq_len: int, implementation: str, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The 4D attention mask [batch, 1, T, T] that lets each position attend to itself and the
    window's first position, in the form the model's attention takes (`mask_is_boolean`)."""
    allowed = self_first_allowed(seq_len, device).expand(batch, 1, seq_len, seq_len)
    return in_model_form(allowed, mask_is_boolean(given, implementation), dtype)


def self_first_outputs(lm: LoadedModel, states: np.ndarray, calls: dict[int, tuple[tuple, dict]],
                       verify: bool = False, sources: bool = False
                       ) -> tuple[dict[int, np.ndarray], dict[int, SourceAttribution]]:
    """Block l on h_l (states[l]) with every token attending to itself and the window's first
    position, for each layer in `calls`, with the arguments the model gave the block (norms, MLP,
    position embeddings and nonlinearity all the model's own). Where every window starts with the
    same token, the first position's state is the same in every window at every layer (it sees only
    itself), so this maps each token by its own vector and that constant: tokenwise by construction,
    with the attention sink where the layer has it (docs/method.md, "Positive controls"). Called
    through `forward`, so no hook of the capture sees these calls. `verify` runs each block once more
    with the odd positions' inputs changed and raises unless every even position's output (after the
    first) is the same (the mask was honoured). With `sources`, also where a = y - y_ctl comes from,
    per head and per source distance (`context_sources.attribute_sources`; y is states[l + 1])."""
    out: dict[int, np.ndarray] = {}
    found: dict[int, SourceAttribution] = {}
    implementation = str(getattr(lm.model.config, "_attn_implementation", "") or "")
    device = lm.device
    dtype = next(lm.model.parameters()).dtype
    for layer, (args, kwargs) in sorted(calls.items()):
        x = torch.as_tensor(states[layer], device=device, dtype=dtype)
        b, t = x.shape[:2]
        given = dict(kwargs)
        boolean = mask_is_boolean(kwargs.get("attention_mask"), implementation)
        given["attention_mask"] = self_first_mask(kwargs.get("attention_mask"), b, t, implementation, dtype, device)
        block = lm.blocks[layer]

        def run(mask: torch.Tensor, inputs: torch.Tensor = x, block: nn.Module = block, args: tuple = args,
                named: dict = given) -> np.ndarray:
            with torch.inference_mode():
                return first_tensor(block.forward(inputs, *args, **{**named, "attention_mask": mask})).to(
                    "cpu", torch.float32).numpy()

        y = run(given["attention_mask"])
        if verify and t >= 3:
            changed = x.clone()
            changed[:, 1::2] = x[:, 1::2].flip(0) * 2.0 + 1.0
            again = run(given["attention_mask"], changed)
            scale = float(np.abs(y).max()) or 1.0
            gap = float(np.abs(again[:, 2::2] - y[:, 2::2]).max())
            if not np.isfinite(gap) or gap > 1e-3 * scale:
                raise ModelError(f"{lm.slug} block {layer}: with each token attending to itself and the first "
                                 f"position, a token's output still depends on the others (largest change "
                                 f"{gap:.3g} when the other positions change): the model ignores a 4D attention "
                                 f"mask, so the self-and-first control cannot be made")
        out[layer] = y
        if sources:
            found[layer] = attribute_sources(run, attention_module(block), kwargs.get("attention_mask"),
                                             states[layer + 1], y, boolean, dtype, device)
    return out, found


@contextmanager
def _counting_blocks(blocks: Iterable[nn.Module], bar: Progress) -> Iterator[None]:
    """Within the context, each call of a block advances `bar` by the batch's number of sequences."""
    def count(module: nn.Module, args: tuple, output: object) -> None:
        bar.update(int(first_tensor(output).shape[0]))

    handles = [block.register_forward_hook(count) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def self_first_layers(lm: LoadedModel, positive_controls: Iterable[str], layers: Iterable[int],
                      first_token: int | None) -> list[int]:
    """The layers whose self-and-first block outputs a capture makes: all of `layers` where the
    self-and-first control is asked for, the architecture's blocks take an attention mask and every
    window starts with the same token (`first_token`, the sample's: without it the first position
    differs between windows and the block is not tokenwise), else none."""
    wanted = "self_first" in positive_controls and lm.self_attention and first_token is not None
    return sorted(set(layers)) if wanted else []


def capture(lm: LoadedModel, input_ids: np.ndarray, attention_mask: np.ndarray, batch_size: int = 8,
            self_first: Iterable[int] = (), sources: bool = False) -> Captured:
    """The whole sample's states in memory ([L+1, n_seq, seq_len, d]), with the self-and-first block
    outputs of the layers in `self_first`: for notebooks, tests and small samples. The pipeline
    streams with `capture_batches` instead."""
    batches = list(capture_batches(lm, input_ids, attention_mask, batch_size, self_first=self_first, sources=sources))
    states = np.concatenate([b.states for b in batches], axis=1)
    alone = {layer: np.concatenate([b.self_first[layer] for b in batches]) for layer in batches[0].self_first}
    found = {layer: concat_sources([b.sources[layer] for b in batches]) for layer in batches[0].sources}
    return Captured(states=states, input_ids=input_ids, attention_mask=attention_mask,
                    block_returns_tuple=batches[-1].block_returns_tuple, self_first=alone, sources=found)


def kept_mask(attention_mask: np.ndarray, skip_first_position: bool) -> np.ndarray:
    """Tokens that enter statistics: not padding and (by default) not position 0."""
    kept = attention_mask.astype(bool).copy()
    if skip_first_position:
        kept[:, 0] = False
    return kept


def block_output_is_tuple(lm: LoadedModel) -> bool:
    """Whether this model's blocks return a tuple (older transformers) or a tensor (5.x)."""
    seen: list[bool] = []
    handle = lm.blocks[0].register_forward_hook(lambda m, a, out: seen.append(not isinstance(out, torch.Tensor)))
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=lm.device), use_cache=False)
    finally:
        handle.remove()
    return seen[0]
