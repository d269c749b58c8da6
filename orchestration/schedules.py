"""Periodic reruns of stale partitions (missing, or made by another code version or config)."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from updatelens.assets.partitions import MODEL_LAYER_KEY, parse_key
from updatelens.assets.resources import UpdateLensResource
from updatelens.orchestration.jobs import analyse_job
from updatelens.orchestration.sensors import stale_run_requests
from updatelens.registry import load_models

RERUN_CRON = os.environ.get("UPDATELENS_RERUN_CRON", "0 3 * * 0")  # weekly, Sunday 03:00


@dg.schedule(cron_schedule=RERUN_CRON, job=analyse_job, default_status=dg.DefaultScheduleStatus.RUNNING,
             description="Reruns (model, layer) partitions whose stored results are missing or were made by "
                         "another code version or configuration; models no longer in the registry are left "
                         "alone. Cron: $UPDATELENS_RERUN_CRON (default weekly, Sunday 03:00).")
def stale_partitions_schedule(context: dg.ScheduleEvaluationContext, lens: UpdateLensResource):
    registered: dict[str, int] = {}
    for key in context.instance.get_dynamic_partitions(MODEL_LAYER_KEY):
        model, layer = parse_key(key)
        registered[model] = max(registered.get(model, 0), layer + 1)
    tick = context.scheduled_execution_time.isoformat()
    requests = [r for slug in load_models(Path(lens.registry)) if slug in registered
                for r in stale_run_requests(lens, slug, registered[slug], tick)]
    return requests or dg.SkipReason("every registered partition is up to date")
