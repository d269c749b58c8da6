"""Data-quality checks: corrupt each stage's output on purpose and watch the matching check fail
with a clear message, and the downstream assets not materialize; clean data passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pytest

import assets.activations
import assets.functional_metrics
import assets.residuals
from assets.checks import CheckSettings
from orchestration.definitions import ASSETS
from orchestration.partitions import model_keys
from orchestration.resources import AnalysisSettings, UpdateLensResource
from storage.layout import partition_file
from updatelens.tables import to_matrix, vector_column

MODEL = "tiny-gpt2"
SETTINGS = dict(n_seq=6, seq_len=16, k=8, rank=2)
# random tiny models have no tokenwise structure: their best median relative error is ~1
LOOSE = CheckSettings(max_best_rel_err_median=2.0)


def run(zoo: Path, root: Path) -> tuple[dg.ExecuteInJobResult, dg.DagsterInstance]:
    lens = UpdateLensResource(data_root=str(root), registry=str(zoo), analysis=AnalysisSettings(**SETTINGS),
                              checks=LOOSE)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("model_layer", model_keys(MODEL, 3))
    result = dg.materialize(ASSETS, instance=instance, resources={"lens": lens}, partition_key=f"{MODEL}:01",
                            raise_on_error=False)
    return result, instance


def evaluations(result: dg.ExecuteInJobResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def materialized(instance: dg.DagsterInstance, asset: str) -> bool:
    return instance.get_latest_materialization_event(dg.AssetKey(asset)) is not None


def corrupt(monkeypatch: pytest.MonkeyPatch, module: object, name: str, change: Callable) -> None:
    original = getattr(module, name)

    def wrapped(*args: object, **kwargs: object) -> object:
        return change(original(*args, **kwargs))

    monkeypatch.setattr(module, name, wrapped)


def with_vectors(table: pa.Table, column: str, fn: Callable[[np.ndarray], np.ndarray]) -> pa.Table:
    values = fn(to_matrix(table[column]).copy())
    return table.set_column(table.schema.get_field_index(column), column, vector_column(values))


def test_clean_data_passes_every_check(zoo: Path, tmp_path: Path) -> None:
    result, instance = run(zoo, tmp_path)
    assert result.success
    checks = evaluations(result)
    assert set(checks) == {"activations_valid", "activations_match_hidden_states", "fits_valid",
                           "reconstruction_exact", "rel_err_within_bounds", "geometry_ranges", "functional_valid"}
    assert all(e.passed for e in checks.values()), {n: e.description for n, e in checks.items() if not e.passed}
    meta = checks["reconstruction_exact"].metadata
    assert meta["expectations_failed"].value == 0 and meta["expectations_evaluated"].value > 5


def assert_blocked(result, instance, check: str, message: str, downstream: str, root: Path) -> None:
    assert not result.success
    evaluation = evaluations(result)[check]
    assert not evaluation.passed
    assert message in evaluation.description, evaluation.description
    assert "worst_offenders" in evaluation.metadata or "failures" in evaluation.metadata
    assert not materialized(instance, downstream)
    assert not partition_file(root, downstream, MODEL, 1).exists()


def test_nan_rows_in_activations_block_the_fits(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_rows(t: pa.Table) -> pa.Table:
        return with_vectors(t, "y", lambda v: np.where(np.arange(len(v))[:, None] % 7 == 3, np.nan, v))

    corrupt(monkeypatch, assets.activations, "activation_rows", nan_rows)
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_valid", "y has 14 rows with NaN/Inf", "local_fits", tmp_path)


def test_wrong_row_count_in_activations_blocks_the_fits(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt(monkeypatch, assets.activations, "activation_rows", lambda t: t.slice(0, len(t) - 5))
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_valid", "ExpectTableRowCountToEqual(value=96) failed",
                   "local_fits", tmp_path)


def test_wrong_vector_length_blocks_the_fits(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt(monkeypatch, assets.activations, "activation_rows", lambda t: with_vectors(t, "x", lambda v: v[:, :-1]))
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_valid", "x vectors have length 31, expected d_model = 32",
                   "local_fits", tmp_path)


def test_broken_reconstruction_blocks_geometry(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt(monkeypatch, assets.residuals, "residuals_table",
            lambda t: with_vectors(t, "residual", lambda v: v + 0.01 * (np.arange(len(v))[:, None] % 11 == 0)))
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "reconstruction_exact", "Δ_full != Δ_tok + r on", "geometry", tmp_path)


def test_negative_kl_fails_the_functional_check(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def negative(tables: tuple[pa.Table, pa.Table]) -> tuple[pa.Table, pa.Table]:
        fm, fs = tables
        kl = fm["kl"].to_numpy().copy()
        kl[::10] = -0.5
        return fm.set_column(fm.schema.get_field_index("kl"), "kl", pa.array(kl)), fs

    corrupt(monkeypatch, assets.functional_metrics, "functional_tables_from_rows", negative)
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["functional_valid"]
    assert not evaluation.passed
    assert "ExpectColumnValuesToBeBetween(kl, min_value=0.0) failed" in evaluation.description
    offenders = evaluation.metadata["worst_offenders"].value
    assert offenders and all(o["kl"] == -0.5 for o in offenders)
