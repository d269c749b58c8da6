"""Positive controls: the self-only block is tokenwise by construction, the linear control never sees
the token's document, and the verdicts read both controls (a planted layer whose target is the
control itself is never `fails`; a residual beyond its null on the wrong side is `opposite`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.unit.test_findings import CLASSES, LAYERS, fixture, replicate_fixture
from updatelens.capture import capture_batches, record_block_calls, record_block_states, self_only_outputs
from updatelens.errors import ModelError
from updatelens.findings import BY_ID
from updatelens.models import LoadedModel, locate_blocks
from updatelens.steps.controls import linear_target
from updatelens.storage import catalog
from updatelens.storage.layout import write_partition

ATTENTION = ["tiny-gpt2", "tiny-llama", "tiny-neox"]


def ids(n: int = 3, t: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 500, size=(n, t))


def self_only(lm: LoadedModel, x: np.ndarray, layers: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    (batch,) = capture_batches(lm, x, np.ones_like(x), batch_size=len(x), self_only=layers)
    return batch.states, batch.self_only


def calls_and_states(lm: LoadedModel, x: np.ndarray, layers: list[int]) -> tuple[np.ndarray, dict]:
    """The states of one forward pass and the arguments the model gave each of `layers`' blocks."""
    sink: list[list[torch.Tensor]] = [[] for _ in range(lm.n_layers + 1)]
    calls: dict = {}
    with torch.inference_mode(), record_block_states(lm.blocks, sink), record_block_calls(lm.blocks, layers, calls):
        lm.model(input_ids=torch.as_tensor(x), use_cache=False)
    return np.stack([chunks[0].numpy() for chunks in sink]), calls


@pytest.mark.parametrize("slug", ATTENTION)
def test_the_self_only_block_maps_each_token_by_itself(tiny_models: dict, slug: str) -> None:
    """A token's self-only output depends on its own input alone: the same token state gives the same
    output in another sequence, at another position, beside other tokens; and it is not the real block
    output (attention between tokens matters in the real one)."""
    lm = tiny_models[slug]
    x = ids()
    states, alone = self_only(lm, x, [0, 1])
    _, calls = calls_and_states(lm, x, [0, 1])
    order = np.random.default_rng(1).permutation(x.size)
    shuffled = states.copy()
    for layer in (0, 1):
        out = alone[layer]
        assert out.shape == states[layer + 1].shape
        assert not np.allclose(out, states[layer + 1], atol=1e-4)  # the real block mixes tokens
        shuffled[layer] = states[layer].reshape(x.size, -1)[order].reshape(states[layer].shape)
    again = self_only_outputs(lm, shuffled, calls)
    for layer in (0, 1):
        np.testing.assert_allclose(again[layer].reshape(x.size, -1), alone[layer].reshape(x.size, -1)[order],
                                   rtol=1e-4, atol=1e-5)


def test_the_self_only_llama_block_is_its_value_path_and_mlp(tiny_models: dict) -> None:
    """Independently of the mask: with one key, attention returns that key's value, so the Llama block
    is h = x + o(v(norm(x))) (value heads repeated over their query groups), then h + mlp(norm(h))."""
    lm = tiny_models["tiny-llama"]
    x = ids(2, 8)
    states, alone = self_only(lm, x, [1])
    block = lm.blocks[1]
    with torch.inference_mode():
        h0 = torch.as_tensor(states[1])
        attn = block.self_attn
        v = attn.v_proj(block.input_layernorm(h0))
        groups = attn.config.num_attention_heads // attn.config.num_key_value_heads
        head_dim = attn.head_dim
        v = v.view(*v.shape[:2], -1, head_dim).repeat_interleave(groups, dim=2).reshape(*v.shape[:2], -1)
        h = h0 + attn.o_proj(v)
        expected = h + block.mlp(block.post_attention_layernorm(h))
    np.testing.assert_allclose(alone[1], expected.numpy(), rtol=1e-4, atol=1e-5)


def test_gemma3_sliding_and_full_attention_blocks_make_a_self_only_control() -> None:
    """Gemma 3 (the second embedded model's architecture, built tiny from its config): sliding-window
    and global layers both take the self-only mask."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    name, blocks, adapter = locate_blocks(model)
    lm = LoadedModel("tiny-gemma3", model, AutoTokenizer, blocks, name, 2, 32, 64, "r", True,
                     self_attention=adapter.self_attention)
    x = ids(2, 9)
    states, alone = self_only(lm, x, [0, 1])  # the capture checks each block on reversed positions
    _, calls = calls_and_states(lm, x, [0, 1])
    order = np.random.default_rng(2).permutation(x.size)
    shuffled = states.copy()
    for layer in (0, 1):
        assert np.isfinite(alone[layer]).all()
        assert not np.allclose(alone[layer], states[layer + 1], atol=1e-4)
        shuffled[layer] = states[layer].reshape(x.size, -1)[order].reshape(states[layer].shape)
    again = self_only_outputs(lm, shuffled, calls)
    for layer in (0, 1):
        np.testing.assert_allclose(again[layer].reshape(x.size, -1), alone[layer].reshape(x.size, -1)[order],
                                   rtol=1e-4, atol=1e-5)


def test_a_model_that_ignores_the_mask_is_refused(tiny_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture checks the mask took effect: a block that still mixes tokens under it is refused."""
    import updatelens.capture as capture_module

    monkeypatch.setattr(capture_module, "self_only_mask",
                        lambda given, b, t, *_: torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, 1, t, t))
    with pytest.raises(ModelError, match="ignores a 4D attention mask"):
        self_only(tiny_models["tiny-llama"], ids(), [1])


def test_an_architecture_without_attention_has_no_self_only_control(tiny_models: dict) -> None:
    with pytest.raises(ModelError, match="self-only"):
        self_only(tiny_models["tiny-mamba"], ids(), [0])


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
    write_control(tmp_path, "self_only")
    rows = catalog.query(tmp_path, "SELECT * FROM findings_by_class").to_dicts()
    # six layers leave no middle layer outside the two first and two last: '6 inner' has no value
    empty = [r for r in rows if r["value"] is None]
    assert {r["finding"] for r in empty} == {"6 inner"} and {r["verdict"] for r in empty} == {None}
    rows = [r for r in rows if r["value"] is not None]
    assert {r["control"] for r in rows if BY_ID[r["finding"]].control_role in ("positive", "floor")} == {"self_only"}
    for row in rows:
        role = BY_ID[row["finding"]].control_role
        if role in ("positive", "floor"):
            assert row["control_outcome"] == "same"  # the real value is the control's
            assert row["self_only_diff_ci_lo"] == 0 and row["self_only_diff_ci_hi"] == 0
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
    write_control(tmp_path, "self_only", {"cos_full_tok_median": 5.0, "cos_full_tok": 5.0})
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
