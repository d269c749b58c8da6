"""The code location: assembles Definitions only (loaded by workspace.yaml). `defs` is Dagster's lazy
entry point: importing this module builds nothing; Dagster's tools (and the tests) call it."""

from __future__ import annotations

import dagster as dg

from updatelens.assets.pipeline import ASSETS, PER_MODEL_ASSETS
from updatelens.assets.resources import UpdateLensResource, default_settings
from updatelens.memory import limit_malloc_arenas
from updatelens.orchestration.deployments import Profile, active_profile, executor_for
from updatelens.orchestration.jobs import JOBS
from updatelens.orchestration.schedules import stale_partitions_schedule
from updatelens.orchestration.sensors import model_registry_sensor, reports_after_analysis, stage_automation_sensor

__all__ = ["ASSETS", "build_defs", "defs"]  # ASSETS: what the tests materialize


def build_defs(profile: Profile) -> dg.Definitions:
    limit_malloc_arenas()  # the run workers the UI starts load this first (updatelens.memory)
    return dg.Definitions(
        assets=[*ASSETS, *PER_MODEL_ASSETS],
        jobs=JOBS,
        sensors=[model_registry_sensor, stage_automation_sensor, reports_after_analysis],
        schedules=[stale_partitions_schedule],
        # the settings bound explicitly: Dagster's config schema takes a nested config's class defaults,
        # not a default_factory's value, so $UPDATELENS_SETTINGS would not reach the runs otherwise
        resources={"lens": UpdateLensResource(analysis=default_settings())},
        executor=executor_for(profile),
    )


@dg.definitions
def defs() -> dg.Definitions:
    return build_defs(active_profile())  # $UPDATELENS_PROFILE: local, celery or k8s
