"""Headless materialization of a model's partitions: what `updatelens run` and the tests call."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from updatelens.assets.partitions import MODEL_LAYER_KEY, MODELS_KEY, model_keys, parse_key, range_tags
from updatelens.assets.pipeline import ASSETS
from updatelens.assets.reports import comparison_report, report
from updatelens.assets.resources import UpdateLensResource
from updatelens.assets.sweep import convention_sweep
from updatelens.errors import ConfigError
from updatelens.orchestration.registry_watch import stale_plan
from updatelens.preflight import Preflight, preflight
from updatelens.registry import get_corpus, get_model
from updatelens.stages import STAGE_NAMES
from updatelens.storage.layout import DAGSTER_DIR
from updatelens.storage.location import default_data_root, is_url
from updatelens.versions import stage_versions


def dagster_yaml(model_pool_limit: int | None = None) -> str:
    """Instance config: telemetry and the welcome pop-up off; the `model` pool (capture and patched
    forwards) limited so two runs never hold two models at once ($UPDATELENS_MODEL_POOL_LIMIT)."""
    limit = model_pool_limit or int(os.environ.get("UPDATELENS_MODEL_POOL_LIMIT", "1"))
    return (f"telemetry:\n  enabled: false\nnux:\n  enabled: false\n"
            f"concurrency:\n  pools:\n    default_limit: {limit}\n")


DAGSTER_YAML = dagster_yaml(1)


def root_dagster_home(data_root: str | Path) -> Path:
    """Where the Dagster instance of a data root lives: `<root>/_dagster` for a local root, so the runs,
    materializations and check results of a root stay with that root (a UI on one root never shows
    another's); for an object-store root, `.dagster_home/<the root's url as a name>` in the working
    directory."""
    text = str(data_root)
    if is_url(text):
        return Path.cwd() / ".dagster_home" / re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")
    return Path(text).resolve() / DAGSTER_DIR


def project_dagster_home(data_root: str | Path | None = None) -> Path:
    """DAGSTER_HOME if set (one instance the user chose for everything), else the data root's own
    (`root_dagster_home`; default root: $UPDATELENS_DATA or ./data). Telemetry and nux off."""
    explicit = os.environ.get("DAGSTER_HOME")
    return prepared_home(Path(explicit) if explicit else root_dagster_home(data_root or default_data_root()))


@contextmanager
def root_instance(data_root: str | Path) -> Iterator[dg.DagsterInstance]:
    """The Dagster instance of a data root (`root_dagster_home`), whatever DAGSTER_HOME says: for runs
    into a root other than the one a command serves (the sizes of `converge`), so their history never
    mixes with the main root's."""
    with dg.DagsterInstance.from_config(str(prepared_home(root_dagster_home(data_root)))) as instance:
        yield instance


def prepared_home(home: Path) -> Path:
    """`home` created, with its dagster.yaml (telemetry and nux off) if it has none."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text(dagster_yaml())
    return home


def register_model(instance: dg.DagsterInstance, model: str, n_layers: int) -> list[str]:
    """Add the model's (model, layer) keys so they are contiguous in the partition order.

    Launching a key range runs exactly those keys; if an earlier registration left the model's
    keys scattered (or of another depth), they are removed and added again at the end.
    """
    wanted = model_keys(model, n_layers)
    existing = list(instance.get_dynamic_partitions(MODEL_LAYER_KEY))
    mine = [k for k in existing if parse_key(k)[0] == model]
    if mine == wanted and existing[existing.index(wanted[0]) : existing.index(wanted[0]) + n_layers] == wanted:
        return wanted
    for key in mine:
        instance.delete_dynamic_partition(MODEL_LAYER_KEY, key)
    instance.add_dynamic_partitions(MODEL_LAYER_KEY, wanted)
    return wanted


def register_model_key(instance: dg.DagsterInstance, model: str) -> None:
    """The model's key of the per-model assets (report, convention sweep)."""
    if not instance.has_dynamic_partition(MODELS_KEY, model):
        instance.add_dynamic_partitions(MODELS_KEY, [model])


def contiguous_ranges(layers: Sequence[int]) -> list[list[int]]:
    """[0, 1, 2, 5, 6] -> [[0, 1, 2], [5, 6]]: each range is one single-run backfill."""
    ranges: list[list[int]] = []
    for layer in sorted(set(layers)):
        if ranges and layer == ranges[-1][-1] + 1:
            ranges[-1].append(layer)
        else:
            ranges.append([layer])
    return ranges


def stale_layers(lens: UpdateLensResource, model: str, layers: Sequence[int], force: bool = False,
                 revision: str | None = None) -> dict[int, list[str]]:
    """{layer: the stages to recompute} for the requested layers whose results are missing, damaged or
    from another configuration or code version of a stage, or (with `revision`) from other weights (and
    the stages that read them), in order; with `force`, every stage of every requested layer."""
    if force:
        return {layer: list(STAGE_NAMES) for layer in layers}
    plan = stale_plan(lens.root, model, list(layers), lens.config().config_id, stage_versions(), revision)
    return {layer: plan[layer] for layer in layers if layer in plan}


def run_groups(todo: dict[int, list[str]]) -> list[tuple[list[str], list[int]]]:
    """The runs that recompute `todo`: (stages, a contiguous range of layers) with the same stages to
    recompute, the layers of each in order (layers where only geometry is stale get a geometry run)."""
    by_stages: dict[tuple[str, ...], list[int]] = {}
    for layer, stages in sorted(todo.items()):
        by_stages.setdefault(tuple(stages), []).append(layer)
    return [(list(stages), layer_range) for stages, layers in by_stages.items()
            for layer_range in contiguous_ranges(layers)]


def check_inputs(model: str, lens: UpdateLensResource, layers: Sequence[int] | None = None,
                 preset: str | None = None) -> Preflight:
    """Everything that can be checked without loading weights (seconds, not minutes). Without
    `layers`, the disk check counts the preset's layers (or all)."""
    registry = Path(lens.registry)
    return preflight(get_model(model, registry), get_corpus(lens.corpus, registry), lens.config(), lens.root,
                     layers, preset)


# Runs executed in this process carry the process that executes them, so a later command can tell a
# run whose process was killed (it stays STARTED, holding its pool slot) from one still going.
PID_TAG, HOST_TAG = "updatelens/pid", "updatelens/host"
UNFINISHED = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def in_process_tags() -> dict[str, str]:
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def release_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Runs of this instance executed in a process of this host that is gone (a killed `updatelens
    run`): marked failed, and their pool slots freed. Left alone, such a run holds the `model` pool's
    slot for ever and every later run waits on it ("Step blocked by limit for pool model"). A run
    launched elsewhere (the UI's daemon, a worker) is left to Dagster's run monitoring. Returns the
    ids released."""
    released = []
    host = socket.gethostname()
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=UNFINISHED, tags={HOST_TAG: host})):
        run = record.dagster_run
        pid = run.tags.get(PID_TAG, "")
        if not pid.isdigit() or _alive(int(pid)):
            continue
        instance.report_run_failed(run, f"its process (pid {pid} on {host}) is gone: it was killed before the run "
                                        "ended; marked failed and its pool slots freed by the next command")
        if instance.event_log_storage.supports_global_concurrency_limits:
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        released.append(run.run_id)
    return released


def materialize_model(model: str, lens: UpdateLensResource, instance: dg.DagsterInstance,
                      layers: Sequence[int] | None = None,
                      selection: Sequence[dg.AssetsDefinition] | None = None,
                      log_level: str = "DEBUG", raise_on_error: bool = True,
                      report: Preflight | None = None, stages: Sequence[str] | None = None) -> dg.ExecuteInJobResult:
    """One in-process run over a contiguous range of the model's layers (default: all), of every stage
    or of `stages` alone (with their checks; the stages before them are read from the data root)."""
    report = report or check_inputs(model, lens, layers)
    keys = register_model(instance, model, report.n_layers)
    register_model_key(instance, model)
    chosen = list(range(report.n_layers)) if layers is None else sorted(set(layers))
    if len(contiguous_ranges(chosen)) != 1:
        raise ConfigError("layers must be a contiguous range (e.g. 3-7) for a single run")
    release_dead_runs(instance)
    return dg.materialize(
        list(selection or ASSETS),
        instance=instance,
        resources={"lens": lens},
        tags={**range_tags([keys[layer] for layer in chosen]), **in_process_tags()},
        run_config=log_config(log_level),
        raise_on_error=raise_on_error,
        selection=[dg.AssetKey(stage) for stage in stages] if stages else None,
    )


def log_config(log_level: str) -> dict[str, object]:
    """Run config for the console logger's level."""
    return {"loggers": {"console": {"config": {"log_level": log_level}}}}


def lens_run_config(lens: UpdateLensResource, log_level: str = "INFO") -> dict[str, object]:
    """The resource as run config: a run executed elsewhere rebuilds it from the stored run."""
    return {"resources": {"lens": {"config": lens.model_dump()}}, **log_config(log_level)}


def check_verdicts(result: dg.ExecutionResult) -> list[tuple[str, bool, str]]:
    """(asset.check, passed, description) of every check a run evaluated, over the run's partitions
    (each partition's own evaluation is in the event log and the UI)."""
    return [(f"{e.asset_key.to_user_string()}.{e.check_name}", e.passed, e.description or "")
            for e in result.get_asset_check_evaluations() if e.partition is None]


def failure_message(result: dg.ExecutionResult) -> str:
    """The first failed step's error message."""
    failures = [e for e in result.all_events if e.is_step_failure]
    if not failures:
        return "see the log above"
    error = failures[0].step_failure_data.error
    while error.cause is not None:  # Dagster wraps the user's exception: name the cause
        error = error.cause
    return error.message.strip()


def materialize_reports(models: Sequence[str], lens: UpdateLensResource, instance: dg.DagsterInstance,
                        comparison: bool = True, raise_on_error: bool = True) -> list[dg.ExecuteInJobResult]:
    """Each model's report (from stored results), then the comparison across all models."""
    results = []
    release_dead_runs(instance)
    for model in models:
        register_model_key(instance, model)
        results.append(dg.materialize([report], instance=instance, resources={"lens": lens}, tags=in_process_tags(),
                                      partition_key=model, raise_on_error=raise_on_error))
    if comparison:
        results.append(dg.materialize([comparison_report], instance=instance, resources={"lens": lens},
                                      tags=in_process_tags(), raise_on_error=raise_on_error))
    return results


def materialize_sweep(model: str, lens: UpdateLensResource, instance: dg.DagsterInstance,
                      sweep_config: dict[str, object] | None = None, raise_on_error: bool = True) -> dg.ExecuteInJobResult:
    """The model's convention sweep (loads the model once, analyses every configuration)."""
    register_model_key(instance, model)
    release_dead_runs(instance)
    return dg.materialize([convention_sweep], instance=instance, resources={"lens": lens}, partition_key=model,
                          tags=in_process_tags(),
                          run_config={"ops": {"convention_sweep": {"config": sweep_config or {}}}},
                          raise_on_error=raise_on_error)
