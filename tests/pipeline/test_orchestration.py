"""The registry sensor, the stale-partition schedule, the named jobs and the model pool."""

from __future__ import annotations

import datetime
import shutil
import tomllib
from pathlib import Path

import dagster as dg
import pytest

from updatelens.assets.partitions import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    MODEL_LAYER_KEY,
    model_keys,
    range_tags,
)
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.orchestration.definitions import ASSETS
from updatelens.orchestration.definitions import defs as load_defs
from updatelens.orchestration.runner import dagster_yaml, materialize_model
from updatelens.orchestration.schedules import stale_partitions_schedule
from updatelens.orchestration.sensors import model_registry_sensor, reports_after_analysis
from updatelens.stages import STAGE_NAMES
from updatelens.storage.layout import delete_partition

defs = load_defs()  # the code location, as Dagster's tools load it

SETTINGS = dict(n_seq=6, seq_len=16, k=8, rank=2)


def write_registry(path: Path, zoo: Path, models: list[str]) -> Path:
    entries = tomllib.loads(zoo.read_text())["models"]
    lines = [f'[models.{m}]\nsource = "local"\npath = "{entries[m]["path"]}"\n' for m in models]
    lines.append('[corpora.wiki-embedded]\nsource = "embedded"\n')
    path.write_text("\n".join(lines))
    return path


def tick(instance: dg.DagsterInstance, lens: UpdateLensResource, cursor: str | None) -> dg.SensorResult:
    # closed by `with`, as Dagster documents: the context releases what it opened (resources)
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources={"lens": lens}) as context:
        result = model_registry_sensor(context)
    for request in result.dynamic_partitions_requests or []:  # what the daemon does with them
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


@pytest.fixture
def lens(zoo: Path, tmp_path: Path) -> UpdateLensResource:
    registry = write_registry(tmp_path / "registry.toml", zoo, ["tiny-gpt2"])
    return UpdateLensResource(data_root=str(tmp_path / "data"), registry=str(registry),
                              analysis=AnalysisSettings(**SETTINGS))


def automation(instance: dg.DagsterInstance, cursor: object = None) -> tuple[dict[str, list[str]], object]:
    """One tick of the stage assets' declarative automation: {asset: requested partition keys}."""
    result = dg.evaluate_automation_conditions(defs, instance, cursor=cursor)
    requested = {stage: sorted(result.get_requested_partitions(dg.AssetKey(stage))) for stage in STAGES}
    return {stage: keys for stage, keys in requested.items() if keys}, result.cursor


STAGES = list(STAGE_NAMES)


def test_opening_a_root_launches_nothing_and_a_model_added_later_is_launched(zoo: Path,
                                                                           lens: UpdateLensResource) -> None:
    """Nothing heavy starts because a deployment opened: a registry model never analysed in the root is
    shown as missing (its partitions exist) and waits; a model added while the deployment runs is launched."""
    instance = dg.DagsterInstance.ephemeral()
    requested, cursor = automation(instance)  # the automation sensor runs before any model is known
    assert requested == {}
    first = tick(instance, lens, None)
    assert not first.run_requests  # never analysed here: shown as missing, not launched
    assert instance.get_dynamic_partitions(MODEL_LAYER_KEY) == model_keys("tiny-gpt2", 3)
    assert instance.get_dynamic_partitions("models") == ["tiny-gpt2"]  # the report's and sweep's key
    for _ in range(2):  # nor by declarative automation, on this tick or the next
        requested, cursor = automation(instance, cursor)
        assert requested == {}

    again = tick(instance, lens, first.cursor)  # no change: nothing (daemon restart too)
    assert not again.run_requests and not again.dynamic_partitions_requests and again.cursor == first.cursor

    write_registry(Path(lens.registry), zoo, ["tiny-gpt2", "tiny-mamba"])
    added = tick(instance, lens, again.cursor)  # added while the deployment runs: launched, as one range run
    assert [(r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]) for r in added.run_requests] \
        == [("tiny-mamba:00", "tiny-mamba:02")]
    assert automation(instance, cursor)[0] == {}

    write_registry(Path(lens.registry), zoo, ["tiny-mamba"])
    removed = tick(instance, lens, added.cursor)
    assert not removed.run_requests
    assert "tiny-gpt2" not in removed.cursor


def test_a_model_whose_entry_says_auto_run_runs_when_the_deployment_opens(zoo: Path, lens: UpdateLensResource) -> None:
    path = tomllib.loads(Path(lens.registry).read_text())["models"]["tiny-gpt2"]["path"]
    Path(lens.registry).write_text(f'[models.tiny-gpt2]\nsource = "local"\npath = "{path}"\nauto_run = true\n'
                                   '[corpora.wiki-embedded]\nsource = "embedded"\n')
    instance = dg.DagsterInstance.ephemeral()
    first = tick(instance, lens, None)
    assert [r.tags[ASSET_PARTITION_RANGE_START_TAG] for r in first.run_requests] == ["tiny-gpt2:00"]


def test_a_changed_source_reruns_its_stale_partitions_one_run_per_layer_under_a_cluster_profile(
        zoo: Path, lens: UpdateLensResource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    instance = dg.DagsterInstance.ephemeral()
    first = tick(instance, lens, None)
    moved = tmp_path / "moved-gpt2"
    shutil.copytree(tomllib.loads(Path(lens.registry).read_text())["models"]["tiny-gpt2"]["path"], moved)
    Path(lens.registry).write_text(f'[models.tiny-gpt2]\nsource = "local"\npath = "{moved}"\n'
                                   '[corpora.wiki-embedded]\nsource = "embedded"\n')
    monkeypatch.setenv("UPDATELENS_PROFILE", "celery")
    changed = tick(instance, lens, first.cursor)
    assert [r.partition_key for r in changed.run_requests] == model_keys("tiny-gpt2", 3)
    monkeypatch.setenv("UPDATELENS_PROFILE", "local")
    assert [r.tags[ASSET_PARTITION_RANGE_START_TAG] for r in tick(instance, lens, first.cursor).run_requests] == [
        "tiny-gpt2:00"]


def test_results_already_on_disk_are_reported_not_rerun(lens: UpdateLensResource) -> None:
    instance = dg.DagsterInstance.ephemeral()
    run = materialize_model("tiny-gpt2", lens, instance)
    assert run.success
    assert not tick(instance, lens, None).run_requests  # partitions known and up to date: nothing

    other = UpdateLensResource(data_root=lens.data_root, registry=lens.registry,
                               analysis=AnalysisSettings(**{**SETTINGS, "k": 6}))
    assert not tick(instance, other, None).run_requests  # a deployment with other settings reruns nothing

    fresh = dg.DagsterInstance.ephemeral()  # a new Dagster instance over the same data root
    result = tick(fresh, lens, None)
    assert not result.run_requests
    assert sorted((e.asset_key.to_user_string(), e.partition) for e in result.asset_events) == sorted(
        (stage, key) for stage in STAGES for key in model_keys("tiny-gpt2", 3))
    for event in result.asset_events:  # what the daemon does with them
        fresh.report_runless_asset_event(event)
    assert automation(fresh)[0] == {}

    # after a successful analysis, the model's report and the comparison are requested
    context = dg.build_run_status_sensor_context(sensor_name="reports_after_analysis", dagster_instance=instance,
                                                 dagster_run=run.dagster_run,
                                                 dagster_event=run.get_run_success_event())
    requests = reports_after_analysis(context)
    assert [(r.job_name, r.partition_key) for r in requests] == [("build_report", "tiny-gpt2"),
                                                                 ("build_comparison", None)]
    assert "tiny-gpt2" in instance.get_dynamic_partitions("models")


def test_schedule_requests_only_stale_partitions(zoo: Path, lens: UpdateLensResource) -> None:
    with dg.instance_for_test() as instance:
        check_schedule(zoo, lens, instance)


def check_schedule(zoo: Path, lens: UpdateLensResource, instance: dg.DagsterInstance) -> None:
    assert materialize_model("tiny-gpt2", lens, instance).success
    write_registry(Path(lens.registry), zoo, ["tiny-gpt2", "tiny-llama"])
    instance.add_dynamic_partitions(MODEL_LAYER_KEY, model_keys("tiny-llama", 3))

    def run_schedule(resource: UpdateLensResource) -> list[dg.RunRequest] | dg.SkipReason:
        with dg.build_schedule_context(instance=instance, resources={"lens": resource},  # closed, as `tick`
                                       scheduled_execution_time=datetime.datetime(2026, 11, 29, 3, 0)) as ctx:
            out = stale_partitions_schedule(ctx)
            return out if isinstance(out, dg.SkipReason) else list(out)

    requests = run_schedule(lens)  # tiny-llama never ran: one range run; tiny-gpt2 is fresh
    assert [r.tags.get(ASSET_PARTITION_RANGE_START_TAG) for r in requests] == ["tiny-llama:00"]

    delete_partition(lens.root, "functional_summary", "tiny-gpt2", 1)
    requests = run_schedule(lens)
    assert sorted(r.partition_key or r.tags[ASSET_PARTITION_RANGE_START_TAG] for r in requests) == [
        "tiny-gpt2:01", "tiny-llama:00"]

    changed = UpdateLensResource(data_root=lens.data_root, registry=lens.registry,
                                 analysis=AnalysisSettings(**{**SETTINGS, "k": 5}))
    requests = run_schedule(changed)  # another configuration: everything is stale
    assert sorted(r.tags[ASSET_PARTITION_RANGE_START_TAG] for r in requests) == ["tiny-gpt2:00", "tiny-llama:00"]

    write_registry(Path(lens.registry), zoo, ["tiny-gpt2"])  # removed from the registry: left alone
    delete_partition(lens.root, "functional_summary", "tiny-gpt2", 1)
    assert materialize_model("tiny-gpt2", lens, instance, layers=[1]).success
    assert isinstance(run_schedule(lens), dg.SkipReason)


def test_named_jobs_and_model_pool() -> None:
    names = {job.name for job in defs.jobs}
    assert {"analyse", "stage_activations", "stage_local_fits", "stage_residuals", "stage_geometry",
            "stage_functional_metrics"} <= names
    pooled = {a.key.to_user_string() for a in ASSETS if a.op.pool == "model"}
    assert pooled == {"activations", "functional_metrics"}  # the steps that hold a model
    assert "default_limit: 2" in dagster_yaml(2)
    with dg.instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1


def test_each_data_root_has_its_own_dagster_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DAGSTER_HOME, a root's runs and materializations live under the root (`_dagster`), so a
    UI on one root never shows another's; an object-store root gets a home named after its url."""
    from updatelens.orchestration.runner import project_dagster_home

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    a, b = project_dagster_home(tmp_path / "a"), project_dagster_home(tmp_path / "b")
    assert a == (tmp_path / "a" / "_dagster").resolve() and b == (tmp_path / "b" / "_dagster").resolve()
    assert "enabled: false" in (a / "dagster.yaml").read_text()  # telemetry and nux off
    monkeypatch.chdir(tmp_path)
    assert project_dagster_home("s3://bucket/lens") == tmp_path / ".dagster_home" / "s3_bucket_lens"
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "mine"))  # the user's choice wins
    assert project_dagster_home(tmp_path / "a") == tmp_path / "mine"


def test_the_run_tags_the_product_writes_are_dagsters_own() -> None:
    """The partition tags are spelled out in the product (Dagster's public API does not export them);
    they must stay the values Dagster reads."""
    from dagster._core.storage import tags

    from updatelens.assets import partitions

    assert partitions.PARTITION_NAME_TAG == tags.PARTITION_NAME_TAG
    assert partitions.ASSET_PARTITION_RANGE_START_TAG == tags.ASSET_PARTITION_RANGE_START_TAG
    assert partitions.ASSET_PARTITION_RANGE_END_TAG == tags.ASSET_PARTITION_RANGE_END_TAG


def test_reports_follow_every_kind_of_run_that_materialized_a_stage() -> None:
    """Which successful runs the reports sensor follows, launch path by launch path: the analyse job
    (and a backfill of it), a stage job, the UI's Materialize button and automation (Dagster's implicit
    asset job with a selection naming a stage), an in-process materialize (no selection), over one key
    or a key range; not a report or comparison run, nor a run of stages' neighbours only (calibrate)."""
    from updatelens.orchestration.sensors import analysed_stages, models_of_run

    one = {"dagster/partition": "tiny-gpt2:01"}
    span = range_tags(model_keys("tiny-llama", 3))
    stage = {dg.AssetKey("geometry")}
    runs = {
        "analyse job, a key range": (dg.DagsterRun(job_name="analyse", tags=span), True, ["tiny-llama"]),
        "stage job": (dg.DagsterRun(job_name="stage_geometry", asset_selection=stage, tags=one), True, ["tiny-gpt2"]),
        "Materialize button": (dg.DagsterRun(job_name="__ASSET_JOB", asset_selection=stage, tags=one), True,
                               ["tiny-gpt2"]),
        "automation": (dg.DagsterRun(job_name="__ASSET_JOB", asset_selection={dg.AssetKey("residuals")},
                                     tags={**span, "dagster/from_automation_condition_evaluation": "true"}), True,
                       ["tiny-llama"]),
        "dg.materialize": (dg.DagsterRun(job_name="__ephemeral_asset_job__", asset_selection=set(), tags=one), True,
                           ["tiny-gpt2"]),
        "report": (dg.DagsterRun(job_name="build_report", tags={"dagster/partition": "tiny-gpt2"}), False, []),
        "comparison": (dg.DagsterRun(job_name="build_comparison"), False, []),
        "the report asset from the button": (dg.DagsterRun(job_name="__ASSET_JOB", asset_selection={dg.AssetKey("report")},
                                                           tags={"dagster/partition": "tiny-gpt2"}), False, []),
        "calibrate (no partitions)": (dg.DagsterRun(job_name="calibrate"), True, []),
    }
    for name, (run, analysed, models) in runs.items():
        assert analysed_stages(run) == analysed, name
        assert (models_of_run(dict(run.tags)) if analysed else []) == models, name


def test_a_run_whose_process_was_killed_gives_back_its_pool_slot(tmp_path: Path) -> None:
    """A killed `updatelens run` leaves its run STARTED with its step queued in the `model` pool, and
    every later run waits on it for ever ("Step blocked by limit for pool model", seen in the fault
    drill). The next command marks such a run failed and frees its slot; a run whose process lives
    (this one) and a run launched elsewhere (no process tag: the UI's daemon, a worker) are left alone."""
    import os
    import socket
    import subprocess

    from updatelens.orchestration.runner import HOST_TAG, PID_TAG, release_dead_runs

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(dagster_yaml(1))
    gone = subprocess.Popen(["true"])
    gone.wait()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        storage = instance.event_log_storage
        runs = {}
        for name, tags in (("killed", {PID_TAG: str(gone.pid), HOST_TAG: socket.gethostname()}),
                           ("alive", {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}),
                           ("elsewhere", {})):
            run = instance.add_run(dg.DagsterRun(job_name="analyse", status=dg.DagsterRunStatus.STARTED, tags=tags))
            storage.claim_concurrency_slot("model", run.run_id, f"activations-{name}")
            runs[name] = run.run_id

        def queued() -> set[str]:
            return {step.run_id for step in storage.get_concurrency_info("model").pending_steps}

        assert queued() == set(runs.values())
        assert release_dead_runs(instance) == [runs["killed"]]
        assert queued() == {runs["alive"], runs["elsewhere"]}
        status = {name: instance.get_run_by_id(run_id).status for name, run_id in runs.items()}
        assert status == {"killed": dg.DagsterRunStatus.FAILURE, "alive": dg.DagsterRunStatus.STARTED,
                          "elsewhere": dg.DagsterRunStatus.STARTED}
        assert release_dead_runs(instance) == []


@pytest.mark.parametrize("value, expected", [(None, 30), ("5", 5), ("0", None), ("-3", None), ("1.5", None)])
def test_the_sensors_interval_is_a_positive_whole_number(monkeypatch, value: str | None, expected: int | None) -> None:
    """UPDATELENS_SENSOR_INTERVAL_S sets how often stage automation and the reports sensor evaluate;
    anything but a positive whole number is refused naming the variable."""
    from updatelens.errors import UpdateLensError
    from updatelens.orchestration.sensors import INTERVAL_ENV, sensor_interval

    if value is None:
        monkeypatch.delenv(INTERVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(INTERVAL_ENV, value)
    if expected is None:
        with pytest.raises(UpdateLensError, match=INTERVAL_ENV):
            sensor_interval()
    else:
        assert sensor_interval() == expected
