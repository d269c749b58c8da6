"""Helpers every stage shares: reading upstream partitions consistently and reporting results."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pyarrow as pa

from updatelens import schemas
from updatelens.assets.check_catalog import Outcome, specs
from updatelens.assets.expectations import Verdict
from updatelens.assets.partitions import MODEL_LAYER, group_keys
from updatelens.assets.resources import UpdateLensResource
from updatelens.assets.routing import MODEL_POOL, step_tags
from updatelens.config import AnalysisConfig
from updatelens.fits import LayerFit
from updatelens.memory import release_free_memory
from updatelens.stages import BY_NAME, STAGE_NAMES, STAGE_OF_TABLE, Stage, upstream
from updatelens.steps.geometry import BlockReader
from updatelens.steps.layer import LayerData, Transition, layer_data, transition_from_parts
from updatelens.steps.local_fits import fits_from_table
from updatelens.storage.integrity import partition_error
from updatelens.storage.layout import read_file, read_schema
from updatelens.storage.location import url
from updatelens.storage.store import Partition, RunScope, Store
from updatelens.tables import PROVENANCE_COLUMNS
from updatelens.versions import stage_version


def run_stages(context: dg.AssetExecutionContext) -> tuple[str, ...]:
    """The stages this step's run materializes, in the pipeline's order (its asset selection where it
    records one, else the assets its job executes: `materialize` records an empty selection)."""
    keys = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    names = {key.to_user_string() for key in keys}
    return tuple(stage for stage in STAGE_NAMES if stage in names)


def run_store(context: dg.AssetExecutionContext, store: Store) -> Store:
    """The data root as this step's run sees it: the tables of the run's stages are staged and read back
    from the run's staging folder, and the last of the run's stages to finish swaps them into place
    (`finish`); a run that stops before leaves the stored partitions as they were (storage.staging).
    Inputs that another run is writing are waited for (`await_staged_inputs`)."""
    scoped = store.for_run(RunScope(context.run.run_id, run_stages(context), context.asset_key.to_user_string()))
    await_staged_inputs(context, scoped)
    return scoped


INPUT_WAIT_S = 3600.0  # the longest a step waits for another run to swap in the inputs it is writing
INPUT_POLL_S = 2.0


def await_staged_inputs(context: dg.AssetExecutionContext, store: Store, wait_s: float = INPUT_WAIT_S) -> None:
    """Wait while another run that is going has staged, and not yet swapped in, a partition this step
    reads in place. A stage's materialization is recorded when its step ends, but its partitions
    appear when its run's last stage ends (stage, then swap): a run that declarative automation launches
    on that record meanwhile would otherwise find its inputs missing. Before the partitions' locks
    (`each_model`), which the other run takes to swap them in."""
    tables = [t for stage in upstream(context.asset_key.to_user_string()) for t in stage.tables]
    if not tables:
        return
    going, told = run_going(context.instance), set()
    deadline = time.monotonic() + wait_s
    for model, layers in group_keys(context.partition_keys).items():
        while others := store.staged_elsewhere(tables, model, layers, going):
            for run_id, parts in others.items():
                if run_id not in told:
                    told.add(run_id)
                    context.log.info(f"waiting for run {run_id}, which is writing {', '.join(parts)}: they appear "
                                     "when its last stage ends (stage, then swap)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"run(s) {', '.join(others)} still write inputs of this step after {wait_s:.0f} s "
                                   f"({', '.join(p for parts in others.values() for p in parts)}); run it again "
                                   "when they end")
            time.sleep(INPUT_POLL_S)


def run_going(instance: dg.DagsterInstance) -> Callable[[str], bool | None]:
    """run id -> whether the instance has it going (True: starting or started; a run's steps may be
    separate processes, its staging folder is kept between them), over (False), or does not know it (None)."""
    def going(run_id: str) -> bool | None:
        run = instance.get_run_by_id(run_id)
        return None if run is None else not run.is_finished

    return going


class StaleInputError(RuntimeError):
    """An upstream partition was produced under another configuration."""


def check_upstream(store: Store, table: str, model: str, layer: int, cfg: AnalysisConfig) -> pa.Table:
    """The provenance of an upstream partition (its first row), after checking that it verifies (its
    manifest names this partition and matches the file: a damaged or misplaced input is refused,
    never read) and that it was produced under this run's configuration: reads the footer and a few
    columns of one row group, not the partition."""
    part = store.partition(table, model, layer)
    part.require()
    if reason := partition_error(part.file):
        raise StaleInputError(f"{table} for {model} layer {layer} does not verify ({reason}); rematerialize it "
                              f"(`updatelens verify --repair`, then `updatelens run`)")
    head = next(part.parts(list(PROVENANCE_COLUMNS)))
    found = head["config_id"][0].as_py() if len(head) else cfg.config_id
    if found != cfg.config_id:
        raise StaleInputError(
            f"{table} for {model} layer {layer} was produced with config {found}, this run uses "
            f"{cfg.config_id}; rematerialize the upstream assets for this partition with the same "
            f"configuration")
    return head.slice(0, 1)


BLOCK_ROWS = 8192  # tokens per block of whole sequences in the streaming stages


def seq_blocks(cfg: AnalysisConfig, rows: int | None = None) -> list[tuple[int, int]]:
    """[lo, hi) ranges of whole sequences of about `rows` tokens (default BLOCK_ROWS), covering the sample."""
    per_block = max(1, (rows or BLOCK_ROWS) // cfg.seq_len)
    return [(lo, min(cfg.n_seq, lo + per_block)) for lo in range(0, cfg.n_seq, per_block)]


def read_block(store: Store, model: str, layer: int, lo: int, hi: int,
               fits: Store | None = None) -> tuple[LayerData, dict[str, LayerFit]]:
    """Sequences lo..hi-1 of a layer: the transition's arrays and the fitted T(x) per class (read
    from `fits`, a sweep configuration's tables, where given)."""
    data = layer_data(store.partition("activations", model, layer).seqs(lo, hi))
    return data, fits_from_table((fits or store).partition("local_fits", model, layer).seqs(lo, hi), data)


def block_reader(store: Store, model: str, layer: int, fits: Store | None = None) -> BlockReader:
    """(lo, hi) -> `read_block` of the layer's sequences lo..hi-1."""
    return lambda lo, hi: read_block(store, model, layer, lo, hi, fits)


def stored_activations(store: Store, model: str) -> Callable[[int, int, int], LayerData]:
    """(layer, lo, hi) -> sequences lo..hi-1 of the layer's stored activations."""
    return lambda layer, lo, hi: layer_data(store.partition("activations", model, layer).seqs(lo, hi))


def stored_fits(store: Store, model: str, layer: int) -> Callable[[LayerData, int, int], dict[str, LayerFit]]:
    """(data, lo, hi) -> the layer's stored fits of sequences lo..hi-1, aligned with `data`."""
    return lambda data, lo, hi: fits_from_table(store.partition("local_fits", model, layer).seqs(lo, hi), data)


def read_transition(store: Store, model: str, layer: int) -> Transition:
    """A layer's kept tokens (x, y, seq, pos, doc) from its activations, one row group at a time."""
    source = store.partition("activations", model, layer)
    n_kept = int(source.read(["kept"])["kept"].to_numpy(zero_copy_only=False).sum())
    return transition_from_parts(source.parts(["layer", "seq", "pos", "doc", "kept", "x", "y"]), n_kept)


def sample_index(store: Store, model: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The sample's token ids and kept positions [n_seq, T], from a layer's activations."""
    index = store.partition("activations", model, layer).read(["seq", "pos", "token_id", "kept"])
    index = index.sort_by([("seq", "ascending"), ("pos", "ascending")])
    n_seq = int(index["seq"].to_numpy().max()) + 1
    return (index["token_id"].to_numpy().reshape(n_seq, -1),
            index["kept"].to_numpy(zero_copy_only=False).reshape(n_seq, -1))


@dataclass
class Written:
    """What a stage wrote in this run, per partition, for the UI's metadata."""

    rows: dict[str, int] = field(default_factory=dict)  # table -> rows written in this run
    paths: list[str] = field(default_factory=list)  # where each partition is once the run commits
    files: list[str] = field(default_factory=list)  # where each was written (the run's staging folder)
    per_partition: dict[str, dict[str, object]] = field(default_factory=dict)  # key -> figures

    def add(self, part: Partition, table: pa.Table) -> pa.Table:
        """Write a partition and return it as read back from disk: checks validate the file."""
        path = part.write(table)
        self.record(part, len(table))
        return read_file(path)

    def record(self, part: Partition, rows: int) -> None:
        """A partition written in this run (by `add`, or streamed by the stage itself): counted,
        without reading it back."""
        self.rows[part.table] = self.rows.get(part.table, 0) + rows
        self.paths.append(part.url)
        self.files.append(url(part.file))
        figures = self.per_partition.setdefault(f"{part.model}:{part.layer:02d}", {})
        figures[f"rows_{part.table}"] = rows
        figures.setdefault("parquet_path", part.relative)  # within the data root: right after a move or copy

    def note(self, model: str, layer: int, **figures: object) -> None:
        self.per_partition.setdefault(f"{model}:{layer:02d}", {}).update(figures)


class _ToDagsterLog(logging.Handler):
    """Forwards the engine's log records (logger `updatelens`) to a Dagster step's log."""

    def __init__(self, dagster_log: logging.Logger) -> None:
        super().__init__(logging.INFO)
        self.dagster_log = dagster_log

    def emit(self, record: logging.LogRecord) -> None:
        getattr(self.dagster_log, record.levelname.lower(), self.dagster_log.info)(record.getMessage())


@contextmanager
def engine_logs(dagster_log: logging.Logger) -> Iterator[None]:
    """Within the context the engine's INFO records (progress of capture, fits and patched passes:
    updatelens.progress) appear in the step's Dagster log, the run's event log in the UI."""
    engine = logging.getLogger("updatelens")
    handler, level = _ToDagsterLog(dagster_log), engine.level
    engine.addHandler(handler)
    engine.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield
    finally:
        engine.removeHandler(handler)
        engine.setLevel(level)


# Each stage follows its upstream's updates (eager, without eager's "newly missing" trigger): a
# partition that is missing, because a model was added or a root opened where it never ran, is
# launched by the registry sensor (a model added while the deployment runs, or one whose registry entry
# says auto_run) or by someone (the UI, `updatelens run`), never by opening the UI. The UI's
# Automation tab says for every partition which part held.
STAGE_AUTOMATION = (dg.AutomationCondition.in_latest_time_window()
                    & dg.AutomationCondition.any_deps_updated().since_last_handled()
                    & ~dg.AutomationCondition.any_deps_missing()
                    & ~dg.AutomationCondition.any_deps_in_progress()
                    & ~dg.AutomationCondition.in_progress()).with_label("after an upstream update")


def stage_asset(fn: Callable[[StageRun], None]) -> dg.AssetsDefinition:
    """A stage's asset, from its description in updatelens.stages (the function's name is the
    stage's): (model, layer) partitions, single-run backfills (a model's key range runs in one
    process, also when declarative automation requests it), eager automation, the engine's code
    version, the stage's checks, the stages whose tables it reads, and where its step may run (a stage that holds
    the model joins the `model` pool and goes to GPU workers: routing). The body `fn` gets the step as a
    `StageRun`, writes its partitions and records each check's verdicts; the skeleton opens the run's view
    of the root, and finishes: the materialization, each partition's figures, each check's evaluations."""
    stage = BY_NAME[fn.__name__]

    def logged(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> Iterator[object]:
        run = StageRun.open(context, lens, stage)
        with engine_logs(context.log):
            fn(run)
            done = run.finish()
        # the materialization of every partition first, then each partition's own figures (an
        # observation of it) and each check's evaluation of each partition (the UI lists them by
        # partition); last the run's result of each check over its partitions (what a blocking check
        # stops the downstream steps on)
        yield done.materialization
        observe_partitions(context, done.written)
        for outcome in done.outcomes:
            for evaluation in outcome.evaluations():
                context.log_event(evaluation)
        for outcome in done.outcomes:
            yield outcome.result()

    logged.__name__ = logged.__qualname__ = stage.name
    # Dagster reads the parameters' types (the context's, and the resource's by its class); this module's
    # annotations are strings (`from __future__ import annotations`)
    logged.__annotations__ = {"context": dg.AssetExecutionContext, "lens": UpdateLensResource}
    return dg.asset(
        name=stage.name,
        partitions_def=MODEL_LAYER,
        backfill_policy=dg.BackfillPolicy.single_run(),
        automation_condition=STAGE_AUTOMATION,
        group_name=stage.group,
        code_version=stage_version(stage.name),  # the UI calls a partition made by another stale
        kinds=set(stage.kinds),
        deps=[dg.AssetKey(s.name) for s in upstream(stage.name)],
        pool=MODEL_POOL if stage.needs_model else None,
        op_tags=step_tags(needs_model=stage.needs_model),
        check_specs=specs(stage.name),
        description=stage.description,
        metadata={"dagster/column_schema": declared_schema(stage.tables[0]),
                  "dagster/table_name": stage.tables[0]},
    )(logged)


@dataclass
class StageRun:
    """One stage's step as its body sees it (`stage_asset` opens and finishes it): the configuration,
    the data root as this run sees it (`run_store`), what the step has written and each of the stage's
    declared checks' verdicts by partition."""

    context: dg.AssetExecutionContext
    lens: UpdateLensResource
    stage: Stage
    cfg: AnalysisConfig
    store: Store
    written: Written = field(default_factory=Written)
    verdicts: dict[str, dict[str, Verdict]] = field(default_factory=dict)  # check -> partition key -> verdict
    extra: dict[str, object] = field(default_factory=dict)  # the materialization's own figures

    @classmethod
    def open(cls, context: dg.AssetExecutionContext, lens: UpdateLensResource, stage: Stage) -> StageRun:
        return cls(context, lens, stage, lens.config(), run_store(context, lens.store),
                   verdicts={name: {} for name in stage.checks})

    def models(self) -> Iterator[tuple[str, list[int]]]:
        """(model, layers) of this step, under the locks of those partitions (`each_model`)."""
        return each_model(self.context, self.store)

    def judge(self, check: str, model: str, layer: int, verdict: Verdict) -> Verdict:
        """Record a check's verdict on one partition."""
        if check not in self.verdicts:
            raise KeyError(f"{check!r} is not a check of stage {self.stage.name} (updatelens.stages: "
                           f"{', '.join(self.stage.checks)})")
        self.verdicts[check][f"{model}:{layer:02d}"] = verdict
        return verdict

    def finish(self) -> Finished:
        """The stage's materialization and its checks' outcomes; every declared check must have judged
        every partition the step wrote (a check left out would otherwise pass, with nothing tested)."""
        for check, verdicts in self.verdicts.items():
            missing = sorted(set(self.written.per_partition) - set(verdicts))
            if missing:
                raise RuntimeError(f"stage {self.stage.name}: check {check} has no verdict on {', '.join(missing)}")
        return finish(self.store, self.cfg, self.written, self.extra,
                      [Outcome(self.stage.name, check, verdicts, self.lens.checks)
                       for check, verdicts in self.verdicts.items()])


def frame_table(frame: pl.DataFrame) -> dg.TableMetadataValue:
    """A polars frame as Dagster table metadata (a sortable table with its column schema in the UI)."""
    kinds: dict[Any, str] = {pl.Int64: "int", pl.Int32: "int", pl.Float64: "float", pl.Float32: "float", pl.Boolean: "bool"}
    schema = dg.TableSchema(columns=[dg.TableColumn(name, kinds.get(dtype, "string"))
                                     for name, dtype in frame.schema.items()])
    rows = [dg.TableRecord({k: (v if isinstance(v, (int, float, bool)) or v is None else str(v)) for k, v in row.items()})
            for row in frame.iter_rows(named=True)]
    return dg.MetadataValue.table(rows, schema=schema)


def md_table(columns: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A markdown table for asset metadata (floats to 4 significant digits, None blank)."""

    def cell(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value if value is not None else "")

    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def partition_table(per_partition: dict[str, dict[str, object]]) -> dg.TableMetadataValue:
    """One row per partition written in the run (rows per table, figures rounded to 4 significant
    digits; each partition's file is in its own observation)."""
    columns = list(dict.fromkeys(c for figures in per_partition.values() for c in figures if c != "parquet_path"))
    return frame_table(pl.DataFrame([{"partition": key, **{c: _rounded(figures.get(c)) for c in columns}}
                                     for key, figures in per_partition.items()], strict=False, infer_schema_length=None))


def column_schema(path: str, table: str, cfg: AnalysisConfig) -> dg.TableSchema:
    """The columns of a stored table, with their Arrow types and their declared descriptions
    (updatelens.schemas), as the UI's column schema."""
    described = schemas.descriptions(table, cfg)
    return dg.TableSchema(columns=[dg.TableColumn(f.name, str(f.type), description=described.get(f.name))
                                   for f in read_schema(path)])


def declared_schema(table: str) -> dg.TableSchema:
    """A table's declared columns (default configuration) as a column schema: shown on the asset
    before anything is materialized."""
    return dg.TableSchema(columns=[dg.TableColumn(c.name, c.type if isinstance(c.type, str) else str(c.type),
                                                  description=c.description) for c in schemas.columns(table)])


def each_model(context: dg.AssetExecutionContext, store: Store) -> Iterator[tuple[str, list[int]]]:
    """(model, layers) of this run, under the locks of those partitions: concurrent runs writing
    the same partitions are serialised step by step; other layers and models proceed in parallel."""
    for model, layers in group_keys(context.partition_keys).items():
        with store.lock(model, layers):
            yield model, layers


def _rounded(value: object) -> object:
    """A figure as a person reads it: floats to 4 significant digits."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def observe_partitions(context: dg.AssetExecutionContext, written: Written) -> None:
    """Each partition's own figures (its rows per table, its layer's summary, its file), as an
    observation of that partition: a run over many partitions materializes them with one metadata,
    the run's (Dagster has no per-partition metadata for a single-run backfill), so a partition's page
    shows its own figures here."""
    for key, figures in written.per_partition.items():
        metadata: dict[str, Any] = {name: (dg.MetadataValue.path(str(value)) if name == "parquet_path" else _rounded(value))
                    for name, value in figures.items() if value is not None}
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=key, metadata=metadata))


@dataclass
class Finished:
    """What a finished step hands its asset (StageRun.finish): the materialization's metadata and its checks."""

    materialization: dg.MaterializeResult
    outcomes: list[Outcome]
    written: Written


def finish(store: Store, cfg: AnalysisConfig, written: Written, extra: dict[str, object] | None = None,
           outcomes: list[Outcome] | None = None) -> Finished:
    """The stage's materialization. The run's last stage to finish first swaps what the run staged into
    place and refreshes the catalog's views (an earlier stage changed nothing they show)."""
    schema = column_schema(written.files[0], next(iter(written.rows)), cfg)  # read where it was written
    if store.stage_done():  # the run's last stage to finish (or no run): swap its partitions in
        store.commit()
        store.refresh()
    release_free_memory()  # the stage's working memory back to the system before the next (updatelens.memory)
    # one partition: its file; several: the table folder they live under; within the data root (a moved or
    # copied root keeps it right)
    first = written.paths[0][len(store.url):].lstrip("/")
    where = first if len(written.per_partition) == 1 else first.rsplit("/", 3)[0]
    metadata: dict[str, Any] = {
        "config_id": cfg.config_id,
        "code_version": stage_version(STAGE_OF_TABLE[next(iter(written.rows))]),
        "partitions_written": len(written.per_partition),
        "parquet_path": dg.MetadataValue.path(where),
        "dagster/row_count": sum(written.rows.values()),
        "partitions_of_this_run": partition_table(written.per_partition),
        # the DuckDB views of the stage's tables (updatelens sql, the catalog file) and the main one's columns
        "dagster/table_name": next(iter(written.rows)),
        "duckdb_views": ", ".join(written.rows),
        "dagster/column_schema": schema,
    }
    for name, n in written.rows.items():
        metadata[f"rows_{name}"] = n
    if len(written.per_partition) == 1:  # a single (model, layer): its figures at top level
        for key, value in next(iter(written.per_partition.values())).items():
            if isinstance(value, (int, float)) and not key.startswith("rows_"):
                metadata[key] = value
    metadata.update(extra or {})
    return Finished(dg.MaterializeResult(metadata=metadata), outcomes or [], written)
