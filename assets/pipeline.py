"""The asset lists the code location, the runner and the tests assemble from.

The stage assets are found from their description (updatelens.stages): stage `name` is the asset
function `name` of module `updatelens.assets.<name>`.
"""

from __future__ import annotations

import importlib

from updatelens.assets.reports import comparison_report, report
from updatelens.assets.sweep import convention_sweep
from updatelens.stages import STAGES

# per (model, layer), in the pipeline's order
ASSETS = [getattr(importlib.import_module(f"updatelens.assets.{stage.name}"), stage.name) for stage in STAGES]
PER_MODEL_ASSETS = [report, convention_sweep, comparison_report]
