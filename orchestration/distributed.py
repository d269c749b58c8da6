"""The distributed path of `updatelens run`: one Dagster run per (model, layer) partition, each
executed by the code location's executor ($UPDATELENS_PROFILE: the celery or k8s executor sends every
step to a worker). Apart from the in-process runner because it rebuilds the code location's
definitions (`analyse_job`, the reconstructable target the workers load), which the runner's
callers (the jobs' ops among them) must not import."""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import dagster as dg

from updatelens.assets.resources import UpdateLensResource
from updatelens.errors import ConfigError
from updatelens.orchestration.definitions import build_defs
from updatelens.orchestration.deployments import active_profile
from updatelens.orchestration.runner import (
    check_inputs,
    check_verdicts,
    failure_message,
    lens_run_config,
    register_model,
    register_model_key,
)
from updatelens.preflight import Preflight


def analyse_job() -> dg.JobDefinition:
    """The `analyse` job under the profile of $UPDATELENS_PROFILE, as a reconstructable target: a
    distributed executor ships this pointer (module + function) to its workers, which build the
    same definitions from the same environment."""
    return build_defs(active_profile()).resolve_job_def("analyse")


@dataclass
class LayerRun:
    """What one (model, layer) run of the distributed path did."""

    layer: int
    run_id: str
    success: bool
    checks: list[tuple[str, bool, str]]  # (asset.check, passed, description)
    workers: dict[str, str]  # step key -> the Celery worker that executed it (celery profile)
    failure: str = ""


def _layer_run(key: str, layer: int, run_config: dict[str, object], stages: Sequence[str] | None = None) -> LayerRun:
    """One (model, layer) run of every stage or of `stages` alone, in its own process (like a run
    launcher's run worker): the executor loop submits the steps and waits for them; the instance
    comes from $DAGSTER_HOME."""
    # dagster-celery registers its task on the executor's app again for every step it submits;
    # celery warns each time (6 lines per step), which says nothing about this run
    warnings.filterwarnings("ignore", message="Task name 'execute_plan' is already registered")
    job = dg.reconstructable(analyse_job)
    with dg.DagsterInstance.get() as instance, \
            dg.execute_job(job, instance=instance, run_config=run_config, tags={"dagster/partition": key},
                           raise_on_error=False,
                           asset_selection=[dg.AssetKey(s) for s in stages] if stages else None) as result:
        return LayerRun(layer=layer, run_id=result.run_id, success=result.success, checks=check_verdicts(result),
                        workers=step_workers(instance, result.run_id),
                        failure="" if result.success else failure_message(result))


def step_workers(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    """Step key -> the worker host that ran it, from the Celery executor's engine events."""
    out: dict[str, str] = {}
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event is None or not event.is_engine_event or not record.step_key:
            continue
        data = event.engine_event_data.metadata if event.engine_event_data else {}
        worker = data.get("Celery worker")
        if worker is not None:
            out[record.step_key] = str(worker.value)
    return out


def materialize_layers_distributed(model: str, lens: UpdateLensResource, instance: dg.DagsterInstance,
                                   layers: Sequence[int] | None = None, max_runs: int = 4,
                                   log_level: str = "INFO", report: Preflight | None = None,
                                   stages: dict[int, list[str]] | None = None) -> list[LayerRun]:
    """One run per (model, layer) partition, `max_runs` at a time, each executed by the code
    location's executor ($UPDATELENS_PROFILE: the celery or k8s executor sends every step to a
    worker). Each run's executor loop runs in its own spawned process (threads sharing one
    instance deadlocked here). Needs the persistent instance of $DAGSTER_HOME, which the workers
    share: `instance` must be it. `stages`: the stages to run per layer (default: every stage), e.g.
    the stale ones and their readers."""
    if instance.is_ephemeral:
        raise ConfigError("a distributed run needs a persistent Dagster instance (set DAGSTER_HOME)")
    report = report or check_inputs(model, lens, layers)
    keys = register_model(instance, model, report.n_layers)
    register_model_key(instance, model)
    chosen = list(range(report.n_layers)) if layers is None else sorted(set(layers))
    run_config = lens_run_config(lens, log_level)
    with ProcessPoolExecutor(max_workers=max(1, min(max_runs, len(chosen))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_layer_run, keys[layer], layer, run_config, (stages or {}).get(layer)) for layer in chosen]
        return [future.result() for future in futures]
