"""The code location: assembles Definitions only (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from assets.activations import activations
from assets.functional_metrics import functional_metrics
from assets.geometry import geometry
from assets.local_fits import local_fits
from assets.residuals import residuals
from orchestration.jobs import JOBS
from orchestration.resources import UpdateLensResource

ASSETS = [activations, local_fits, residuals, geometry, functional_metrics]

defs = dg.Definitions(
    assets=ASSETS,
    jobs=JOBS,
    resources={"lens": UpdateLensResource()},
)
