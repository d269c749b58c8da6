"""Positive controls: the self-and-first block is tokenwise by construction, the linear control never sees
the token's document, and the verdicts read both controls (a planted layer whose target is the
control itself is never `fails`; a residual beyond its null on the wrong side is `opposite`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.unit.test_findings import CLASSES, LAYERS, fixture, replicate_fixture
from updatelens.capture import capture_batches, record_block_calls, record_block_states, self_first_outputs
from updatelens.errors import ModelError
from updatelens.findings import BY_ID
from updatelens.models import LoadedModel, locate_blocks
from updatelens.steps.controls import linear_target
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
    again = self_first_outputs(lm, shuffled, calls)
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


def test_the_linear_control_never_sees_the_tokens_document() -> None:
    rng = np.random.default_rng(0)
    n, d = 300, 6
    x = rng.normal(size=(n, d)).astype(np.float32)
    doc = np.repeat(np.arange(6), n // 6)
    b = rng.normal(size=(d, d)) * 0.3
    y = (x + x @ b).astype(np.float32)
    target = linear_target(x, y, doc, ridge=1e-9)
    np.testing.assert_allclose(target, y, rtol=1e-4, atol=1e-4)  # an exactly linear update is recovered
    changed = y.copy()
    changed[doc == 2] += rng.normal(size=(int((doc == 2).sum()), d)).astype(np.float32) * 5
    again = linear_target(x, changed, doc, ridge=1e-9)
    np.testing.assert_array_equal(again[doc == 2], target[doc == 2])  # its own document's y is never used
    assert not np.allclose(again[doc != 2], target[doc != 2])  # the others' fits saw it


def write_control(root: Path, control: str, shift: dict[str, float] | None = None) -> None:
    """A positive control whose tables are the real layer's (the target is the control itself), with
    `shift` added to the named bootstrap statistics."""
    for table in ("geometry", "spectra", "geometry_bootstrap"):
        for layer in range(LAYERS):
            real = catalog.query(root, f"SELECT * FROM {table} WHERE layer = $1", [layer]).to_arrow()
            for name, delta in (shift or {}).items():
                if name in real.column_names:
                    column = real[name].to_numpy() + delta
                    real = real.set_column(real.schema.get_field_index(name), name, pa.array(column, from_pandas=True))
            write_partition(root, f"control_{table}", "m", layer,
                            real.add_column(1, "control", pa.array([control] * len(real))))


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
    for layer in range(LAYERS):  # the real layer: well below 0.9 on every resample
        table = catalog.query(tmp_path, "SELECT * FROM geometry_bootstrap WHERE layer = $1", [layer]).to_arrow()
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
    for layer in range(LAYERS):
        table = catalog.query(tmp_path, "SELECT * FROM geometry_bootstrap WHERE layer = $1", [layer]).to_arrow()
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
