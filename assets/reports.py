"""Per-model reports, the comparison across models, and convention sweeps (partitioned by model).

Thin wiring over `reports.build` and `updatelens.sweep`: the report reads stored tables only; the
sweep loads the model once and stores each configuration's analysis tables side by side under
its config id (`<data root>/sweeps/config=<id>/...`), which the `sensitivity` view compares.
"""

import base64
import json
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
from updatelens.assets.routing import MODEL_POOL, step_tags
from updatelens.findings import FINDINGS
from updatelens.reports.build import (
    COMPARISON_FIGURES,
    MODEL_FIGURES,
    Report,
    build_comparison,
    build_model_report,
)
from updatelens.stages import SWEEP_TABLES
from updatelens.storage.layout import clear_sweeps, sweep_root, write_sweep_run
from updatelens.storage.location import url
from updatelens.storage.store import Store
from updatelens.sweep import (
    DEFAULT_GRID,
    parse_grid,
    run_record,
    spread_layers,
    sweep,
    sweep_baseline,
    sweep_runs,
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
    """The written page: every figure's PNG exists and is inlined in index.html, and the findings
    table has a row for every declared finding (updatelens.findings)."""
    page = report.index.read_text(encoding="utf-8")
    missing = [name for name in captions if not report.figures[name].exists() or f"alt='{name}'" not in page]
    present = set(report.findings["finding"].to_list()) if "finding" in report.findings.columns else set()
    absent = [f.id for f in FINDINGS if f.id not in present or f"<td>{f.id}</td>" not in page]
    problems = ([f"figures missing from the page: {', '.join(missing)}"] if missing else []) + \
        ([f"findings without a row: {', '.join(absent)}"] if absent else [])
    return dg.AssetCheckResult(check_name="report_complete", passed=not problems,
                               description="; ".join(problems) or None, metadata={
                                   "figures": len(captions) - len(missing), "missing_figures": ", ".join(missing) or "none",
                                   "findings": len(FINDINGS) - len(absent),
                                   "missing_findings": ", ".join(absent) or "none"})


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


class SweepConfig(dg.Config):
    """Which conventions to vary (one at a time around the lens's configuration) and where."""

    grid: str = json.dumps(DEFAULT_GRID)  # {"setting": [values, ...]}: any AnalysisConfig field
    layers: list[int] = []  # empty: `n_layers` layers spread from the first to the last
    n_layers: int = 8
    with_controls: bool = False  # the random/crude controls cost two patched forwards per layer


@dg.asset(
    partitions_def=MODELS,
    group_name="reports",
    kinds={"pytorch", "parquet"},
    code_version=CODE_VERSION,
    pool=MODEL_POOL,
    op_tags=step_tags(needs_model=True),  # it loads the model: the GPU queue and pod resources
    description="Convention sweep: the model's sample analysed under a grid of configurations (neighbour "
                "exclusion, k, rank, class by default), each stored under its config id in "
                "`<data root>/sweeps/config=<id>/`; SQL views `sweep_findings` and `sensitivity`. A rerun "
                "replaces the model's sweep whole.",
)
def convention_sweep(context: dg.AssetExecutionContext, lens: UpdateLensResource, config: SweepConfig) -> dg.MaterializeResult:
    model = context.partition_key
    lm = lens.load(model)
    base = sweep_baseline(lens.config(), config.with_controls)
    runs = sweep_runs(base, parse_grid(config.grid), d_model=lm.d_model, max_positions=lm.max_positions)
    layers = config.layers or spread_layers(lm.n_layers, config.n_layers)
    bad = [layer for layer in layers if not 0 <= layer < lm.n_layers]
    if bad:
        raise ValueError(f"{model} has {lm.n_layers} layers; no layer {bad}")
    store = lens.store

    def write(run, layer: int, tables: dict) -> None:
        family = Store.open(sweep_root(store.root, run.config.config_id))
        for table in SWEEP_TABLES:
            family.partition(table, model, layer).write(tables[table])

    with store.lock(model):
        clear_sweeps(store.root, model)
        sweep(lm, lens.sample(lm), runs, layers, write, log=context.log.info)
        for run in runs:
            write_sweep_run(store.root, model, run.config.config_id, run_record(model, run, base, layers))
    store.refresh()
    sensitivity = store.query("SELECT finding, convention, setting, round(value, 3) AS value, verdict, "
                              "round(delta_ci_lo, 3) AS delta_lo, round(delta_ci_hi, 3) AS delta_hi, flips "
                              "FROM sensitivity WHERE model = $1", [model])
    return dg.MaterializeResult(metadata={
        "configs": len(runs),
        "layers": ", ".join(map(str, layers)),
        "config_ids": ", ".join(f"{r.convention}={r.setting}: {r.config.config_id}" for r in runs),
        "sweeps_path": dg.MetadataValue.path(url(store.root / "sweeps")),
        "verdicts_flipped": int(sensitivity["flips"].sum()),
        "sensitivity": dg.MetadataValue.md(_md_table(sensitivity)),
    })
