"""An independent brute-force check of where the context part comes from (updatelens.context_sources),
for Llama-family blocks (a `self_attn` whose `o_proj` takes the heads' outputs side by side, rotary
position embeddings given to the block).

The product builds 4D attention masks: one per restored head ([batch, heads, T, T]) and one per
distance window. The oracle uses no custom mask at all:

- y_ctl: each token run in a window of its own, [first token, token], at its own positions (the rotary
  embeddings of positions 0 and i), with the block's plain causal attention;
- head h restored: the same two-token windows, with head h's slice of `o_proj`'s input replaced by the
  one the block computed in the real forward pass (head h's mix over the whole context), one block call
  per head;
- the context up to f positions back: each token run in the window [first token, tokens i - f .. i];
- attention mass: the model's own `output_attentions=True` probabilities with eager attention.

It compares those with the product's capture on the same windows and writes the largest differences,
relative to the largest |a| (the dot products to ||a||^2):

    python -m bench.context_oracle bench/records/context_oracle-smollm2-135m.json [--layers 3,15] [--windows 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from updatelens.analysis import model_sample
from updatelens.capture import capture
from updatelens.config import AnalysisConfig
from updatelens.context_sources import DISTANCE_BINS, MASS_LABELS
from updatelens.models import LoadedModel, load_model
from updatelens.registry import DEFAULT_CORPUS, get_corpus, get_model


def _first(output: object) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]  # type: ignore[index]


def oracle(lm: LoadedModel, input_ids: np.ndarray, layer: int) -> dict[str, np.ndarray]:
    """y_ctl [b, T, d], the heads' and the cumulative distance windows' dot products with a ([b, T, H] and
    [b, T, 3]: up to 1, 4, 16 positions back; the last bin is a itself) and the attention mass [b, T, H, 6],
    position 0 left at 0, by the methods of the module docstring."""
    block = lm.blocks[layer]
    attention: Any = block.self_attn
    heads = int(lm.model.config.num_attention_heads)
    head_dim = int(attention.head_dim)
    seen: dict[str, object] = {}

    def keep_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def keep_output(module: torch.nn.Module, args: tuple, output: object) -> None:
        seen["y"] = _first(output).detach()

    def keep_heads(module: torch.nn.Module, args: tuple) -> None:
        seen["z"] = args[0].detach()

    hooks = [block.register_forward_pre_hook(keep_call, with_kwargs=True), block.register_forward_hook(keep_output),
             attention.o_proj.register_forward_pre_hook(keep_heads)]
    config = lm.model.config
    before = config._attn_implementation
    try:
        with torch.inference_mode():
            config._attn_implementation = "eager"
            out = lm.model(input_ids=torch.as_tensor(input_ids), use_cache=False, output_attentions=True)
            probs = out.attentions[layer].float().numpy()  # [b, H, T, T]
            config._attn_implementation = before
            lm.model(input_ids=torch.as_tensor(input_ids), use_cache=False)  # the states of the run the product sees
    finally:
        config._attn_implementation = before
        for hook in hooks:
            hook.remove()
    x, y, z_full = seen["x"], seen["y"], seen["z"]  # [b, T, d], [b, T, d], [b, T, H * head_dim]
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and isinstance(z_full, torch.Tensor)
    kwargs: dict[str, Any] = dict(seen["kwargs"])  # type: ignore[call-overload]
    cos, sin = kwargs["position_embeddings"]
    b, t, d = x.shape

    def window_run(i: int, positions: list[int], splice: int | None = None) -> torch.Tensor:
        """Block l on each window's tokens at `positions` (plain causal attention), the output at its last
        position (token i); with `splice`, head `splice`'s input to o_proj at that position is the full run's."""
        def replace(module: torch.nn.Module, args: tuple) -> tuple:
            assert splice is not None
            part = slice(splice * head_dim, (splice + 1) * head_dim)
            z = args[0].clone()
            z[:, -1, part] = z_full[:, i, part]
            return (z,)

        index = torch.as_tensor(positions)
        given = {"attention_mask": None, "position_ids": index[None].expand(b, -1),
                 "position_embeddings": (cos[:, index], sin[:, index]),
                 "use_cache": False}
        hook = attention.o_proj.register_forward_pre_hook(replace) if splice is not None else None
        try:
            with torch.inference_mode():
                return _first(block(x[:, index], **given))[:, -1].float()
        finally:
            if hook is not None:
                hook.remove()

    y_ctl = np.zeros((b, t, d), np.float32)
    head_dot = np.zeros((b, t, heads))
    dist_dot = np.zeros((b, t, len(DISTANCE_BINS) - 1))
    for i in range(1, t):
        pair = [0, i]
        ctl = window_run(i, pair)
        y_ctl[:, i] = ctl.numpy()
        a = (y[:, i].float() - ctl).double()
        for h in range(heads):
            head_dot[:, i, h] = ((window_run(i, pair, splice=h).double() - ctl.double()) * a).sum(-1).numpy()
        for j, (_, farthest) in enumerate(DISTANCE_BINS[:-1]):
            assert farthest is not None
            window = [0] + list(range(max(1, i - farthest), i + 1))
            dist_dot[:, i, j] = ((window_run(i, window).double() - ctl.double()) * a).sum(-1).numpy()
    back = np.arange(t)[:, None] - np.arange(t)[None, :]
    mass = np.zeros((b, t, heads, len(MASS_LABELS)))
    for i in range(1, t):
        for j in range(0, i + 1):
            slot = 0 if j == 0 else 1 if j == i else 2 + next(k for k, (lo, hi) in enumerate(DISTANCE_BINS)
                                                                if back[i, j] >= lo and (hi is None or back[i, j] <= hi))
            mass[:, i, :, slot] += probs[:, :, i, j]
    return {"y": y.float().numpy(), "y_ctl": y_ctl, "head_dot": head_dot, "dist_dot": dist_dot, "mass": mass}


def compare(lm: LoadedModel, input_ids: np.ndarray, layer: int) -> dict[str, Any]:
    """The largest differences between the product's capture and the oracle at one layer (positions 1..)."""
    cap = capture(lm, input_ids, np.ones_like(input_ids), len(input_ids), self_first=[layer], sources=True)
    src = cap.sources[layer]
    want = oracle(lm, input_ids, layer)
    y, y_ctl = cap.states[layer + 1][:, 1:], cap.self_first[layer][:, 1:]
    a = (y - y_ctl).astype(np.float64)
    energy = (a * a).sum(-1)
    cumulative = np.cumsum(src.dist_dot[:, 1:].astype(np.float64), axis=-1)[..., :-1]  # the windows up to 1, 4, 16
    scale = float(energy.max())
    return {
        "y_ctl_max_diff_rel": float(np.abs(y_ctl - want["y_ctl"][:, 1:]).max() / np.abs(a).max()),
        "head_dot_max_diff_rel": float(np.abs(src.head_dot[:, 1:] - want["head_dot"][:, 1:]).max() / scale),
        "dist_dot_max_diff_rel": float(np.abs(cumulative - want["dist_dot"][:, 1:]).max() / scale),
        "mass_max_diff": float(np.abs(src.mass[:, 1:] - want["mass"][:, 1:]).max()),
        "head_shares_product": [round(float(v), 4) for v in src.head_dot[:, 1:].sum((0, 1)) / energy.sum()],
        "head_shares_oracle": [round(float(v), 4) for v in want["head_dot"][:, 1:].sum((0, 1)) / energy.sum()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="3,15")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    lm = load_model(get_model(args.model))
    cfg = AnalysisConfig(n_seq=args.windows, seq_len=args.seq_len)
    sample = model_sample(lm, get_corpus(DEFAULT_CORPUS), cfg)
    record: dict[str, object] = {"model": lm.slug, "windows": args.windows, "seq_len": args.seq_len,
                                 "corpus_slice": sample.slice_desc,
                                 "dtypes": "float32: as the product runs (the two methods round differently: "
                                           "attention over 64 positions against 2); float64: the model cast to "
                                           "float64 for both (the capture still stores float32 states)",
                                 "layers": {}}
    for dtype in (torch.float32, torch.float64):
        lm.model.to(dtype)
        for layer in (int(v) for v in args.layers.split(",")):
            start = time.perf_counter()
            found = compare(lm, sample.input_ids, layer)
            found["seconds"] = round(time.perf_counter() - start, 1)
            record["layers"].setdefault(str(layer), {})[str(dtype).removeprefix("torch.")] = found  # type: ignore[attr-defined]
            print(layer, dtype, json.dumps(found))
    lm.model.to(torch.float32)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
