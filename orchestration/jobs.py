"""Named jobs for the common launches."""

from __future__ import annotations

import dagster as dg

from assets.common import GROUP
from orchestration.partitions import MODEL_LAYER

# Everything for the selected (model, layer) partitions; launch a model's key range for all layers.
analyse_job = dg.define_asset_job(
    "analyse",
    selection=dg.AssetSelection.groups(GROUP),
    partitions_def=MODEL_LAYER,
    description="All five stages for the selected partitions (select a model's keys to run it whole).",
)

JOBS = [analyse_job]
