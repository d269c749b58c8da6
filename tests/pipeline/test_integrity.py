"""Damaged and missing partitions: detected, left out of the views (other partitions keep answering),
counted as stale, quarantined (never deleted) and recomputed by the next run."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest

from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.orchestration.cli import main
from updatelens.orchestration.runner import materialize_model, stale_layers
from updatelens.reports.build import build_model_report
from updatelens.storage import catalog
from updatelens.storage.integrity import MANIFEST, QUARANTINE, partition_error, read_manifest
from updatelens.storage.layout import partition_file

MODEL = "tiny-llama"
SETTINGS = dict(n_seq=6, seq_len=16, k=8, rank=2, classes=["diagonal"], bootstrap=10)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # what a full disk or a partial copy leaves


@pytest.fixture(scope="module")
def pristine(zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0 and 1 materialized once per module; each test damages a copy of them."""
    root = tmp_path_factory.mktemp("integrity") / "data"
    lens = UpdateLensResource(data_root=str(root), registry=str(zoo), analysis=AnalysisSettings(**SETTINGS))
    assert materialize_model(MODEL, lens, dg.DagsterInstance.ephemeral(), layers=[0, 1], log_level="WARNING").success
    return root


@pytest.fixture
def stored(pristine: Path, zoo: Path, tmp_path: Path) -> tuple[UpdateLensResource, dg.DagsterInstance]:
    """A copy of the pristine root (another folder: its catalog is verified anew, as for any copied root)
    and a fresh instance: what `run` decides comes from the stored files, not from Dagster's history."""
    shutil.copytree(pristine, tmp_path / "data", symlinks=True)
    lens = UpdateLensResource(data_root=str(tmp_path / "data"), registry=str(zoo), analysis=AnalysisSettings(**SETTINGS))
    return lens, dg.DagsterInstance.ephemeral()


def test_a_truncated_partition_is_left_out_named_quarantined_and_recomputed(
        stored: tuple[UpdateLensResource, dg.DagsterInstance], capsys: pytest.CaptureFixture) -> None:
    lens, instance = stored
    damaged = Path(partition_file(lens.root, "residuals", MODEL, 1))
    truncate(damaged)
    # other partitions keep answering; the damaged one is named
    assert catalog.query(lens.root, "SELECT DISTINCT layer FROM residuals")["layer"].to_list() == [0]
    assert catalog.query(lens.root, "SELECT count(DISTINCT layer) AS n FROM geometry")["n"][0] == 2
    listed = catalog.query(lens.root, "SELECT table_name, model, layer, reason FROM damaged_partitions").to_dicts()
    assert len(listed) == 1 and listed[0]["table_name"] == "residuals" and listed[0]["layer"] == 1
    assert "its manifest says" in listed[0]["reason"] and "truncated" in listed[0]["reason"]
    assert stale_layers(lens, MODEL, [0, 1]) == {1: ["residuals"]}  # no stage reads the residuals
    notes = build_model_report(lens.root, MODEL).notes  # the report does not present layer 1 as complete
    assert any("Layer 1: its residuals partition is damaged" in n for n in notes), notes
    # verify reports it (exit 1); --repair moves it aside, never deletes it
    assert main(["verify", "--data-root", lens.data_root]) == 1
    assert f"damaged: {damaged}" in capsys.readouterr().out
    assert main(["verify", "--data-root", lens.data_root, "--repair"]) == 1  # layer 1 is now incomplete
    out = capsys.readouterr().out
    assert "quarantined to" in out and f"incomplete: model={MODEL} layer=1: no residuals" in out
    assert any("Layer 1: its residuals partition is missing; the analysis tables of the layer are still shown" in n
               for n in build_model_report(lens.root, MODEL).notes)
    kept = list((Path(lens.data_root) / QUARANTINE).rglob("part-0.parquet"))
    assert len(kept) == 1 and "residuals/model=tiny-llama/layer=1" in str(kept[0]) and not damaged.exists()
    assert (kept[0].parent / MANIFEST).exists()  # its manifest goes with it
    # the next run recomputes exactly that layer
    assert materialize_model(MODEL, lens, instance, layers=[1], log_level="WARNING").success
    assert stale_layers(lens, MODEL, [0, 1]) == {}
    assert main(["verify", "--data-root", lens.data_root]) == 0


def test_a_damaged_file_replaced_by_a_run_is_kept_in_quarantine(
        stored: tuple[UpdateLensResource, dg.DagsterInstance]) -> None:
    lens, instance = stored
    truncate(Path(partition_file(lens.root, "geometry", MODEL, 0)))
    assert stale_layers(lens, MODEL, [0, 1]) == {0: ["geometry"]}
    with pytest.warns(UserWarning, match="replaced a damaged partition file"):
        assert materialize_model(MODEL, lens, instance, layers=[0], log_level="WARNING").success
    kept = list((Path(lens.data_root) / QUARANTINE).rglob("part-0.parquet"))
    assert [k.parent.parent.parent.name for k in kept] == ["geometry"]
    assert catalog.query(lens.root, "SELECT count(*) AS n FROM damaged_partitions")["n"][0] == 0


def test_a_deleted_partition_makes_its_layer_stale_and_incomplete(
        stored: tuple[UpdateLensResource, dg.DagsterInstance], capsys: pytest.CaptureFixture) -> None:
    lens, _ = stored
    Path(partition_file(lens.root, "spectra", MODEL, 1)).unlink()
    assert stale_layers(lens, MODEL, [0, 1]) == {1: ["geometry"]}
    assert main(["verify", "--data-root", lens.data_root]) == 1
    assert f"incomplete: model={MODEL} layer=1: no spectra" in capsys.readouterr().out


def test_every_partition_has_a_manifest_and_a_flipped_bit_is_caught(
        stored: tuple[UpdateLensResource, dg.DagsterInstance]) -> None:
    """A flipped byte in the middle of a file keeps its size and usually its footer: only the content
    checksum of its manifest shows it. A file whose manifest is lost is not trusted either."""
    lens, _ = stored
    file = Path(partition_file(lens.root, "local_fits", MODEL, 0))
    entry = read_manifest(file)
    assert entry is not None and entry["table"] == "local_fits" and entry["bytes"] == file.stat().st_size
    assert entry["rows"] > 0 and len(entry["sha256"]) == 64 and entry["config_id"] and entry["code_version"]
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    assert "SHA-256" in partition_error(file)
    # the fits and every stage that reads them
    assert stale_layers(lens, MODEL, [0, 1]) == {0: ["local_fits", "residuals", "geometry", "controls", "functional_metrics"]}
    listed = catalog.query(lens.root, "SELECT table_name, layer, reason FROM damaged_partitions").to_dicts()
    assert [(r["table_name"], r["layer"]) for r in listed] == [("local_fits", 0)]
    (Path(partition_file(lens.root, "geometry", MODEL, 1)).parent / MANIFEST).unlink()
    assert "not listed in a manifest" in partition_error(partition_file(lens.root, "geometry", MODEL, 1))
    assert catalog.query(lens.root, "SELECT count(DISTINCT layer) AS n FROM geometry")["n"][0] == 1


def test_the_reports_provenance_gives_the_models_depth_and_the_configuration_just_run(
        stored: tuple[UpdateLensResource, dg.DagsterInstance]) -> None:
    """Layers 0 and 1 of a 3-layer model: "2 of 3", not "2 of 2". Layer 1 rerun with k = 6: the report of
    that deployment shows k = 6 (its configuration has fewer layers than the first one) and names the other."""
    lens, instance = stored
    first = build_model_report(lens.root, MODEL)
    assert "<td>2 of 3</td>" in first.index.read_text(), "the provenance row counts the model's layers"
    other = UpdateLensResource(data_root=lens.data_root, registry=lens.registry,
                               analysis=AnalysisSettings(**{**SETTINGS, "k": 6}))
    assert materialize_model(MODEL, other, instance, layers=[1], log_level="WARNING").success
    rerun = build_model_report(lens.root, MODEL, other.config().config_id)
    assert rerun.config_id == other.config().config_id != first.config_id
    assert any(f"{first.config_id} (1 layers)" in n and "(1 layers) only" in n for n in rerun.notes), rerun.notes
    assert build_model_report(lens.root, MODEL, "no-such-config").config_id in (first.config_id, rerun.config_id)


def test_the_study_record_reads_every_runs_step_times_from_its_dagster_home(zoo: Path, tmp_path: Path) -> None:
    """`python -m bench --only study` records each Dagster run's step times from the run's own home."""
    import json

    from bench.driver import study_record

    home = tmp_path / "home"
    home.mkdir()
    lens = UpdateLensResource(data_root=str(tmp_path / "data"), registry=str(zoo), analysis=AnalysisSettings(**SETTINGS))
    with dg.DagsterInstance.local_temp(str(home)) as instance:
        assert materialize_model(MODEL, lens, instance, layers=[0], log_level="WARNING").success
        assert materialize_model(MODEL, lens, instance, layers=[2], log_level="WARNING").success
    summary = {"pipeline_s": 30.0, "peak_rss_gib": 1.5, "layers": [0, 2], "model": MODEL, "config_id": "x"}
    table = study_record(home, summary, 96, "cpu", tmp_path / "bench", registry=zoo)
    assert "study_wall_s" in table and "study_functional_s" in table
    steps = json.loads((tmp_path / "bench" / "study.json").read_text())["steps"]
    stages = ["activations", "local_fits", "residuals", "geometry", "controls", "functional_metrics"]
    for key in (f"{MODEL}:00", f"{MODEL}:02"):
        assert sorted(s["step"] for s in steps if s["partitions"] == key) == sorted(stages)
    assert all(s["seconds"] > 0 for s in steps)
    records = {r["name"]: r for r in json.loads((tmp_path / "bench" / "bench_study.json").read_text())}
    functional = sum(s["seconds"] for s in steps if s["step"] == "functional_metrics")
    assert records["study_functional_s"]["value"] == pytest.approx(functional)
    # the forward passes' floor, measured in the same call, plus the stages without forward passes
    others = sum(s["seconds"] for s in steps if s["step"] not in ("activations", "functional_metrics"))
    assert records["study_forward_at_gemm_rate_s"]["value"] == pytest.approx(
        records["study_forward_floor_s"]["value"] + others)


def test_a_change_to_one_stages_code_reruns_that_stage_alone(
        stored: tuple[UpdateLensResource, dg.DagsterInstance], monkeypatch: pytest.MonkeyPatch) -> None:
    """The geometry code changed (its version and the controls', which the same code measures): the run
    recomputes geometry and controls of both layers in one run of those two stages, rewrites nothing
    upstream or beside them, and the new rows record the new versions."""
    import updatelens.orchestration.runner as runner
    import updatelens.versions as versions
    from updatelens.orchestration.runner import run_groups
    from updatelens.stages import STAGES

    lens, instance = stored
    def manifests() -> dict[tuple[str, str, int], dict]:
        return {(s.name, t, layer): read_manifest(partition_file(lens.root, t, MODEL, layer))
                for s in STAGES for t in s.tables for layer in (0, 1)}

    before = manifests()
    old = versions.stage_versions()
    new = {**old, "geometry": old["geometry"] + "-changed", "controls": old["controls"] + "-changed"}
    monkeypatch.setattr(versions, "stage_versions", lambda: new)
    monkeypatch.setattr(runner, "stage_versions", lambda: new)
    plan = stale_layers(lens, MODEL, [0, 1])
    assert plan == {0: ["geometry", "controls"], 1: ["geometry", "controls"]}
    assert run_groups(plan) == [(["geometry", "controls"], [0, 1])]
    result = materialize_model(MODEL, lens, instance, layers=[0, 1], log_level="WARNING", stages=["geometry", "controls"])
    assert result.success
    ran = {event.asset_key.path[-1] for event in result.get_asset_materialization_events()}
    assert ran == {"geometry", "controls"}
    assert {e.asset_check_key.name for e in result.get_asset_check_evaluations()} >= {"geometry_ranges", "controls_valid"}
    assert stale_layers(lens, MODEL, [0, 1]) == {}
    for (stage, table, layer), entry in manifests().items():
        if stage in ("geometry", "controls"):
            assert entry["rows"] and entry["code_version"] == new[stage], (table, layer)
        else:
            assert entry == before[(stage, table, layer)], f"{table} of layer {layer} was rewritten"


def test_a_report_on_a_layer_of_two_configurations_names_it_and_does_not_crash(
        stored: tuple[UpdateLensResource, dg.DagsterInstance]) -> None:
    """A layer whose tables come from two configurations (what a run stopped between its stages left
    before runs staged their partitions, and what a partial copy leaves): the report builds and says so."""
    import pyarrow as pa

    from updatelens.storage.layout import read_file, write_partition

    lens, _ = stored
    table = read_file(partition_file(lens.root, "geometry", MODEL, 1))
    other = table.set_column(table.schema.get_field_index("config_id"), "config_id",
                             pa.array(["0123456789ab"] * len(table)))
    write_partition(lens.root, "geometry", MODEL, 1, other)
    notes = build_model_report(lens.root, MODEL).notes
    assert any(n.startswith("Layer 1: its tables come from different runs") and "0123456789ab (1 tables)" in n
               for n in notes), notes


def test_a_run_that_fails_in_its_last_stage_leaves_every_stored_partition_as_it_was(
        stored: tuple[UpdateLensResource, dg.DagsterInstance], monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage, then swap: a run with other settings fails in its last stage, after its earlier stages
    wrote their tables; every stored file and view is as before (no layer left mixed), the run's staging
    folder is removed by the next clean once the run is over, and the next run recomputes both layers."""
    import hashlib

    import updatelens.assets.functional_metrics as functional
    from updatelens.assets.common import run_going
    from updatelens.stages import STAGE_NAMES
    from updatelens.storage.layout import STAGING
    from updatelens.storage.staging import RUN_PREFIX
    from updatelens.storage.store import Store

    lens, instance = stored
    root = Path(lens.data_root)

    def files() -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.glob("*/model=*/layer=*/*")) if STAGING not in p.parts}

    before = files()
    summary = catalog.query(lens.root, "SELECT * FROM layer_summary ORDER BY layer, fn_class")

    def planted(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted failure in the patched passes")

    monkeypatch.setattr(functional, "stream_functional", planted)
    other = UpdateLensResource(data_root=lens.data_root, registry=lens.registry,
                               analysis=AnalysisSettings(**{**SETTINGS, "seed": 7}))
    result = materialize_model(MODEL, other, instance, layers=[0, 1], log_level="WARNING", raise_on_error=False)
    assert not result.success
    ran = {event.asset_key.path[-1] for event in result.get_asset_materialization_events()}
    assert ran == set(STAGE_NAMES) - {"functional_metrics"}  # the earlier stages wrote, into the run's folder
    assert files() == before
    assert catalog.query(lens.root, "SELECT * FROM layer_summary ORDER BY layer, fn_class").equals(summary)
    staged = list((root / STAGING).glob(f"{RUN_PREFIX}*"))
    assert [p.name for p in staged] == [f"{RUN_PREFIX}{result.run_id}"]
    assert Store.open(root).clean_abandoned_staging(run_going(instance)) == [staged[0].name]
    assert stale_layers(other, MODEL, [0, 1]) == {0: list(STAGE_NAMES), 1: list(STAGE_NAMES)}
    assert stale_layers(lens, MODEL, [0, 1]) == {}
