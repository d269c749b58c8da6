"""Data-quality checks: corrupt each stage's output on purpose and watch the matching check fail
with a clear message, and the downstream assets not materialize; clean data passes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from updatelens import assets
from updatelens.assets.checks import CheckSettings
from updatelens.assets.partitions import model_keys
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.fits.base import LocalFit
from updatelens.orchestration.definitions import ASSETS
from updatelens.steps import functional_metrics as step_functional
from updatelens.steps import local_fits as step_fits
from updatelens.storage.layout import partition_file
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
    assert set(checks) == {"activations_valid", "activations_match_hidden_states", "fits_valid", "fits_refit_audit",
                           "residuals_match_fits", "rel_err_within_bounds", "rel_err_drift", "no_blown_up_fits",
                           "geometry_ranges", "controls_valid", "functional_valid"}
    assert all(e.passed for e in checks.values()), {n: e.description for n, e in checks.items() if not e.passed}
    meta = checks["residuals_match_fits"].metadata
    assert meta["expectations_failed"].value == 0 and meta["expectations_evaluated"].value > 5


def assert_blocked(result, instance, check: str, message: str, downstream: str, root: Path) -> None:
    assert not result.success
    evaluation = evaluations(result)[check]
    assert not evaluation.passed
    assert message in evaluation.description, evaluation.description
    assert "worst_offenders" in evaluation.metadata or "failures" in evaluation.metadata
    # the partition's own evaluation names it
    own = [e for e in result.get_asset_check_evaluations() if e.check_name == check and e.partition]
    assert [(e.partition, e.passed) for e in own] == [(f"{MODEL}:01", False)]
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
    """x and y one entry short (a capture from another width: the schema takes any width shared by
    a table's vectors, the check compares it with the model's)."""
    def short(t: pa.Table) -> pa.Table:
        for column in ("x", "y", "y_ctl", "y_lin"):
            if t[column].null_count < len(t):  # y_ctl, y_lin: only where a control is made
                t = with_vectors(t, column, lambda v: v[:, :-1])
            else:  # a control not made: its nulls take the capture's width too
                width = t.schema.field(column).type.list_size - 1
                t = t.set_column(t.schema.get_field_index(column), column,
                                 pa.nulls(len(t), pa.list_(pa.float32(), width)))
        return t

    corrupt(monkeypatch, assets.activations, "activation_rows", short)
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_valid", "x vectors have length 31, expected d_model = 32",
                   "local_fits", tmp_path)


def test_tokens_naming_other_ids_block_the_fits(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def shifted(t: pa.Table) -> pa.Table:
        return t.set_column(t.schema.get_field_index("token_id"), "token_id", pc.add(t["token_id"], 1))

    corrupt(monkeypatch, assets.activations, "token_rows", shifted)
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_valid", "the tokens table names other tokens than the activations",
                   "local_fits", tmp_path)


def test_a_small_error_at_one_position_fails_the_hidden_state_comparison(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """x off by 0.1 % of its own scale at position 5 only: judged per row (not against the batch's
    largest state, which position 0 sets), the comparison with output_hidden_states catches it."""
    def shifted(t: pa.Table) -> pa.Table:
        at = (t["pos"].to_numpy() == 5)[:, None]
        return with_vectors(t, "x", lambda v: v + at * 1e-3 * np.abs(v).max(axis=1, keepdims=True))

    corrupt(monkeypatch, assets.activations, "activation_rows", shifted)
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "activations_match_hidden_states", "x differs from output_hidden_states",
                   "local_fits", tmp_path)


def test_fits_out_of_line_with_their_neighbours_fail_the_refit_audit(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T(x) stored one row off (each row holds its neighbour row's fit): finite, the right length and
    count, so only re-fitting anchors from their stored neighbours shows it."""
    original = step_fits.fit_row_parts

    def shifted(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for part in original(*args, **kwargs):
            yield with_vectors(part, "tx", lambda v: np.roll(v, 1, axis=0))

    monkeypatch.setattr(step_fits, "fit_row_parts", shifted)
    result, instance = run(zoo, tmp_path)
    assert evaluations(result)["fits_valid"].passed
    assert_blocked(result, instance, "fits_refit_audit", "re-fitted anchors differ from the stored T(x)",
                   "residuals", tmp_path)


def run_with_diagonal_solver(zoo: Path, root: Path, monkeypatch: pytest.MonkeyPatch,
                             change: Callable) -> dict[str, dg.AssetCheckEvaluation]:
    """Materialize with the diagonal solver's T(x) passed through change(tx, anchors) wherever it is
    called (the stage and the refit audit alike, as a code change would): fits, residuals and the
    audit then agree with one another, which the test asserts."""
    import updatelens.fits

    solver = updatelens.fits.LOCAL_FITTERS["diagonal"]

    def changed(X, D, anchors, params):  # type: ignore[no-untyped-def]
        fit = solver(X, D, anchors, params)
        return LocalFit(tx=change(fit.tx, anchors), cond=fit.cond)

    monkeypatch.setitem(updatelens.fits.LOCAL_FITTERS, "diagonal", changed)
    result, _ = run(zoo, root)
    checks = evaluations(result)
    assert checks["fits_refit_audit"].passed and checks["residuals_match_fits"].passed
    return checks


def test_a_solver_that_changes_its_answers_fails_the_drift_check(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second materialization whose diagonal solver returns its update with the wrong sign (a
    regression a code change could bring): its stored fits, residuals and audit agree with one another,
    so only the comparison with the previous materialization's relative errors shows it. Rerun
    unchanged, it passes."""
    first, _ = run(zoo, tmp_path)
    nothing = evaluations(first)["rel_err_drift"]  # passes, and says it had nothing to compare with
    assert first.success and nothing.metadata["expectations_evaluated"].value == 0
    assert nothing.description == ("passed; not checked: no previous materialization of this partition under "
                                   "this configuration to compare the relative errors with")
    again, _ = run(zoo, tmp_path)
    drift = evaluations(again)["rel_err_drift"]
    assert drift.passed and drift.metadata["expectations_evaluated"].value == 2  # diagonal and lowrank compared
    checks = run_with_diagonal_solver(zoo, tmp_path, monkeypatch, lambda tx, anchors: anchors - (tx - anchors))
    assert not checks["rel_err_drift"].passed
    assert "diagonal: relative error quantiles (10/50/90 %) moved from" in checks["rel_err_drift"].description


def test_degenerate_fits_fail_the_fits_check_and_block_the_residuals(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fourth stored fit flagged degenerate (what ill-conditioned neighbourhoods give): above the
    5 % bound, fits_valid fails and names the share; the stages that read the fits do not run."""
    original = step_fits.fit_row_parts

    def flagged(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for part in original(*args, **kwargs):
            column = part.schema.get_field_index("degenerate")
            yield part.set_column(column, part.schema.field(column), pa.array(np.arange(len(part)) % 4 == 0))

    monkeypatch.setattr(step_fits, "fit_row_parts", flagged)
    result, instance = run(zoo, tmp_path)
    assert_blocked(result, instance, "fits_valid", "of fits are degenerate (bound 5%)", "residuals", tmp_path)
    measured = evaluations(result)["fits_valid"].metadata["measured"].value
    assert measured["degenerate_share_bound"] == 0.05 and 0.2 < measured["degenerate_share(diagonal)"] < 0.3


def test_fits_far_worse_than_the_update_fail_the_relative_error_bound(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A solver whose T(x) points away from the update (-10 x): fits, residuals and the audit agree,
    but the best class's median relative error is beyond the bound, which rel_err_within_bounds names."""
    monkeypatch.setitem(SETTINGS, "classes", ["diagonal"])
    checks = run_with_diagonal_solver(zoo, tmp_path, monkeypatch, lambda tx, anchors: -10.0 * anchors)
    bound = checks["rel_err_within_bounds"]
    assert not bound.passed and "best class 'diagonal' has median relative error" in bound.description
    assert f"(bound {LOOSE.max_best_rel_err_median})" in bound.description
    measured = bound.metadata["measured"].value  # the UI shows the measured value beside its bound
    assert measured["bound"] == LOOSE.max_best_rel_err_median < measured["rel_err_median(diagonal)"]


def test_one_blown_up_fit_fails_its_check(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The diagonal solver returns a huge update for some anchors (what an ill-conditioned neighbourhood
    does): stored fits, residuals and the audit agree; the residual's length against the layer's
    updates shows it and names the tokens."""
    def one_blows_up(tx, anchors):  # type: ignore[no-untyped-def]
        # chosen by the anchor's own values, so the audit's re-fit blows up the same anchors
        blown = ((anchors[:, :1] * 1e4).floor() % 7 == 0).to(anchors.dtype)
        return tx + 1e3 * blown * (tx - anchors)

    checks = run_with_diagonal_solver(zoo, tmp_path, monkeypatch, one_blows_up)
    assert not checks["no_blown_up_fits"].passed
    assert "a fit blew up" in checks["no_blown_up_fits"].description
    assert checks["no_blown_up_fits"].metadata["worst_offenders"].value[0]["ratio"] > 10


def test_broken_reconstruction_in_the_stored_residuals_fails_the_run(zoo: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Residual vectors off y - T(x) in the stored file (the check reads them back): the blocking
    check fails and so does the run; the stages that read only the activations and fits still ran."""
    corrupt(monkeypatch, assets.residuals, "residuals_table",
            lambda t: with_vectors(t, "residual", lambda v: v + 0.01 * (np.arange(len(v))[:, None] % 11 == 0)))
    result, instance = run(zoo, tmp_path)
    assert not result.success
    evaluation = evaluations(result)["residuals_match_fits"]
    assert not evaluation.passed and "Δ_full != Δ_tok + r on" in evaluation.description
    assert "worst_offenders" in evaluation.metadata
    assert materialized(instance, "geometry")  # geometry does not read the residuals


def test_a_block_written_twice_by_the_streamed_geometry_fails_its_check(zoo: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The geometry stage writes a block of its per-token rows twice: the stored file has more rows
    than kept tokens x classes, and duplicates, which geometry_ranges reports."""
    from updatelens.steps.geometry import LayerGeometry

    original = LayerGeometry.token_table
    monkeypatch.setattr(LayerGeometry, "token_table",
                        lambda self, *args: pa.concat_tables([original(self, *args)] * 2))
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["geometry_ranges"]
    assert not evaluation.passed
    assert "ExpectTableRowCountToEqual" in evaluation.description
    assert "ExpectCompoundColumnsToBeUnique" in evaluation.description


def test_a_block_counted_twice_in_the_geometry_spectra_fails_its_check(zoo: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed geometry adds the first block of sequences to its Gram matrices twice: every token
    row is still written once, but the spectrum of Δ_full no longer sums to the kept tokens' updates
    in the stored activations, which geometry_ranges reports."""
    import updatelens.assets.common as common
    from updatelens.steps.geometry import LayerGeometry
    from updatelens.steps.layer import LayerData

    monkeypatch.setattr(common, "BLOCK_ROWS", 32)  # 2 sequences of 16 a block: 3 blocks
    original = LayerGeometry.accumulate

    def twice_the_first(self: LayerGeometry, data: LayerData, fits: dict) -> None:
        original(self, data, fits)
        if data.seq_offset == 0:
            original(self, data, fits)

    monkeypatch.setattr(LayerGeometry, "accumulate", twice_the_first)
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["geometry_ranges"]
    assert not evaluation.passed
    assert "the spectrum of Δ_full sums to" in evaluation.description, evaluation.description
    assert "ExpectTableRowCountToEqual" not in evaluation.description  # the token rows are right


def test_a_control_lost_or_out_of_range_fails_the_controls_check(zoo: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The controls stage loses its self-and-first control (only the linear one is stored, where both were
    asked for), and the linear control's cosines leave [-1, 1]: controls_valid names both."""
    import updatelens.steps.controls as stage

    original = stage.control_tables

    def broken(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for control, (geometry, spectra, resamples) in original(*args, **kwargs):
            if control == "self_first":
                continue
            column = geometry.schema.get_field_index("cos_full_tok")
            geometry = geometry.set_column(column, "cos_full_tok", pc.add(geometry["cos_full_tok"], 3.0))
            yield control, (geometry, spectra, resamples)

    monkeypatch.setattr(stage, "control_tables", broken)
    monkeypatch.setitem(SETTINGS, "positive_controls", ["self_first", "linear"])
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["controls_valid"]
    assert not evaluation.passed
    assert ("controls stored ['exact', 'linear', 'unrelated'], expected ['exact', 'linear', 'self_first', 'unrelated']"
            in evaluation.description), evaluation.description
    assert "linear: " in evaluation.description and "out_of_range" in evaluation.description, evaluation.description


def test_without_positive_controls_the_empty_control_partitions_verify_and_the_report_builds(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """positive_controls=[]: the controls stage stores only the null target's rows (findings 1's fitted
    null) and no exact split; the partitions verify, the layer is complete, and the report builds."""
    from updatelens.reports.build import build_model_report
    from updatelens.stages import TABLES
    from updatelens.storage.integrity import incomplete_layers, partition_error

    monkeypatch.setitem(SETTINGS, "positive_controls", [])
    result, _ = run(zoo, tmp_path)
    assert result.success and evaluations(result)["controls_valid"].passed
    for table in ("control_geometry", "control_spectra", "control_geometry_bootstrap"):
        assert partition_error(partition_file(tmp_path, table, MODEL, 1), full=True) is None, table
    assert incomplete_layers(tmp_path, TABLES) == []
    report = build_model_report(tmp_path, MODEL)
    assert not any("control_geometry" in note for note in report.notes), report.notes


def test_unnormalised_distributions_fail_the_functional_check_before_the_clamp(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Original log-probabilities off by a constant (p no longer sums to 1): the KL goes negative
    before its clamp at 0, which the stored (clamped) column alone could not show."""
    corrupt(monkeypatch, step_functional, "original_output",
            lambda orig: dataclasses.replace(orig, logp=orig.logp - 0.05))
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["functional_valid"]
    assert not evaluation.passed
    assert "KL below 0 beyond rounding before the clamp: patch/" in evaluation.description, evaluation.description
    assert "e-02" in evaluation.description  # the size of the fault is reported (about -0.05)


def test_a_patch_that_is_not_applied_fails_the_functional_check(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume hook silently does nothing: every patched pass reproduces the model, so the
    identity patch still gives KL 0; the random-direction control's KL of 0 shows the fault."""
    import updatelens.perturbation

    @contextlib.contextmanager
    def not_applied(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        yield

    monkeypatch.setattr(updatelens.perturbation, "resume_at_block", not_applied)
    result, _ = run(zoo, tmp_path)
    evaluation = evaluations(result)["functional_valid"]
    assert not evaluation.passed
    assert "random-direction control leaves the output unchanged" in evaluation.description, evaluation.description
