"""Named jobs for the common launches."""

from __future__ import annotations

import dagster as dg

from updatelens.assets.partitions import MODEL_LAYER, MODELS
from updatelens.orchestration.calibration import calibrate_job
from updatelens.orchestration.convergence import converge_job
from updatelens.stages import STAGE_NAMES

# Everything for the selected (model, layer) partitions: select a model's key range to run it whole.
analyse_job = dg.define_asset_job(
    "analyse",
    selection=dg.AssetSelection.assets(*STAGE_NAMES),
    partitions_def=MODEL_LAYER,
    description="All five stages for the selected partitions (a model's key range runs it whole).",
)

# One stage across whatever partitions are selected (e.g. all models' keys after a stage changed).
stage_jobs = [
    dg.define_asset_job(f"stage_{stage}", selection=dg.AssetSelection.assets(stage), partitions_def=MODEL_LAYER,
                        description=f"Only `{stage}`, for the selected partitions (its inputs must exist).")
    for stage in STAGE_NAMES
]


# Per model: its report from stored results (the reports_after_analysis sensor launches it).
report_job = dg.define_asset_job(
    "build_report", selection=dg.AssetSelection.assets("report"), partitions_def=MODELS,
    description="Rebuild the selected models' reports from stored results (no recomputation).")
comparison_job = dg.define_asset_job(
    "build_comparison", selection=dg.AssetSelection.assets("comparison_report"),
    description="Rebuild the comparison report across every materialized model.")
sweep_job = dg.define_asset_job(
    "sweep_conventions", selection=dg.AssetSelection.assets("convention_sweep"), partitions_def=MODELS,
    description="Convention sweep for the selected models (set the grid in the launchpad's op config).")

JOBS: list[dg.JobDefinition | dg.UnresolvedAssetJobDefinition] = [
    analyse_job, *stage_jobs, report_job, comparison_job, sweep_job, converge_job, calibrate_job]
