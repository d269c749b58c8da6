"""Positive controls: the self-and-first block is tokenwise by construction, the linear control never sees
the token's document, and the verdicts read both controls (a planted layer whose target is the
control itself is never `fails`; a residual beyond its null on the wrong side is `opposite`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.unit.test_findings import CLASSES, LAYERS, by_layer, fixture, replicate_fixture
from updatelens.capture import capture_batches, record_block_calls, record_block_states, self_first_outputs
from updatelens.errors import ModelError
from updatelens.findings import BY_ID
from updatelens.linear_control import HeldOutMaps, linear_outputs
from updatelens.models import LoadedModel, locate_blocks
from updatelens.storage import catalog
from updatelens.storage.layout import write_partition

ATTENTION = ["tiny-gpt2", "tiny-llama", "tiny-neox"]


FIRST = 1  # the token every window starts with (models.window_first_token)


def ids(n: int = 3, t: int = 10, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).integers(5, 500, size=(n, t))
    x[:, 0] = FIRST
    return x


def self_first(lm: LoadedModel, x: np.ndarray, layers: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    (batch,) = capture_batches(lm, x, np.ones_like(x), batch_size=len(x), self_first=layers)
    return batch.states, batch.self_first


def calls_and_states(lm: LoadedModel, x: np.ndarray, layers: list[int]) -> tuple[np.ndarray, dict]:
    """The states of one forward pass and the arguments the model gave each of `layers`' blocks."""
    sink: list[list[torch.Tensor]] = [[] for _ in range(lm.n_layers + 1)]
    calls: dict = {}
    with torch.inference_mode(), record_block_states(lm.blocks, sink), record_block_calls(lm.blocks, layers, calls):
        lm.model(input_ids=torch.as_tensor(x), use_cache=False)
    return np.stack([chunks[0].numpy() for chunks in sink]), calls


def shuffle_within_positions(states: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's states (after the first) drawn from another window, position by position:
    every token keeps its position and the first position's state, beside other tokens."""
    rng = np.random.default_rng(seed)
    n, t = states.shape[:2]
    source = np.stack([np.arange(n)] + [rng.permutation(n) for _ in range(t - 1)], axis=1)  # [n, t]
    return states[source, np.arange(t)[None, :]], source


def assert_tokenwise(lm: LoadedModel, x: np.ndarray, layers: list[int]) -> None:
    states, alone = self_first(lm, x, layers)
    _, calls = calls_and_states(lm, x, layers)
    for layer in range(states.shape[0]):  # the first position sees only itself: the same state in every window
        np.testing.assert_allclose(states[layer][:, 0], np.broadcast_to(states[layer][:1, 0], states[layer][:, 0].shape),
                                   rtol=1e-5, atol=1e-5)
    shuffled = states.copy()
    sources = {}
    for layer in layers:
        out = alone[layer]
        assert out.shape == states[layer + 1].shape and np.isfinite(out).all()
        assert not np.allclose(out, states[layer + 1], atol=1e-4)  # the real block mixes tokens
        shuffled[layer], sources[layer] = shuffle_within_positions(states[layer], layer)
    again, _ = self_first_outputs(lm, shuffled, calls)
    t = x.shape[1]
    for layer in layers:
        np.testing.assert_allclose(again[layer], alone[layer][sources[layer], np.arange(t)[None, :]],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("slug", ATTENTION)
def test_the_self_first_block_maps_each_token_by_itself(tiny_models: dict, slug: str) -> None:
    """A token's self-and-first output depends on its own input (at its position) and the first
    position's state, which is the same in every window: the same token state gives the same output
    beside other tokens; and it is not the real block output (attention between tokens matters there)."""
    assert_tokenwise(tiny_models[slug], ids(4), [0, 1])


def test_the_self_first_llama_block_is_the_block_on_the_first_token_and_the_token_alone(tiny_models: dict) -> None:
    """Independently of the 4D mask: the output at position t is the real block, with its own causal
    attention, run on the two-token window (first position, token t) at positions 0 and t."""
    lm = tiny_models["tiny-llama"]
    x = ids(2, 8)
    states, alone = self_first(lm, x, [1])
    _, calls = calls_and_states(lm, x, [1])
    _, kwargs = calls[1]
    cos, sin = kwargs["position_embeddings"]
    with torch.inference_mode():
        h = torch.as_tensor(states[1])
        for t in range(1, x.shape[1]):
            pair = [0, t]
            out = lm.blocks[1](h[:, pair], position_embeddings=(cos[:, pair], sin[:, pair]), attention_mask=None)
            np.testing.assert_allclose(alone[1][:, t], out[:, 1].numpy(), rtol=1e-4, atol=1e-5)


def test_gemma3_sliding_and_full_attention_blocks_make_a_self_first_control() -> None:
    """Gemma 3 (the second embedded model's architecture, built tiny from its config): sliding-window
    and global layers both take the self-and-first mask."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    name, blocks, adapter = locate_blocks(model)
    lm = LoadedModel("tiny-gemma3", model, AutoTokenizer, blocks, name, 2, 32, 64, "r", True,
                     self_attention=adapter.self_attention)
    assert_tokenwise(lm, ids(3, 9), [0, 1])  # the capture checks each block's mask took effect


def test_a_model_that_ignores_the_mask_is_refused(tiny_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture checks the mask took effect: a block that still mixes tokens under it is refused."""
    import updatelens.capture as capture_module

    monkeypatch.setattr(capture_module, "self_first_mask",
                        lambda given, b, t, *_: torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, 1, t, t))
    with pytest.raises(ModelError, match="ignores a 4D attention mask"):
        self_first(tiny_models["tiny-llama"], ids(), [1])


def test_an_architecture_without_attention_has_no_self_first_control(tiny_models: dict) -> None:
    with pytest.raises(ModelError, match="self-and-first"):
        self_first(tiny_models["tiny-mamba"], ids(), [0])


def test_the_linear_control_is_one_map_fitted_outside_the_sample() -> None:
    rng = np.random.default_rng(0)
    d = 6
    b = rng.normal(size=(d, d)) * 0.3
    maps = HeldOutMaps([0, 1], d)
    for _ in range(3):  # held-out tokens, batch by batch: layer 0 exactly linear, layer 1 with noise
        x = rng.normal(size=(100, d)).astype(np.float32)
        maps.rows += len(x)
        maps.add(0, x, x + x @ b)
        maps.add(1, x, x + x @ b + rng.normal(size=x.shape))
    fitted = maps.maps(ridge=1e-9)
    np.testing.assert_allclose(fitted[0], b, atol=1e-5)  # an exactly linear update is recovered
    assert not np.allclose(fitted[1], b, atol=1e-3)
    # the sample's tokens get x + xB: one function of x, which never saw the sample's own y
    x_in = rng.normal(size=(50, d)).astype(np.float32)
    np.testing.assert_allclose(linear_outputs(x_in, fitted[0]), x_in + x_in @ b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="held-out tokens"):
        HeldOutMaps([0], d).maps(0.1)


def test_the_held_out_windows_come_after_the_sample_from_other_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    from updatelens import corpus
    from updatelens.analysis import held_out_sample, model_sample
    from updatelens.config import AnalysisConfig
    from updatelens.errors import CorpusError
    from updatelens.registry import CorpusEntry

    class Words:
        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [hash(w) % 1000 for w in text.split()]}

    class Lm:  # what the samples read of a loaded model
        tokenizer, adapter = Words(), None

    docs = [" ".join(f"d{d}w{i}" for i in range(45)) for d in range(12)]  # 4 windows of 10 words each
    monkeypatch.setattr(corpus, "read_documents", lambda entry: (d for d in docs))
    monkeypatch.setattr("updatelens.analysis.window_first_token", lambda adapter, tokenizer: None)
    entry = CorpusEntry("c", "embedded")
    one = AnalysisConfig(n_seq=5, seq_len=10, windows_per_doc=1)
    sample = model_sample(Lm(), entry, one)  # type: ignore[arg-type]
    held = held_out_sample(Lm(), entry, one, sample)  # type: ignore[arg-type]
    assert sample.doc_index.tolist() == [0, 1, 2, 3, 4] and held.doc_index.tolist() == [5, 6, 7, 8, 9]
    every = AnalysisConfig(n_seq=6, seq_len=10, windows_per_doc=0)  # documents 0 and 1, then 1 (two windows) and 2
    sample = model_sample(Lm(), entry, every)  # type: ignore[arg-type]
    held = held_out_sample(Lm(), entry, every, sample)  # type: ignore[arg-type]
    assert held.doc_index.tolist() == [2, 2, 2, 2] and held.slice_desc.endswith("less 2 windows of the sample's documents")
    whole = AnalysisConfig(n_seq=2, seq_len=10, windows_per_doc=0)  # the next two windows are document 0's too
    with pytest.raises(CorpusError, match="all come from the sample's documents"):
        held_out_sample(Lm(), entry, whole, model_sample(Lm(), entry, whole))  # type: ignore[arg-type]


def write_control(root: Path, control: str, shift: dict[str, float] | None = None) -> None:
    """A positive control whose tables are the real layer's (the target is the control itself), with
    `shift` added to the named bootstrap statistics."""
    write_controls(root, {control: shift})


def write_controls(root: Path, controls: dict[str, dict[str, float] | None]) -> None:
    """Controls (name -> shift) whose tables are the real layer's, each with its shift added to the
    named statistics, stored together as the controls stage stores them."""
    stored = {table: by_layer(root, f"SELECT * FROM {table}") for table in ("geometry", "spectra", "geometry_bootstrap")}
    for table, layers in stored.items():
        for layer in range(LAYERS):
            real = layers[layer]
            parts = []
            for control, shift in controls.items():
                part = real
                for name, delta in (shift or {}).items():
                    if name in part.column_names:
                        column = part[name].to_numpy() + delta
                        part = part.set_column(part.schema.get_field_index(name), name, pa.array(column, from_pandas=True))
                parts.append(part.add_column(1, "control", pa.array([control] * len(part))))
            write_partition(root, f"control_{table}", "m", layer, pa.concat_tables(parts))


def test_a_layer_whose_target_is_the_tokenwise_control_is_never_fails(tmp_path: Path) -> None:
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    write_control(tmp_path, "self_first")
    rows = catalog.query(tmp_path, "SELECT * FROM findings_by_class").to_dicts()
    # six layers leave no middle layer outside the two first and two last: '6 inner' has no value
    empty = [r for r in rows if r["value"] is None]
    assert {r["finding"] for r in empty} == {"6 inner"} and {r["verdict"] for r in empty} == {None}
    rows = [r for r in rows if r["value"] is not None]
    assert {r["control"] for r in rows if BY_ID[r["finding"]].control_role in ("positive", "floor")} == {"self_first"}
    for row in rows:
        role = BY_ID[row["finding"]].control_role
        if role in ("positive", "floor"):
            assert row["control_outcome"] == "same"  # the real value is the control's
            assert row["self_first_diff_ci_lo"] == 0 and row["self_first_diff_ci_hi"] == 0
            assert row["verdict"] in ("estimator-limited", "holds"), row
            if row["verdict"] == "holds":  # only where the value (and so the control) clears its threshold
                assert row["threshold_outcome"] == "clears" and row["control_threshold_outcome"] == "clears"
        else:
            assert row["control_outcome"] is None and row["verdict"] != "estimator-limited"
    assert "estimator-limited" in {r["verdict"] for r in rows}


def test_a_control_that_shows_the_structure_lets_a_real_failure_fail(tmp_path: Path) -> None:
    """Finding 1 when a tokenwise target reaches cos 1 on every resample and the real layer misses 0.9:
    the estimator could see the structure, so the real value fails."""
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    write_control(tmp_path, "self_first", {"cos_full_tok_median": 5.0, "cos_full_tok": 5.0})
    stored = by_layer(tmp_path, "SELECT * FROM geometry_bootstrap")
    for layer in range(LAYERS):  # the real layer: well below 0.9 on every resample
        table = stored[layer]
        low = np.full(len(table), 0.5)
        table = table.set_column(table.schema.get_field_index("cos_full_tok_median"), "cos_full_tok_median",
                                 pa.array(low))
        write_partition(tmp_path, "geometry_bootstrap", "m", layer, table)
    row = catalog.query(tmp_path, "SELECT * FROM findings_by_class WHERE finding = '1' AND fn_class = 'lowrank'").to_dicts()[0]
    assert row["control_threshold_outcome"] == "clears" and row["control_outcome"] == "below control"
    assert row["threshold_outcome"] == "misses" and row["verdict"] == "fails"


def test_a_residual_beyond_its_null_on_the_wrong_side_is_opposite(tmp_path: Path) -> None:
    """Finding 2 projection claims r projects little on the tokenwise subspace (<= 0.25, below its
    null): a residual that projects far more than a random direction contradicts it, although it is
    under the threshold."""
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    stored = by_layer(tmp_path, "SELECT * FROM geometry_bootstrap")
    for layer in range(LAYERS):
        table = stored[layer]
        rng = np.random.default_rng(layer)
        for name, centre in (("proj_res_m16", 0.14), ("proj_res_m16_null", 0.028)):
            table = table.set_column(table.schema.get_field_index(name), name,
                                     pa.array(centre + rng.normal(0, 0.003, len(table))))
        write_partition(tmp_path, "geometry_bootstrap", "m", layer, table)
    rows = catalog.query(tmp_path, "SELECT * FROM findings_by_class WHERE finding = '2 projection'").to_dicts()
    assert len(rows) == len(CLASSES)
    for row in rows:
        assert row["threshold_outcome"] == "clears" and row["null_outcome"] == "opposite"
        assert row["verdict"] == "opposite"


def _split_of(lm: LoadedModel, x: np.ndarray, layer: int) -> dict[str, np.ndarray]:
    from updatelens.steps.context_split import split_metrics

    states, alone = self_first(lm, x, [layer])
    kept = np.ones(x.shape, bool)
    kept[:, 0] = False
    return {"y": states[layer + 1][kept], "y_ctl": alone[layer][kept],
            **split_metrics(states[layer][kept], states[layer + 1][kept], alone[layer][kept])}


@pytest.mark.parametrize("slug", ATTENTION)
def test_the_exact_split_adds_up_and_is_zero_where_the_block_sees_only_the_token_and_the_first_position(
        tiny_models: dict, slug: str) -> None:
    """y = y_ctl + a exactly (the norms and cosines reproduce ||Δ_full||); in windows of two tokens the
    real causal block attends to the first position and the token alone, so the context adds nothing
    (a = 0); in longer windows it does."""
    lm = tiny_models[slug]
    split = _split_of(lm, ids(3, 10), 1)
    rebuilt = np.sqrt(split["norm_ctl"] ** 2 + split["norm_ctx"] ** 2
                      + 2 * split["norm_ctl"] * split["norm_ctx"] * split["cos_ctx_ctl"])
    np.testing.assert_allclose(rebuilt, split["norm_full"], rtol=1e-6)
    assert np.median(split["ctx_ratio"]) > 0.05  # attention to the context matters in the real block
    pair = _split_of(lm, ids(3, 2), 1)
    np.testing.assert_allclose(pair["y_ctl"], pair["y"], rtol=1e-4, atol=1e-5)
    assert np.max(pair["ctx_ratio"]) < 1e-3 and np.min(pair["cos_full_ctl"]) > 0.999999


def test_the_split_check_fails_on_rows_paired_with_other_tokens(tiny_models: dict) -> None:
    """controls_valid's exact-split part: the stored split passes; rows shifted by one token (each
    paired with another token's update), or a split that no longer adds up, fail."""
    from updatelens.assets.checks import check_context_split
    from updatelens.config import AnalysisConfig
    from updatelens.steps.context_split import context_split_tables
    from updatelens.steps.layer import LayerData
    from updatelens.tables import Provenance

    lm = tiny_models["tiny-llama"]
    x = ids(4, 10)
    states, alone = self_first(lm, x, [1])
    kept = np.ones(x.shape, bool)
    kept[:, 0] = False
    data = LayerData(layer=1, input_ids=x, kept=kept, x_full=states[1], y_full=states[2], docs=np.arange(4))
    cfg = AnalysisConfig(n_seq=4, seq_len=10, k=4, bootstrap=20)
    split, resamples = context_split_tables(data, alone[1], cfg, Provenance.of("m", "r", "c", "s", cfg, 2, "w"))
    assert len(resamples) == 20 and check_context_split(split, data, True).passed
    shifted = split.set_column(split.schema.get_field_index("norm_full"), "norm_full",
                               pa.array(np.roll(split["norm_full"].to_numpy(), 1)))
    assert not check_context_split(shifted, data, True).passed
    broken = split.set_column(split.schema.get_field_index("norm_ctx"), "norm_ctx",
                              pa.array(split["norm_ctx"].to_numpy() * 1.5))
    failures = check_context_split(broken, data, True).failures
    assert any("does not add up" in f for f in failures), failures
    assert not check_context_split(split, data, False).passed  # rows where no split was captured


def test_the_unrelated_target_pairs_every_token_with_another_documents_update() -> None:
    from updatelens.steps.controls import unrelated_partners, unrelated_target

    doc = np.repeat([3, 0, 7, 1], [5, 9, 4, 8])  # uneven documents, not sorted
    partners = unrelated_partners(doc, seed=0)
    assert sorted(partners) == list(range(len(doc)))  # a bijection: every update used once
    assert not np.any(doc[partners] == doc)  # never the token's own document
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(len(doc), 4)), rng.normal(size=(len(doc), 4))
    np.testing.assert_allclose(unrelated_target(x, y, doc, 0) - x, (y - x)[partners], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="more than half of the kept tokens"):
        unrelated_partners(np.repeat([0, 1], [10, 9]), seed=0)


def _fitted_medians(tokenwise: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Median cos(Δ_full, Δ_tok) on every bootstrap resample of a planted anisotropic layer (d = 8,
    16 documents): the lowrank fits on the real target, and on the controls stage's unrelated null target.
    `tokenwise`: the update is a smooth function of x (the claim true by construction); otherwise each
    update is drawn as the same function of another, unseen state (the same distribution, no relation to x)."""
    from updatelens.config import AnalysisConfig
    from updatelens.steps.controls import control_layer_tables
    from updatelens.steps.geometry import geometry_tables
    from updatelens.steps.layer import LayerData
    from updatelens.steps.local_fits import compute_fits
    from updatelens.tables import Provenance

    rng = np.random.default_rng(seed)
    n_seq, seq_len, d = 16, 33, 8
    mix = rng.normal(size=(d, d)) * np.linspace(2.0, 0.2, d)[:, None]  # an anisotropic stream

    def update(states: np.ndarray) -> np.ndarray:
        return np.tanh(states @ w) @ v + offset

    w, v, offset = rng.normal(size=(d, d)) * 0.5, rng.normal(size=(d, d)), rng.normal(size=d)
    x = rng.normal(size=(n_seq, seq_len, d)) @ mix
    source = x if tokenwise else rng.normal(size=(n_seq, seq_len, d)) @ mix
    y = x + update(source) + 0.05 * rng.normal(size=x.shape)
    kept = np.ones((n_seq, seq_len), bool)
    kept[:, 0] = False
    data = LayerData(layer=1, input_ids=np.zeros((n_seq, seq_len), np.int64), kept=kept,
                     x_full=x.astype(np.float32), y_full=y.astype(np.float32), docs=np.arange(n_seq))
    cfg = AnalysisConfig(n_seq=n_seq, seq_len=seq_len, k=48, rank=4, classes=("lowrank",), positive_controls=(),
                         bootstrap=200, jackknife_groups=0)
    prov = Provenance.of("planted", "r", "c", "s", cfg, 2, "w")
    fits, neighbours = compute_fits(data, cfg)
    _, _, real = geometry_tables(data, fits, cfg, prov)
    null = control_layer_tables(data, None, neighbours, cfg, prov)["control_geometry_bootstrap"]
    assert set(null["control"].to_pylist()) == {"unrelated"}
    return real["cos_full_tok_median"].to_numpy(), null["cos_full_tok_median"].to_numpy()


def test_the_fitted_null_is_reachable_when_the_layer_is_tokenwise_and_not_when_it_is_not() -> None:
    """Finding 1's null (the same fits on x paired with another document's update): a tokenwise layer is
    beyond it; a layer whose updates have the same distribution but no relation to x is not, although
    its fits still align with the updates' shared mean (the null is well above 0, unlike a sign test)."""
    from updatelens.verdicts import NULL_WORDS, difference_outcome

    for tokenwise, expected in ((True, "beyond"), (False, "indistinct")):
        real, null = _fitted_medians(tokenwise)
        lo, hi = np.quantile(real - null, [0.025, 0.975])
        assert difference_outcome(">=", float(lo), float(hi), NULL_WORDS) == expected, (tokenwise, lo, hi)
        assert np.median(null) > 0.2, np.median(null)  # the updates' shared mean: what an isotropic null misses


def test_findings_1_take_their_null_from_the_null_target_resample_by_resample(tmp_path: Path) -> None:
    """The catalog reads finding 1's (and 1 map's) null from the same finding measured on the stored
    `unrelated` target, on the same resample: a null target whose cosines are the real ones lowered by
    0.2 gives a null 0.2 below the value on every replicate, so the difference's interval is a point."""
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    write_controls(tmp_path, {"self_first": None,
                              "unrelated": {"cos_full_tok_median": -0.2, "cos_full_tok": -0.2,
                                            "cos_full_tok_map_median": -0.2, "cos_full_tok_map": -0.2}})
    replicates = catalog.query(tmp_path, "SELECT * FROM finding_replicates WHERE finding IN ('1', '1 map') "
                                         "AND value IS NOT NULL").to_dicts()
    assert len(replicates) > 2 * len(CLASSES) and all(r["null_value"] is not None for r in replicates)
    assert all(abs(r["value"] - r["null_value"] - 0.2) < 1e-9 for r in replicates)
    rows = catalog.query(tmp_path, "SELECT * FROM findings_by_class WHERE finding IN ('1', '1 map')").to_dicts()
    for row in rows:
        assert abs(row["diff_ci_lo"] - 0.2) < 1e-9 and abs(row["diff_ci_hi"] - 0.2) < 1e-9
        assert row["null_outcome"] == "beyond" and row["control"] == "self_first"  # a null, not the control


def test_the_exact_split_is_its_own_estimator_row_in_the_findings(tmp_path: Path) -> None:
    """The controls stage's `exact` rows (the real layer with y_ctl in the place of a fit) render as the
    `findings` view's estimator 'exact' beside the best fitted class: the same finding code on its rows,
    and no control in its verdict (it has no estimator whose limit a control would show)."""
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    stored = {table: by_layer(tmp_path, f"SELECT * FROM {table} WHERE fn_class = 'lowrank'")
              for table in ("geometry", "spectra", "geometry_bootstrap")}
    for table, layers in stored.items():
        for layer in range(LAYERS):
            real = layers[layer]
            exact = real.set_column(real.schema.get_field_index("fn_class"), "fn_class", pa.array(["exact"] * len(real)))
            write_partition(tmp_path, f"control_{table}", "m", layer,
                            exact.add_column(1, "control", pa.array(["exact"] * len(exact))))
    rows = catalog.query(tmp_path, "SELECT * FROM findings").to_dicts()
    fitted = {r["finding"]: r for r in rows if r["estimator"] != "exact"}
    exact = {r["finding"]: r for r in rows if r["estimator"] == "exact"}
    assert all(r["estimator"] == r["fn_class"] == "lowrank" for r in fitted.values())
    # the geometric findings (no KL and no class comparison on the split: 4 and 5 are not measured on it)
    assert set(exact) == set(fitted) - {"4", "4 norm", "4 direction", "5"}
    for finding, row in exact.items():
        assert row["fn_class"] == "exact" and row["control_role"] == "none" and row["control_outcome"] is None
        assert row["verdict"] not in ("estimator-limited", "no control")
        if row["value"] is not None:  # the same numbers, the same value
            assert row["value"] == pytest.approx(fitted[finding]["value"], rel=1e-12), finding
    # finding 1's null: a fitted class's comes from the null target (not stored here), the split's from its rows
    assert fitted["1"]["null_value"] is None and exact["1"]["null_value"] is not None
