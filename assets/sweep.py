"""The convention sweep (partitioned by model): the model's stored sample analysed under a grid of
configurations, one convention at a time (`updatelens.sweep`), each configuration's tables stored
under its config id (`<data root>/sweeps/config=<id>/...`), which the `sensitivity` view compares.

It streams like a run, through the same engine runners as the stages: it reads the layers' stored
activations (a real dependency), fits each configuration on the whole layer as `local_fits` does and
stores the fits beside its other tables, measures the geometry in two passes over blocks of
sequences, and runs the patched passes over blocks whose unpatched distributions serve every layer
and configuration. Memory holds a layer's kept states and one block, whatever the sample size.
"""

import json

import dagster as dg
import polars as pl
import pyarrow as pa
from upath import UPath

from updatelens.assets.common import (
    block_reader,
    check_upstream,
    md_table,
    read_transition,
    sample_index,
    seq_blocks,
    stored_activations,
    stored_fits,
)
from updatelens.assets.partitions import MODELS
from updatelens.assets.resources import UpdateLensResource
from updatelens.assets.routing import MODEL_POOL, step_tags
from updatelens.capture import block_output_is_tuple
from updatelens.models import LoadedModel
from updatelens.stages import SWEEP_TABLES
from updatelens.steps.functional_metrics import (
    Measure,
    functional_bootstrap_table,
    functional_tables_from_rows,
    stream_functional,
)
from updatelens.steps.geometry import stream_geometry
from updatelens.steps.layer import sample_docs
from updatelens.steps.local_fits import layer_neighbours, stream_fits
from updatelens.storage.layout import next_sweep_root, promote_sweep, remove_next_sweep, sweep_root
from updatelens.storage.location import url
from updatelens.storage.store import Store
from updatelens.sweep import (
    DEFAULT_GRID,
    SWEEP_LAYERS,
    SweepRun,
    parse_grid,
    run_record,
    spread_layers,
    sweep_baseline,
    sweep_runs,
)
from updatelens.tables import Provenance
from updatelens.versions import SWEEP_ASSET, SWEEP_READS, stage_version

assert "local_fits" in SWEEP_TABLES  # the functional passes read each configuration's stored fits


class SweepConfig(dg.Config):
    """Which conventions to vary (one at a time around the lens's configuration) and where."""

    grid: str = json.dumps(DEFAULT_GRID)  # {"setting": [values, ...]}: any AnalysisConfig field
    layers: list[int] = []  # empty: `n_layers` layers spread from the first to the last
    n_layers: int = SWEEP_LAYERS
    with_controls: bool = False  # the random/crude controls cost two patched forwards per layer


@dg.asset(
    name=SWEEP_ASSET,
    partitions_def=MODELS,
    # the sample it analyses: the reads its code version covers (updatelens.versions), every partition
    deps=[dg.AssetDep(read, partition_mapping=dg.AllPartitionMapping()) for read in SWEEP_READS],
    group_name="reports",
    kinds={"pytorch", "parquet"},
    code_version=stage_version(SWEEP_ASSET),  # its module's engine closure and the activations' version
    pool=MODEL_POOL,
    op_tags=step_tags(needs_model=True),  # it loads the model: the GPU queue and pod resources
    description="Convention sweep: the model's stored activations analysed under a grid of configurations "
                "(neighbour exclusion, k, rank, class by default), each stored under its config id in "
                "`<data root>/sweeps/config=<id>/`; SQL views `sweep_findings` and `sensitivity`. Needs the "
                "activations of the swept layers under the deployment's configuration. A rerun replaces the "
                "model's sweep whole, swapped in only when complete.",
)
def convention_sweep(context: dg.AssetExecutionContext, lens: UpdateLensResource, config: SweepConfig) -> dg.MaterializeResult:
    model = context.partition_key
    cfg = lens.config()
    store = lens.store
    lm = lens.load(model)
    base = sweep_baseline(cfg, config.with_controls)
    runs = sweep_runs(base, parse_grid(config.grid), d_model=lm.d_model, max_positions=lm.max_positions)
    layers = sorted(set(config.layers or spread_layers(lm.n_layers, config.n_layers)))
    bad = [layer for layer in layers if not 0 <= layer < lm.n_layers]
    if bad:
        raise ValueError(f"{model} has {lm.n_layers} layers; no layer {bad}")
    # the sample: every swept layer's activations, verified and captured under this configuration
    heads = {layer: check_upstream(store, "activations", model, layer, cfg) for layer in layers}
    with store.lock(model):
        # computed out of sight, then swapped in whole: a sweep that fails or is stopped leaves the
        # previous one served (storage.layout.promote_sweep)
        staged = next_sweep_root(store.root)
        try:
            _sweep(context, lm, store, staged, model, runs, layers, heads)
            promote_sweep(store.root, staged, model,
                          {run.config.config_id: run_record(model, run, base, layers) for run in runs})
        finally:
            remove_next_sweep(store.root, staged)
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


def _sweep(context: dg.AssetExecutionContext, lm: LoadedModel, store: Store, staged: UPath, model: str,
           runs: list[SweepRun], layers: list[int], heads: dict[int, pa.Table]) -> None:
    """Every configuration on every layer, each stored under `staged` (a root of sweep families out of
    the catalog's sight): fits and geometry layer by layer, then the patched passes of every layer and
    configuration over shared blocks of sequences."""
    families = {run.config.config_id: Store.open(sweep_root(staged, run.config.config_id)) for run in runs}
    docs = {}
    for layer in layers:
        data = read_transition(store, model, layer)
        docs[layer] = sample_docs(store.partition("activations", model, layer).read(["seq", "doc"]))
        for run in runs:
            cfg, family = run.config, families[run.config.config_id]
            with family.partition("local_fits", model, layer).writer() as sink:
                stream_fits(data, layer_neighbours(data, cfg), cfg, Provenance.of_rows(heads[layer], cfg, "local_fits"),
                            layer, sink.write, label=f"{model} layer {layer} ({run.convention}={run.setting}): ")
            prov = Provenance.of_rows(heads[layer], cfg, "geometry")
            with family.partition("geometry", model, layer).writer() as sink:
                spectra, resamples = stream_geometry(block_reader(store, model, layer, family), seq_blocks(cfg), cfg,
                                                     docs[layer], prov, sink.write)
            family.partition("spectra", model, layer).write(spectra)
            family.partition("geometry_bootstrap", model, layer).write(resamples)
        del data
        context.log.info(f"{model} layer {layer}: fits and geometry of {len(runs)} configurations")
    input_ids, kept = sample_index(store, model, layers[0])
    measures = [Measure(layer, run.config, stored_fits(families[run.config.config_id], model, layer))
                for layer in layers for run in runs]
    found = stream_functional(lm, input_ids, kept, measures, stored_activations(store, model), runs[0].config,
                              block_output_is_tuple(lm), f"{model}: the sweep's patched passes")
    for measure, rows in zip(measures, found):
        cfg, layer, family = measure.cfg, measure.layer, families[measure.cfg.config_id]
        prov = Provenance.of_rows(heads[layer], cfg, "functional_metrics")
        fm, fs = functional_tables_from_rows(rows, cfg, prov, layer)
        family.partition("functional_metrics", model, layer).write(fm)
        family.partition("functional_summary", model, layer).write(fs)
        family.partition("functional_bootstrap", model, layer).write(
            functional_bootstrap_table(fm, cfg, prov, layer, docs[layer]))


def _md_table(frame: pl.DataFrame) -> str:
    return md_table(frame.columns, frame.iter_rows())
