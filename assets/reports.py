"""Per-model reports and the comparison across models (partitioned by model).

Thin wiring over `reports.build`: the report reads stored tables only, the convention sweep's
(`assets/sweep.py`) among them.
"""

import base64
from typing import Any

import dagster as dg
import polars as pl

from updatelens import CODE_VERSION
from updatelens.assets.common import md_table
from updatelens.assets.controls import controls
from updatelens.assets.functional_metrics import functional_metrics
from updatelens.assets.geometry import geometry
from updatelens.assets.partitions import MODELS
from updatelens.assets.resources import UpdateLensResource
from updatelens.reports.build import (
    COMPARISON_FIGURES,
    MODEL_FIGURES,
    Report,
    build_comparison,
    build_model_report,
    report_problems,
)

REPORT_CHECK = dg.AssetCheckSpec("report_complete", asset="report",
                                 description="every figure is written and inlined in index.html, and the "
                                             "findings table has a row per finding")


def _md_table(frame: pl.DataFrame) -> str:
    return md_table(frame.columns, frame.iter_rows())


def _report_metadata(report: Report, captions: dict[str, str]) -> dict[str, Any]:
    """The report's path, its findings, and each figure inlined as markdown (shown in the UI)."""
    metadata: dict[str, Any] = {
        "report": dg.MetadataValue.path(str(report.index)),
        "findings": dg.MetadataValue.md(_md_table(report.findings.select(
            [c for c in ("model", "finding", "fn_class", "value", "threshold", "holds") if c in report.findings.columns]))),
    }
    for name, path in report.figures.items():
        encoded = base64.b64encode(path.read_bytes()).decode()
        metadata[f"figure_{name}"] = dg.MetadataValue.md(f"![{name}](data:image/png;base64,{encoded})\n\n{captions[name]}")
    return metadata


def _check_report(report: Report, captions: dict[str, str]) -> dg.AssetCheckResult:
    """The written page is complete (reports.build.report_problems)."""
    problems = report_problems(report, captions)
    return dg.AssetCheckResult(check_name="report_complete", passed=not problems,
                               description="; ".join(problems) or None,
                               metadata={"problems": "; ".join(problems) or "none"})


@dg.asset(
    partitions_def=MODELS,
    deps=[dg.AssetDep(geometry, partition_mapping=dg.AllPartitionMapping()),  # the views it reads
          dg.AssetDep(functional_metrics, partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep(controls, partition_mapping=dg.AllPartitionMapping()), "convention_sweep"],
    group_name="reports",
    kinds={"html", "matplotlib"},
    code_version=CODE_VERSION,
    check_specs=[REPORT_CHECK],
    description="A model's report from its stored results (no recomputation): per-layer curves, residual-angle "
                "histograms, error-vs-KL scatter, singular-value energy curves, controls, the findings table and, "
                "if a convention sweep exists, the sensitivity table. `<data root>/reports/<model>/index.html` "
                "(self-contained) with the PNGs beside it; the figures are in this asset's metadata.",
)
def report(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    model = context.partition_key
    built = build_model_report(lens.root, model, lens.config().config_id)  # the deployment's configuration first
    context.log.info(f"report for {model}: {built.index}")
    metadata = _report_metadata(built, MODEL_FIGURES)
    metadata["config_id"] = built.config_id
    return dg.MaterializeResult(metadata=metadata, check_results=[_check_report(built, MODEL_FIGURES)])


@dg.asset(
    deps=[dg.AssetDep(report, partition_mapping=dg.AllPartitionMapping())],
    group_name="reports",
    kinds={"html", "matplotlib"},
    code_version=CODE_VERSION,
    description="Every materialized model side by side: per-layer curves on normalised depth and the findings "
                "per model. `<data root>/reports/_comparison/index.html`.",
)
def comparison_report(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    built = build_comparison(lens.root)
    context.log.info(f"comparison report: {built.index}")
    metadata = _report_metadata(built, COMPARISON_FIGURES)
    metadata["models"] = built.findings["model"].n_unique()
    return dg.MaterializeResult(metadata=metadata)
