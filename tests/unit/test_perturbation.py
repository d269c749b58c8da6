"""Patched forwards: identity gives KL 0, a real patch KL > 0, and the resume-at-block fast path
equals a plain full forward with a hook that replaces block l's output."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from updatelens.bootstrap import paired_ratio, sequence_counts
from updatelens.capture import block_output_is_tuple, capture, first_tensor, kept_mask
from updatelens.config import AnalysisConfig
from updatelens.corpus import Sample
from updatelens.fits import LayerFit
from updatelens.perturbation import (
    LinearHead,
    Variant,
    kl_rows,
    later_position_kl,
    original_output,
    patched_kl,
    single_position_kl,
    spearman,
)
from updatelens.steps.activations import provenance
from updatelens.steps.functional_metrics import (
    build_variants,
    functional_bootstrap_table,
    functional_rows,
    functional_tables,
    functional_tables_from_rows,
    later_positions,
    patched_pass_count,
)
from updatelens.steps.layer import LayerData
from updatelens.tables import Provenance

SLUGS = ["tiny-gpt2", "tiny-llama", "tiny-neox", "tiny-mamba"]


def setup(lm, n=3, t=10, seed=0):
    x = np.random.default_rng(seed).integers(5, 500, size=(n, t))
    cap = capture(lm, x, np.ones_like(x))
    return x, cap


def reference_logp(lm, ids: np.ndarray, layer: int, state: np.ndarray) -> torch.Tensor:
    """The slow, obvious way: full forward, a hook replaces block l's output (prepend=True)."""

    def hook(module, args, output):
        patched = torch.as_tensor(state, dtype=first_tensor(output).dtype)
        return patched if isinstance(output, torch.Tensor) else (patched, *output[1:])

    handle = lm.blocks[layer].register_forward_hook(hook, prepend=True)
    try:
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.as_tensor(ids)).logits
    finally:
        handle.remove()
    return torch.log_softmax(logits.float(), -1)


def plain_logp(lm, ids: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(lm.model(input_ids=torch.as_tensor(ids)).logits.float(), -1)


@pytest.mark.parametrize("slug", SLUGS)
@pytest.mark.parametrize("fast_head", [True, False])
def test_resume_fast_path_equals_hooked_full_forward(tiny_models: dict, slug: str, fast_head: bool) -> None:
    """Resume-at-block + (fast head: chunked logsumexp and O(d) expectations) against a full
    forward with a hook and the plain KL over full log-probabilities."""
    lm = tiny_models[slug]
    ids, cap = setup(lm)
    orig = original_output(lm, ids, 2, fast_head=fast_head)
    assert (orig.head is not None) == fast_head and (orig.mean_row is not None) == fast_head
    layer = 1
    rng = np.random.default_rng(0)
    state = cap.states[layer + 1] + 0.5 * rng.standard_normal(cap.states[layer + 1].shape)
    fast = patched_kl(lm, ids, layer, [Variant("patch", "x", state)], orig, batch=2,
                      returns_tuple=block_output_is_tuple(lm))[0]
    ref = kl_rows(plain_logp(lm, ids), reference_logp(lm, ids, layer, state)).double().numpy()
    np.testing.assert_allclose(fast, ref, rtol=1e-4, atol=1e-6)
    assert fast[:, 1:].mean() > 0


def test_linear_head_shifted_logsumexp_in_chunks_equals_the_full_logits() -> None:
    rng = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 16, generator=rng)
    delta_h = 3 * torch.randn(10, 16, generator=rng)
    logp = torch.log_softmax(torch.randn(10, 1000, generator=rng), -1)
    head = LinearHead(weight, chunk=128)  # 1000 = 7 full chunks and a partial one
    expected = torch.logsumexp((logp + delta_h @ weight.T).double(), -1)
    torch.testing.assert_close(head.shifted_logsumexp(delta_h, logp), expected, rtol=1e-6, atol=1e-6)


def test_scaled_logits_fall_back_to_the_plain_definition(tiny_models: dict) -> None:
    """A model that post-processes the head's output (here: scaled logits) must not take the fast
    path, whose algebra assumes logits = h W^T + b."""
    lm = tiny_models["tiny-llama"]
    ids, cap = setup(lm)
    handle = lm.model.register_forward_hook(lambda m, a, out: out.__class__(logits=out.logits * 2.0))
    try:
        orig = original_output(lm, ids, 3)
        assert orig.head is None and orig.mean_row is None
        state = cap.states[2] + 0.3
        got = patched_kl(lm, ids, 1, [Variant("patch", "x", state)], orig, batch=3)[0]
        ref = kl_rows(plain_logp(lm, ids), reference_logp(lm, ids, 1, state)).double().numpy()
    finally:
        handle.remove()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fast_head", [True, False])
def test_single_position_kl_equals_the_hooked_reference(tiny_models: dict, fast_head: bool) -> None:
    lm = tiny_models["tiny-gpt2"]
    ids, cap = setup(lm)
    layer, y = 1, cap.states[2]
    orig = original_output(lm, ids, 2, fast_head=fast_head)
    patched = y + 0.5 * np.random.default_rng(1).standard_normal(y.shape)
    positions = np.array([[0, 3], [1, 0], [2, 9]])
    got = single_position_kl(lm, ids, layer, [Variant("patch", "x", patched)], y, positions, orig, batch=2)[0]
    base = plain_logp(lm, ids)
    for s, p in positions:
        state = y.copy()
        state[s, p] = patched[s, p]
        ref = kl_rows(base[s, p], reference_logp(lm, ids, layer, state)[s, p]).item()
        assert got[s, p] == pytest.approx(ref, rel=1e-4, abs=1e-6)
    assert np.isnan(got).sum() == got.size - len(positions)


@pytest.mark.parametrize("fast_head", [True, False])
def test_later_position_effects_equal_the_hooked_reference(tiny_models: dict, fast_head: bool) -> None:
    """One position's r removed: the KL at it is its single-position effect, and the mean KL per position
    over the positions after it (every one, or a horizon of them) is what a hooked full forward with only
    that position patched gives there."""
    lm = tiny_models["tiny-llama"]
    ids, cap = setup(lm)
    layer, y = 1, cap.states[2]
    orig = original_output(lm, ids, 2, fast_head=fast_head)
    patched = y + 0.5 * np.random.default_rng(2).standard_normal(y.shape)
    positions = np.array([[0, 3], [0, 7], [2, 1], [1, 8]])  # two in one sequence, in one batch
    at, later = later_position_kl(lm, ids, layer, patched, y, positions, orig, batch=3)
    _, near = later_position_kl(lm, ids, layer, patched, y, positions, orig, batch=3, horizon=2)
    single = single_position_kl(lm, ids, layer, [Variant("patch", "x", patched)], y, positions, orig, batch=2)[0]
    base = plain_logp(lm, ids)
    for i, (s, p) in enumerate(positions):
        state = y.copy()
        state[s, p] = patched[s, p]
        ref = kl_rows(base[s], reference_logp(lm, ids, layer, state)[s]).clamp_min(0).numpy()
        assert at[i] == pytest.approx(single[s, p], rel=1e-4, abs=1e-6)
        assert later[i] == pytest.approx(float(ref[p + 1 :].mean()), rel=1e-4, abs=1e-6)
        assert near[i] == pytest.approx(float(ref[p + 1 : p + 3].mean()), rel=1e-4, abs=1e-6)
        assert ref[:p].max() < 1e-5  # causal: the positions before it do not move
    assert later.min() > 0


def test_later_positions_are_drawn_per_sequence_whatever_the_block() -> None:
    measured = np.ones((6, 10), bool)
    measured[:, 0] = False
    whole = later_positions(measured, 2, seed=0)
    blocks = np.concatenate([later_positions(measured[lo : lo + 2], 2, 0, seq_offset=lo) + [lo, 0]
                             for lo in (0, 2, 4)])
    np.testing.assert_array_equal(whole, blocks)
    assert len(whole) == 12 and whole[:, 1].min() >= 1 and whole[:, 1].max() <= 8  # a later position exists
    # a horizon of 4: only positions with 4 after them (1 .. 5 of 10) are drawn; 3 of them asked, 3 given
    within = later_positions(measured, 3, seed=0, horizon=4)
    assert len(within) == 18 and within[:, 1].max() <= 5
    assert len(later_positions(measured, 1, seed=0, horizon=10)) == 0  # no position has 10 after it


@pytest.mark.parametrize("slug", SLUGS)
def test_identity_patch_gives_zero_kl_at_every_layer(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    ids, cap = setup(lm)
    orig = original_output(lm, ids, 3)
    for layer in range(lm.n_layers):
        kl = patched_kl(lm, ids, layer, [Variant("identity", "x", cap.states[layer + 1])], orig, batch=3)[0]
        assert np.max(kl) < 1e-6, f"{slug} layer {layer}: identity KL {np.max(kl)}"


def test_blocks_are_restored_after_a_failed_patch(tiny_models: dict) -> None:
    lm = tiny_models["tiny-llama"]
    ids, cap = setup(lm)
    orig = original_output(lm, ids, 3)
    wrong = np.zeros((3, 10, lm.d_model + 1))
    with pytest.raises(ValueError, match="shape"):
        patched_kl(lm, ids, 1, [Variant("patch", "x", wrong)], orig, batch=3)
    assert all("forward" not in b.__dict__ for b in lm.blocks)
    assert "forward" not in lm.model.get_output_embeddings().__dict__
    again = original_output(lm, ids, 3)
    torch.testing.assert_close(again.logp, orig.logp)
    torch.testing.assert_close(again.mean_row, orig.mean_row)


def fake_fits(cap, layer, kept, shift: float) -> dict[str, LayerFit]:
    y = cap.states[layer + 1][kept].astype(np.float64)
    x = cap.states[layer][kept].astype(np.float64)
    fits = {}
    for i, c in enumerate(["diagonal", "lowrank"]):
        tx = x + (y - x) * (1 - shift * (i + 1))  # lowrank is the worse fit here
        fits[c] = LayerFit(c, tx, np.ones(len(x)), np.zeros(len(x), bool))
    return fits


def test_functional_tables_cover_kept_tokens_and_controls(tiny_models: dict) -> None:
    lm = tiny_models["tiny-gpt2"]
    ids, cap = setup(lm, n=4, t=10)
    cfg = AnalysisConfig(n_seq=4, seq_len=10, k=5, controls=("random", "crude", "identity"), patch_mode="all",
                         later_horizon=3)
    kept = kept_mask(np.ones_like(ids), True)
    layer = 1
    data = LayerData(layer, ids, kept, cap.states[layer], cap.states[layer + 1])
    fits = fake_fits(cap, layer, kept, 0.3)
    sample = Sample("c", ids, np.ones_like(ids), np.zeros(4, int), "c[w0:4,len10]")
    prov = provenance(lm, sample, cfg)
    orig = original_output(lm, ids, 4)
    fm, fs = functional_tables(lm, data, fits, orig, cfg, prov)
    variants = fs["variant"].to_pylist()
    assert variants == ["patch", "patch", "random", "crude", "identity"]
    assert patched_pass_count(cfg) == len(build_variants(data, fits, cfg)) == 5
    # the crude control of a crude class that is the primary one would repeat the patch: not run
    same = AnalysisConfig(n_seq=4, seq_len=10, k=5, classes=("diagonal",), controls=("random", "crude"),
                          patch_mode="all")
    assert patched_pass_count(same) == len(build_variants(data, {"diagonal": fits["diagonal"]}, same)) == 2
    assert patched_pass_count(cfg.replace(patch_mode="exact")) == 6  # the unpatched stream beside them
    # KL is measured on kept tokens only: every sequence, positions 1..9
    assert len(fm) == 5 * 4 * 9 and min(fm["pos"].to_pylist()) == 1
    by = {(r["variant"], r["fn_class"]): r for r in fs.to_pylist()}
    assert by[("identity", "lowrank")]["kl_max"] < 1e-6
    assert by[("patch", "lowrank")]["kl_mean"] > 0
    assert all(r["n_tokens"] == 36 for r in by.values())
    # the random control moves y exactly as far as the patch does
    v = {x.name: x for x in build_variants(data, fits, cfg)}
    dist_patch = np.linalg.norm(fits["lowrank"].tx - data.y, axis=1)
    dist_random = np.linalg.norm(v["random"].state[kept] - data.y, axis=1)
    np.testing.assert_allclose(dist_random, dist_patch, rtol=1e-9)
    # finding 4 direction: the median paired ratio KL(remove r) / KL(random of the same norm), token by token,
    # on the random control's class only, and on each resample the median of the resample's tokens
    rows = {name: fm.filter(pc.and_(pc.equal(fm["variant"], name), pc.equal(fm["fn_class"], "lowrank")))
            for name in ("patch", "random")}
    ratio = rows["patch"]["kl"].to_numpy() / rows["random"]["kl"].to_numpy()
    assert by[("patch", "lowrank")]["kl_ratio_random"] == pytest.approx(float(np.median(ratio)), rel=1e-12)
    assert by[("patch", "diagonal")]["kl_ratio_random"] is None and by[("random", "lowrank")]["kl_ratio_random"] is None
    # the later effect: later_positions (1) tokens per sequence of the main patch of the primary class, null elsewhere
    assert by[("patch", "lowrank")]["n_later"] == 4 and by[("patch", "diagonal")]["n_later"] == 0
    later = rows["patch"]["kl_later"].to_numpy(zero_copy_only=False)
    assert np.isfinite(later).sum() == 4 and (later[np.isfinite(later)] >= 0).all()
    assert by[("patch", "lowrank")]["kl_later_mean"] == pytest.approx(float(np.nanmean(later)))
    assert -1 <= by[("patch", "lowrank")]["spearman_kl_later"] <= 1
    # ... with the random control's move at the same tokens, and the median paired ratio of the two
    later_random = rows["patch"]["kl_later_random"].to_numpy(zero_copy_only=False)
    np.testing.assert_array_equal(np.isfinite(later_random), np.isfinite(later))
    on = np.isfinite(later)
    assert by[("patch", "lowrank")]["kl_later_random_mean"] == pytest.approx(float(later_random[on].mean()))
    assert by[("patch", "lowrank")]["later_ratio_median"] == pytest.approx(float(np.median(later[on] / later_random[on])))
    assert by[("patch", "diagonal")]["later_ratio_median"] is None
    # after the last block no attention follows: the later positions cannot move, so none is measured
    last = LayerData(lm.n_layers - 1, ids, kept, cap.states[lm.n_layers - 1], cap.states[lm.n_layers])
    _, at_last = functional_tables(lm, last, fake_fits(cap, lm.n_layers - 1, kept, 0.3), orig, cfg, prov)
    assert set(at_last["n_later"].to_pylist()) == {0} and set(at_last["later_ratio_median"].to_pylist()) == {None}
    unit = functional_bootstrap_table(fm, cfg.replace(bootstrap=3), prov, layer, np.arange(4))
    counts = np.asarray(sequence_counts(np.arange(4), 3, cfg.seed))
    boot = unit.filter(pc.equal(unit["fn_class"], "lowrank"))["kl_ratio_random"].to_numpy()
    seq = rows["patch"]["seq"].to_numpy()
    own = unit.filter(pc.equal(unit["fn_class"], "lowrank"))
    for b in range(3):  # each resample is the median of the expanded sample
        assert boot[b] == pytest.approx(float(np.median(np.repeat(ratio, counts[b][seq].astype(int)))), rel=1e-12)
        times = counts[b][seq[on]].astype(int)
        assert own["kl_later_mean"][b].as_py() == pytest.approx(float(np.repeat(later[on], times).mean()), rel=1e-12)
        assert own["later_ratio_median"][b].as_py() == pytest.approx(
            float(np.median(np.repeat(later[on] / later_random[on], times))), rel=1e-12)


def test_single_position_mode_measures_only_the_patched_positions(tiny_models: dict) -> None:
    lm = tiny_models["tiny-llama"]
    ids, cap = setup(lm, n=3, t=10)
    cfg = AnalysisConfig(n_seq=3, seq_len=10, k=5, patch_mode="single", single_positions=2, controls=())
    kept = kept_mask(np.ones_like(ids), True)
    data = LayerData(0, ids, kept, cap.states[0], cap.states[1])
    sample = Sample("c", ids, np.ones_like(ids), np.zeros(3, int), "c[w0:3,len10]")
    fm, fs = functional_tables(lm, data, fake_fits(cap, 0, kept, 0.3), original_output(lm, ids, 3),
                               cfg, provenance(lm, sample, cfg))
    assert len(fm) == 2 * 3 * 2  # classes x sequences x positions
    assert set(fm["patch_mode"].to_pylist()) == {"single"}
    assert all(k >= 0 for k in fm["kl"].to_pylist())


def test_spearman_pairs_tokens_and_skips_non_finite() -> None:
    err = np.array([0.1, 0.2, 0.3, 0.4, np.nan, 0.5])
    kl = np.array([1.0, 2.0, 3.0, 4.0, 100.0, np.inf])
    res = spearman(err, kl)
    assert res.n == 4 and res.rho == pytest.approx(1.0)
    assert spearman(err[::-1].copy(), kl).n == 4
    anti = spearman(np.array([1.0, 2, 3, 4]), np.array([4.0, 3, 2, 1]))
    assert anti.rho == pytest.approx(-1.0)
    assert np.isnan(spearman(np.ones(5), np.arange(5.0)).rho)


@pytest.mark.parametrize("slug", SLUGS)
def test_original_output_resumed_from_a_captured_state_equals_the_full_forward(tiny_models: dict, slug: str) -> None:
    lm = tiny_models[slug]
    ids, cap = setup(lm)
    full = original_output(lm, ids, 2)
    for layer in (0, lm.n_layers - 1):
        resumed = original_output(lm, ids, 2, resume=(layer, cap.states[layer + 1]))
        torch.testing.assert_close(resumed.logp, full.logp, rtol=1e-5, atol=1e-5)
        if full.head_input is not None:
            torch.testing.assert_close(resumed.head_input, full.head_input, rtol=1e-5, atol=1e-5)
    # a wrong state is not silently the same: the resumed distributions move
    noise = 10 * np.random.default_rng(1).standard_normal(cap.states[1].shape).astype(np.float32)
    moved = original_output(lm, ids, 2, resume=(0, cap.states[1] + noise))
    assert not torch.allclose(moved.logp, full.logp, atol=1e-5)


@pytest.mark.parametrize("slug", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
def test_exact_single_position_effects_equal_patching_one_position_per_pass(tiny_models: dict, slug: str) -> None:
    """One pass of the unpatched and patched streams (updatelens.single_position) against a forward
    pass per patched position, at every position of every sequence, for two layers."""
    from updatelens.single_position import all_single_position_kl, resolve_patch_mode

    lm = tiny_models[slug]
    assert resolve_patch_mode(lm, "auto") == "exact"
    ids, cap = setup(lm, n=3, t=12)
    rng = np.random.default_rng(1)
    orig = original_output(lm, ids, 4)
    positions = np.array([(s, p) for s in range(3) for p in range(1, 12)])
    for layer in (0, lm.n_layers - 2):
        y = cap.states[layer + 1]
        variants = [Variant(name, "-", y + scale * rng.standard_normal(y.shape).astype(np.float32))
                    for name, scale in (("patch", 0.5), ("random", 2.0))]
        fast = all_single_position_kl(lm, ids, layer, variants, y, orig, batch=6)
        brute = single_position_kl(lm, ids, layer, variants, y, positions, orig, 8)
        for f, b in zip(fast, brute):
            measured = ~np.isnan(b)
            assert measured.sum() == 33 and np.all(b[measured] > 1e-6)
            np.testing.assert_allclose(f[measured], b[measured], rtol=1e-4)


def test_models_without_attention_fall_back_to_all_positions(tiny_models: dict) -> None:
    from updatelens.single_position import resolve_patch_mode

    assert resolve_patch_mode(tiny_models["tiny-mamba"], "auto") == "all"
    assert resolve_patch_mode(tiny_models["tiny-mamba"], "single") == "single"


def test_the_random_move_is_drawn_in_the_shape_of_the_residuals() -> None:
    """Finding 4 direction's random control: each state moves exactly as far as its residual, in a random
    direction that stays in the span the residuals use (here 2 of 6 dimensions), not in an isotropic one;
    the shape is the whole layer's (`move_shape`), so a block's moves match the whole sample's."""
    from updatelens.fits import LayerFit
    from updatelens.geometry import update_shape
    from updatelens.steps.functional_metrics import residual_gram

    rng = np.random.default_rng(0)
    n_seq, t, d = 6, 9, 6
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0]
    x = rng.normal(size=(n_seq, t, d))
    res = (rng.normal(size=(n_seq, t, 2)) * np.array([3.0, 0.5])) @ basis[:, :2].T
    y = x + 0.3 * x + res
    kept = np.ones((n_seq, t), bool)
    data = LayerData(1, np.zeros((n_seq, t), np.int64), kept, x.astype(np.float32), y.astype(np.float32))
    tx = (x + 0.3 * x)[kept]
    fit = LayerFit("lowrank", tx, np.ones(len(tx)), np.zeros(len(tx), bool))
    cfg = AnalysisConfig(n_seq=n_seq, seq_len=t, k=5, classes=("lowrank",), controls=("random",))
    (random,) = [v for v in build_variants(data, {"lowrank": fit}, cfg) if v.name == "random"]
    move = random.state[kept] - data.y
    np.testing.assert_allclose(np.linalg.norm(move, axis=1), np.linalg.norm(data.y - tx, axis=1), rtol=1e-6)
    outside = move @ basis[:, 2:]
    assert np.abs(outside).max() < 1e-3 * np.abs(move).max()  # no energy outside the residuals' span
    # a block of sequences with the whole layer's shape moves its tokens as the whole layer does
    shape = update_shape(residual_gram(data, fit), len(tx))
    block = LayerData(1, data.input_ids[2:4], kept[2:4], data.x_full[2:4], data.y_full[2:4], seq_offset=2)
    rows = slice(2 * t, 4 * t)
    block_fit = LayerFit("lowrank", tx[rows], np.ones(2 * t), np.zeros(2 * t, bool))
    (again,) = [v for v in build_variants(block, {"lowrank": block_fit}, cfg, shape) if v.name == "random"]
    np.testing.assert_allclose(again.state[kept[2:4]], random.state[kept][rows], rtol=1e-6, atol=1e-6)


def test_the_context_control_removes_the_exact_splits_context_part(tiny_models: dict) -> None:
    """controls=context: the state y -> y_ctl at kept positions (the part a that attention to the context
    adds, removed), its rows' error being a's (rel_err ||a|| / ||Δ_full||, norm_res ||a||); y_ctl = y gives
    KL 0; no y_ctl captured (Mamba): no context variant."""
    lm = tiny_models["tiny-gpt2"]
    ids, cap = setup(lm, n=4, t=10)
    cfg = AnalysisConfig(n_seq=4, seq_len=10, k=5, controls=("context",), patch_mode="all")
    kept = kept_mask(np.ones_like(ids), True)
    layer = 1
    y_full = cap.states[layer + 1]
    y_ctl = y_full + 0.1 * np.random.default_rng(0).normal(size=y_full.shape).astype(np.float32)
    data = LayerData(layer, ids, kept, cap.states[layer], y_full, y_ctl_full=y_ctl)
    fits = fake_fits(cap, layer, kept, 0.3)
    (context,) = [v for v in build_variants(data, fits, cfg) if v.name == "context"]
    np.testing.assert_allclose(context.state[kept], y_ctl[kept], rtol=1e-6)
    orig = original_output(lm, ids, 4)
    rows = {(str(r["variant"]), str(r["fn_class"])): r for r in functional_rows(lm, data, fits, orig, cfg)}
    row = rows[("context", cfg.primary_class)]
    a = np.linalg.norm(y_full[kept].astype(np.float64) - y_ctl[kept], axis=1)
    full = np.linalg.norm(y_full[kept].astype(np.float64) - cap.states[layer][kept], axis=1)
    np.testing.assert_allclose(row["norm_res"], a, rtol=1e-5)
    np.testing.assert_allclose(row["rel_err"], a / full, rtol=1e-5)
    assert np.all(np.asarray(row["kl"]) > 0)
    # its random move: as far as a, in a's span (a's shape), its KL the ratio's denominator
    (moved,) = [v for v in build_variants(data, fits, cfg) if v.name == "context_random"]
    move = moved.state[kept] - y_full[kept]
    np.testing.assert_allclose(np.linalg.norm(move, axis=1), a, rtol=1e-5)
    assert not np.allclose(move, y_ctl[kept] - y_full[kept], atol=1e-3)
    random_row = rows[("context_random", cfg.primary_class)]
    np.testing.assert_allclose(random_row["norm_res"], a, rtol=1e-5)
    summary = functional_tables_from_rows(list(rows.values()), cfg, Provenance.of("m", "r", "c", "s", cfg, 2, "w"),
                                          layer)[1].to_pylist()
    ratio = next(r["kl_ratio_random"] for r in summary if r["variant"] == "context")
    want = np.nanmedian(paired_ratio(np.asarray(row["kl"]), np.asarray(random_row["kl"])))
    assert ratio == pytest.approx(want, rel=1e-6)
    same = dataclasses.replace(data, y_ctl_full=y_full.copy())
    (none,) = [r for r in functional_rows(lm, same, fits, orig, cfg) if r["variant"] == "context"]
    assert np.max(np.asarray(none["kl"])) < 1e-6  # nothing removed: the model's own output
    without = dataclasses.replace(data, y_ctl_full=None)
    assert [v.name for v in build_variants(without, fits, cfg)] == ["patch", "patch"]


def test_position_runs_cover_the_sequence_in_equal_runs_of_a_multiple_of_8() -> None:
    """Uneven runs (42, 42, 42, 2 for SmolLM2) moved log-probabilities by 2e-5; equal runs of a multiple of 8
    give the whole-sequence product's bits."""
    from updatelens.perturbation import TEMP_BYTES, _position_runs

    for positions, vocab in ((128, 49_152), (128, 262_144), (512, 49_152), (100, 49_152), (16, 50_257)):
        runs = _position_runs(positions, vocab)
        assert runs[0][0] == 0 and runs[-1][1] == positions
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        sizes = [b - a for a, b in runs]
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
        if len(runs) > 1:
            assert sizes[0] % 8 == 0 and sizes[0] * vocab * 8 <= TEMP_BYTES + 7 * vocab * 8
    assert _position_runs(128, 49_152) == [(0, 32), (32, 64), (64, 96), (96, 128)]
