"""Sensors: the model registry (partitions of new models, runs for changed sources), the stage
assets' declarative automation, and the reports after an analysis."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from updatelens.assets.partitions import (
    MODEL_LAYER,
    MODEL_LAYER_KEY,
    MODELS,
    MODELS_KEY,
    model_keys,
    parse_key,
    range_tags,
    tagged_key_span,
)
from updatelens.assets.resources import UpdateLensResource
from updatelens.errors import UpdateLensError
from updatelens.models import read_shape
from updatelens.orchestration.deployments import active_profile
from updatelens.orchestration.jobs import analyse_job, comparison_job, report_job
from updatelens.orchestration.registry_watch import fingerprint, registry_changes, stale_plan
from updatelens.preflight import estimate_bytes
from updatelens.stages import STAGE_NAMES
from updatelens.versions import stage_versions

INTERVAL_ENV = "UPDATELENS_SENSOR_INTERVAL_S"


def sensor_interval() -> int:
    """Seconds between evaluations of stage automation and of the reports sensor: 30, or the
    deployment's UPDATELENS_SENSOR_INTERVAL_S (a positive whole number)."""
    text = os.environ.get(INTERVAL_ENV, "30")
    if not text.isdigit() or int(text) < 1:
        raise UpdateLensError(f"{INTERVAL_ENV}={text!r}: must be a positive whole number of seconds")
    return int(text)


def stale_run_requests(lens: UpdateLensResource, model: str, n_layers: int, run_key: str) -> list[dg.RunRequest]:
    """Runs for the model's stale partitions: one range run if every stage of every layer is stale
    (the model is loaded and captured once), else one run per stale key of its stale stages (and
    those that read them); none if everything is up to date. Under a cluster profile (celery, k8s)
    always one run per key: independent tasks for the workers."""
    keys = model_keys(model, n_layers)
    plan = stale_plan(lens.root, model, list(range(n_layers)), lens.config().config_id, stage_versions())
    everything = len(plan) == n_layers and all(len(stages) == len(STAGE_NAMES) for stages in plan.values())
    if everything and not active_profile().per_layer_runs:
        return [dg.RunRequest(run_key=f"{model}@{run_key}", tags=range_tags(keys))]
    return [dg.RunRequest(run_key=f"{keys[layer]}@{run_key}", partition_key=keys[layer],
                          asset_selection=None if len(stages) == len(STAGE_NAMES) else [dg.AssetKey(s) for s in stages])
            for layer, stages in sorted(plan.items())]


def found_on_disk(lens: UpdateLensResource, model: str, n_layers: int) -> list[dg.AssetMaterialization]:
    """The stages of the model's partitions already up to date in the data root (every table verifies
    against its manifest, made by this configuration and this code version of the stage), as
    materializations: declarative automation then runs only what is missing (a new instance over an
    existing data root recomputes nothing)."""
    plan = stale_plan(lens.root, model, list(range(n_layers)), lens.config().config_id, stage_versions())
    return [dg.AssetMaterialization(stage, partition=key, description="found up to date in the data root",
                                    metadata={"data_root": lens.data_root})
            for layer, key in enumerate(model_keys(model, n_layers)) for stage in STAGE_NAMES
            if stage not in plan.get(layer, [])]


def cost_estimate(lens: UpdateLensResource, model: str, n_partitions: int, width: int) -> str:
    """What analysing n partitions of the model would write, in words (tokens and bytes on disk)."""
    cfg = lens.config()
    size = estimate_bytes(cfg, n_partitions, width) / 2**30
    return (f"{n_partitions} layer(s) x {cfg.n_seq * cfg.seq_len:,} tokens, about {size:.2f} GiB on disk "
            f"(settings {cfg.config_id})")


@dg.sensor(job=analyse_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Watches the model registry file. Every model gets its (model, layer) partitions from its "
                       "real depth; partitions already up to date on disk are reported, not rerun. A model added to "
                       "the registry while the deployment runs is launched (its estimate logged); on the first "
                       "evaluation (opening the UI on a root) a model never analysed there is shown as missing, with "
                       "its estimate, and waits to be launched, unless its registry entry says auto_run = true. A "
                       "model whose source changed gets runs for its stale partitions. A removed model is not rerun, "
                       "nor, on the first evaluation, a model the instance already knows. The cursor records what "
                       "was handled, so a daemon restart requests nothing twice.")
def model_registry_sensor(context: dg.SensorEvaluationContext, lens: UpdateLensResource) -> dg.SensorResult:
    changes = registry_changes(Path(lens.registry), context.cursor)
    existing = set(context.instance.get_dynamic_partitions(MODEL_LAYER_KEY))
    existing_models = set(context.instance.get_dynamic_partitions(MODELS_KEY))
    first = context.cursor is None
    partition_requests, run_requests, events, skipped, waiting = [], [], [], [], []
    for entry in changes.added:
        try:
            depth, width = read_shape(entry)
        except (UpdateLensError, OSError, ValueError) as exc:
            skipped.append(f"{entry.slug}: {exc}")
            continue
        keys = model_keys(entry.slug, depth)
        new = [k for k in keys if k not in existing]
        if new:
            partition_requests.append(MODEL_LAYER.build_add_request(new))
        if entry.slug not in existing_models:
            partition_requests.append(MODELS.build_add_request([entry.slug]))
        if len(new) == len(keys):  # new to this instance: what the data root holds up to date is reported
            events += found_on_disk(lens, entry.slug, depth)
        elif first:  # known to the instance before the sensor's first evaluation
            # (e.g. `updatelens run`): no earlier source to differ from, and its partitions may hold
            # another configuration than this deployment's on purpose: nothing is rerun
            context.log.info(f"model {entry.slug!r} is already known to this instance; its partitions stay as "
                             f"they are (later changes to its source rerun what they make stale)")
            continue
        requests = stale_run_requests(lens, entry.slug, depth, fingerprint(entry))
        if not requests:
            continue
        n_stale = sum(len(model_keys_of(r)) for r in requests)
        estimate = cost_estimate(lens, entry.slug, n_stale, width)
        if first and not entry.auto_run:
            waiting.append(entry.slug)
            context.log.info(f"model {entry.slug!r}: {estimate} not analysed in this root; not launched on opening "
                             f"(launch it from the asset graph, with `updatelens run --model {entry.slug}`, or set "
                             f"auto_run = true in its registry entry)")
            continue
        context.log.info(f"model {entry.slug!r}: launching {estimate}")
        run_requests.extend(requests)
    for slug in changes.removed:
        context.log.info(f"model {slug!r} left the registry: it is not rerun; its results stay queryable")
    for line in skipped:
        context.log.warning(f"cannot add model {line}")
    reasons = ([f"waiting to be launched: {', '.join(waiting)}"] if waiting else []) + (
        [f"skipped: {'; '.join(skipped)}"] if skipped else [])
    return dg.SensorResult(
        run_requests=run_requests,
        dynamic_partitions_requests=partition_requests,
        asset_events=events,
        cursor=changes.cursor,
        skip_reason=None if run_requests or partition_requests else
        "no registry change needs partitions or runs" + (f" ({'; '.join(reasons)})" if reasons else ""),
    )


def model_keys_of(request: dg.RunRequest) -> list[str]:
    """The partition keys a run request covers (one key, or a key range's)."""
    if request.partition_key:
        return [request.partition_key]
    span = tagged_key_span(request.tags)
    if span is None:
        return []
    model, first = parse_key(span[0])
    return model_keys(model, parse_key(span[1])[1] + 1)[first:]


# Evaluates the stage assets' automation conditions (on by default, unlike Dagster's default
# automation sensor): new partitions run as one backfill, so a model's layers share one run.
stage_automation_sensor = dg.AutomationConditionSensorDefinition(
    "stage_automation", target=dg.AssetSelection.assets(*STAGE_NAMES), default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=sensor_interval(),
    description="Declarative automation of the stages: each follows its upstream's updates. Missing partitions are "
                "launched by the registry sensor or by someone, never by this sensor.")


def models_of_run(tags: dict[str, str]) -> list[str]:
    """The models a run over (model, layer) partitions covered, from its partition tags (a key or a key
    range); none for a run of other partitions (a report's, keyed by model)."""
    span = tagged_key_span(tags)
    if not span:
        return []
    try:
        return sorted({parse_key(key)[0] for key in span})
    except ValueError:
        return []


def analysed_stages(run: dg.DagsterRun) -> bool:
    """Whether the run may have materialized a stage asset: the `analyse` job, a stage job, the UI's
    Materialize button, automation, a backfill or an in-process `materialize` (an asset selection that
    names a stage, or none: a job's selection left None, or empty as `dg.materialize` leaves it, means
    all of its assets). Which models it covered comes from its (model, layer) partition tags
    (`models_of_run`), so a job without them (calibrate) requests nothing."""
    if run.job_name in (report_job.name, comparison_job.name):
        return False
    selection = run.asset_selection
    if not selection:
        return True
    return any(key.to_user_string() in STAGE_NAMES for key in selection)


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, request_jobs=[report_job, comparison_job],
                      minimum_interval_seconds=sensor_interval(), default_status=dg.DefaultSensorStatus.RUNNING,
                      description="After any run that materialized a stage succeeds (the analyse job, a stage job, "
                                  "the UI's Materialize button, automation, a backfill): rebuild the reports of the "
                                  "models it covered, then the comparison across models (from stored results, no "
                                  "recomputation).")
def reports_after_analysis(context: dg.RunStatusSensorContext) -> list[dg.RunRequest]:
    run = context.dagster_run
    if not analysed_stages(run):
        return []
    models = models_of_run(dict(run.tags))
    if not models:
        return []
    existing = set(context.instance.get_dynamic_partitions(MODELS_KEY))
    new = [m for m in models if m not in existing]
    if new:
        context.instance.add_dynamic_partitions(MODELS_KEY, new)
    requests = [dg.RunRequest(run_key=f"report:{m}:{run.run_id}", job_name=report_job.name, partition_key=m)
                for m in models]
    return [*requests, dg.RunRequest(run_key=f"comparison:{run.run_id}", job_name=comparison_job.name)]
