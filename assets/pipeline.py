"""The asset lists the code location, the runner and the tests assemble from."""

from __future__ import annotations

from assets.activations import activations
from assets.functional_metrics import functional_metrics
from assets.geometry import geometry
from assets.local_fits import local_fits
from assets.reports import comparison_report, convention_sweep, report
from assets.residuals import residuals

ASSETS = [activations, local_fits, residuals, geometry, functional_metrics]  # per (model, layer), in order
PER_MODEL_ASSETS = [report, convention_sweep, comparison_report]
