"""The code location: assembles Definitions only (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from assets.pipeline import ASSETS, PER_MODEL_ASSETS
from orchestration.deployments import Profile, active_profile, executor_for
from orchestration.jobs import JOBS
from orchestration.resources import UpdateLensResource
from orchestration.schedules import stale_partitions_schedule
from orchestration.sensors import model_registry_sensor, reports_after_analysis

__all__ = ["ASSETS", "build_defs", "defs"]


def build_defs(profile: Profile) -> dg.Definitions:
    return dg.Definitions(
        assets=[*ASSETS, *PER_MODEL_ASSETS],
        jobs=JOBS,
        sensors=[model_registry_sensor, reports_after_analysis],
        schedules=[stale_partitions_schedule],
        resources={"lens": UpdateLensResource()},
        executor=executor_for(profile),
    )


defs = build_defs(active_profile())  # $UPDATELENS_PROFILE: local, celery or k8s
