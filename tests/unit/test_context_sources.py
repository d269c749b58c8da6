"""Where the context part a = y - y_ctl comes from (updatelens.context_sources): per head, per source
distance and in the attention itself. Planted blocks whose heads attend only where the test says give
the shares by construction; the distance parts add up to a; an independent oracle (bench/context_oracle:
two-token windows and a spliced head, no custom masks) agrees; the stored table's check fails on the
faults it exists for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.unit.test_controls import ATTENTION, ids
from updatelens.capture import capture
from updatelens.context_sources import DISTANCE_LABELS, attention_mass, attention_module, self_first_allowed
from updatelens.models import LoadedModel


@contextmanager
def planted_heads(lm: LoadedModel, layer: int, context_heads: set[int]) -> Iterator[None]:
    """Within the context block `layer`'s heads outside `context_heads` attend only to themselves and the
    first position, whatever mask the block is given (the given mask is and-ed with the planted one)."""
    attention = attention_module(lm.blocks[layer])
    heads = int(lm.model.config.num_attention_heads)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        b, t = hidden.shape[:2]
        planted = self_first_allowed(t, hidden.device).expand(b, heads, t, t).clone()
        for h in context_heads:
            planted[:, h] = True
        given = kwargs.get("attention_mask")
        if given is None:
            mask = planted & torch.ones(t, t, dtype=torch.bool).tril()
        elif given.dtype == torch.bool:
            mask = planted & given[..., :t, :t]
        else:
            mask = torch.where(planted, given[..., :t, :t], torch.finfo(given.dtype).min)
        return args, {**kwargs, "attention_mask": mask}

    handle = attention.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def shares(lm: LoadedModel, x: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a [n, T, d], the heads' shares, the distance bins' shares) over positions 1.. of a capture."""
    cap = capture(lm, x, np.ones_like(x), len(x), self_first=[layer], sources=True)
    src = cap.sources[layer]
    a = (cap.states[layer + 1] - cap.self_first[layer]).astype(np.float64)
    energy = float((a[:, 1:] ** 2).sum()) or 1.0
    return (a, src.head_dot[:, 1:].astype(np.float64).sum((0, 1)) / energy,
            src.dist_dot[:, 1:].astype(np.float64).sum((0, 1)) / energy)


def test_a_block_whose_heads_attend_only_to_themselves_and_the_first_position_has_no_context_part(
        tiny_models: dict) -> None:
    lm = tiny_models["tiny-llama"]
    x = ids(3, 12)
    with planted_heads(lm, 1, set()):
        cap = capture(lm, x, np.ones_like(x), 3, self_first=[1], sources=True)
    a = cap.states[2] - cap.self_first[1]
    assert np.abs(a).max() < 1e-5 * np.abs(cap.states[2]).max()
    src = cap.sources[1]
    assert np.abs(src.head_norm).max() < 1e-4 and np.abs(src.dist_norm).max() < 1e-4


@pytest.mark.parametrize("head", [0, 2])
def test_a_planted_context_head_carries_the_whole_context_part(tiny_models: dict, head: int) -> None:
    """Only head `head` sees the context: its share is 1, the others' 0, nothing is left to the heads
    together, and its attention mass away from the first position and itself is the only one."""
    lm = tiny_models["tiny-llama"]
    x = ids(3, 20)
    with planted_heads(lm, 1, {head}):
        a, heads, dist = shares(lm, x, 1)
        cap = capture(lm, x, np.ones_like(x), 3, self_first=[1], sources=True)
    assert np.abs(a).max() > 1e-3  # the planted head does add something
    want = np.zeros(len(heads))
    want[head] = 1.0
    np.testing.assert_allclose(heads, want, atol=1e-5)
    np.testing.assert_allclose(dist.sum(), 1.0, atol=1e-5)
    context = cap.sources[1].mass[:, 1:, :, 2:].sum(-1)  # [n, T-1, H]
    others = np.delete(context, head, axis=-1)
    assert others.max() < 1e-6 and context[..., head].mean() > 0.1


@pytest.mark.parametrize("slug", ATTENTION)
def test_the_distance_parts_add_up_to_a_and_each_heads_attention_to_one(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    x = ids(2, 24, seed=3)
    a, heads, dist = shares(lm, x, 1)
    assert len(dist) == len(DISTANCE_LABELS)
    np.testing.assert_allclose(dist.sum(), 1.0, atol=1e-5)
    assert np.isfinite(heads).all() and abs(heads.sum() - 1.0) < 0.5  # not exact: the MLP follows attention
    cap = capture(lm, x, np.ones_like(x), 2, self_first=[1], sources=True)
    src = cap.sources[1]
    np.testing.assert_allclose(src.mass.sum(-1), 1.0, atol=1e-5)
    assert (src.top_pos[:, 4:] > 0).all()  # positions 4.. have 3 sources besides the first and themselves
    assert (src.top_pos[:, 1] == -1).all()  # position 1 has none


def test_attention_mass_and_top_sources_by_hand() -> None:
    probs = np.zeros((1, 2, 20, 20), np.float32)
    probs[0, 0, 19, [0, 19, 18, 15, 10, 1]] = [0.1, 0.2, 0.3, 0.15, 0.05, 0.2]  # first, self, 1, 4, 9, 18 back
    probs[0, 1, 19, [0, 17]] = [0.5, 0.5]
    mass, top, weight = attention_mass(probs)
    np.testing.assert_allclose(mass[0, 19, 0], [0.1, 0.2, 0.3, 0.15, 0.05, 0.2], atol=1e-7)
    np.testing.assert_allclose(mass[0, 19, 1], [0.5, 0, 0, 0.5, 0, 0], atol=1e-7)
    assert top[0, 19].tolist() == [17, 18, 1] and np.allclose(weight[0, 19], [0.25, 0.15, 0.1])


def test_the_oracle_agrees_with_the_capture(tiny_models: dict) -> None:
    """bench/context_oracle: y_ctl from two-token windows, each head restored by splicing its output into
    o_proj's input, the distance windows as shorter windows, the mass from output_attentions."""
    from bench.context_oracle import compare

    lm = tiny_models["tiny-llama"]
    found = compare(lm, ids(2, 20, seed=4), 1)
    for name in ("y_ctl_max_diff_rel", "head_dot_max_diff_rel", "dist_dot_max_diff_rel", "mass_max_diff"):
        assert found[name] < 1e-5, (name, found[name])


def test_the_context_heads_check_fails_on_moved_rows_and_broken_masses(tiny_models: dict) -> None:
    """controls_valid's sources part: the stored table passes; two heads' rows swapped, a share from
    another layer, a head's attention mass no longer adding up to 1, or rows where nothing was captured
    fail."""
    from updatelens.assets.checks import check_context_heads
    from updatelens.config import AnalysisConfig
    from updatelens.steps.context_split import context_heads_table
    from updatelens.steps.layer import LayerData
    from updatelens.tables import Provenance

    lm = tiny_models["tiny-llama"]
    x = ids(4, 16)
    cap = capture(lm, x, np.ones_like(x), 4, self_first=[0, 1], sources=True)
    kept = np.ones(x.shape, bool)
    kept[:, 0] = False
    cfg = AnalysisConfig(n_seq=4, seq_len=16, k=4, bootstrap=30)
    prov = Provenance.of("m", "r", "c", "s", cfg, 2, "w")

    def layer_data(layer: int) -> LayerData:
        return LayerData(layer=layer, input_ids=x, kept=kept, x_full=cap.states[layer], y_full=cap.states[layer + 1],
                         docs=np.arange(4), sources=cap.sources[layer])

    data = layer_data(1)
    table = context_heads_table(data, cap.self_first[1], cfg, prov)
    assert table["kind"].to_pylist() == ["head"] * 4 + ["together"] + ["distance"] * 4
    assert (table["share_lo"].to_numpy()[:4] <= table["share_hi"].to_numpy()[:4]).all()
    assert check_context_heads(table, data, cap.self_first[1]).passed
    share = table["share"].to_numpy().copy()
    share[[0, 1]] = share[[1, 0]]
    swapped = table.set_column(table.schema.get_field_index("share"), "share", pa.array(share))
    assert not check_context_heads(swapped, data, cap.self_first[1]).passed
    other = context_heads_table(layer_data(0), cap.self_first[0], cfg, prov)
    assert not check_context_heads(other, data, cap.self_first[1]).passed
    mass = table["mass"].to_numpy(zero_copy_only=False).copy()
    mass[2] += 0.05
    broken = table.set_column(table.schema.get_field_index("mass"), "mass", pa.array(mass))
    failures = check_context_heads(broken, data, cap.self_first[1]).failures
    assert any("attention mass" in f for f in failures), failures
    assert not check_context_heads(table, LayerData(layer=1, input_ids=x, kept=kept, x_full=cap.states[1],
                                                    y_full=cap.states[2]), None).passed
