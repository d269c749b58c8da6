"""A data root opened once: its partitions (write, read, lock) and its SQL catalog.

`Store.open(root)` takes a local folder or an object-store URL (storage.location) and normalises
it once; the stages, the reports and the commands then work through it instead of passing the
root around as a string. Each operation is the layout's, catalog's or integrity's function of the
same name (those modules stay the implementation and the API for scripts that hold a path).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
from upath import UPath

from updatelens import schemas
from updatelens.stages import STAGE_NAMES, TABLES, TABLES_BY_STAGE
from updatelens.storage import catalog, layout, staging
from updatelens.storage.integrity import Damaged, incomplete_layers
from updatelens.storage.location import as_root, url


@dataclass(frozen=True)
class RunScope:
    """A run's view of the store (stage, then swap: storage.staging): the tables of its stages
    are written to, and read back from, the run's staging folder; the others are read in place. The
    step that finishes the run's last stage to finish swaps what the run staged into place
    (`Store.stage_done`, `Store.commit`)."""

    run_id: str
    stages: tuple[str, ...]  # the run's stages, in the pipeline's order
    stage: str  # the stage this step runs

    def __post_init__(self) -> None:
        unknown = [s for s in (*self.stages, self.stage) if s not in STAGE_NAMES]
        if unknown or self.stage not in self.stages:
            raise ValueError(f"run {self.run_id}: stage {self.stage} among {self.stages}: not the pipeline's stages")

    @property
    def tables(self) -> frozenset[str]:
        return frozenset(t for stage in self.stages for t in TABLES_BY_STAGE[stage])



@dataclass(frozen=True)
class Partition:
    """One (table, model, layer) partition of a store: `<root>/<table>/model=<m>/layer=<l>/part-0.parquet`."""

    store: Store
    table: str
    model: str
    layer: int

    @property
    def file(self) -> UPath:
        """Where it is read and written: in place, or in the run's staging folder for a table the run writes."""
        return layout.partition_file(self.store.base(self.table), self.table, self.model, self.layer)

    @property
    def committed(self) -> Partition:
        """The same partition in place under the root (what a run that stages it replaces)."""
        return Partition(Store(self.store.root), self.table, self.model, self.layer)

    @property
    def url(self) -> str:
        """Its file's url in place (where the run's commit puts a staged one)."""
        return url(self.committed.file)

    @property
    def relative(self) -> str:
        """The file's path within the data root (what metadata records: right wherever the root is moved)."""
        return self.url[len(url(self.store.root)):].lstrip("/")

    @property
    def _staged_base(self) -> UPath | None:
        return None if self.store.run is None or self.table not in self.store.run.tables else self.store.base(self.table)

    def exists(self) -> bool:
        return self.file.exists()

    @contextmanager
    def writer(self) -> Iterator[layout.ParquetSink]:
        """Append row groups with `sink.write(rows)`; committed whole on a normal exit, never seen otherwise."""
        self.store.claim()
        with layout.partition_writer(self.store.root, self.table, self.model, self.layer, self.validate,
                                     self._staged_base) as sink:
            yield sink

    def write(self, table: pa.Table) -> UPath:
        """Replace the partition whole with `table` (in the run's staging folder, in a run); returns its file."""
        self.store.claim()
        return layout.write_partition(self.store.root, self.table, self.model, self.layer, table, self.validate,
                                      self._staged_base)

    def validate(self, table: pa.Table) -> None:
        """SchemaError unless `table` has this table's declared columns and types (updatelens.schemas):
        checked before a byte of it is written."""
        schemas.check(self.table, table)

    def require(self) -> UPath:
        """The file; FileNotFoundError naming the partition when it is not materialized."""
        return layout.existing_partition_file(self.store.root, self.table, self.model, self.layer, self._staged_base)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All or some columns (the scalar ones are small whatever the vectors weigh)."""
        return layout.read_file(self.require(), columns)

    def parts(self, columns: list[str] | None = None) -> Iterator[pa.Table]:
        """One row group at a time (memory: one row group)."""
        return layout.iter_parts(self.file, columns)

    def seqs(self, lo: int, hi: int, columns: list[str] | None = None) -> pa.Table:
        """The rows of sequences lo <= seq < hi (only the row groups that hold them are read)."""
        return layout.read_seq_range(self.file, lo, hi, columns)

    def delete(self) -> None:
        layout.delete_partition(self.store.base(self.table), self.table, self.model, self.layer)


@dataclass(frozen=True)
class Store:
    root: UPath
    run: RunScope | None = None  # a run's view: its stages' tables staged (RunScope)

    @classmethod
    def open(cls, root: str | os.PathLike[str] | UPath) -> Store:
        return cls(as_root(root))

    def for_run(self, run: RunScope) -> Store:
        """The store as a run's step sees it (RunScope)."""
        return Store(self.root, run)

    def base(self, table: str) -> UPath:
        """The folder a table's partitions are under: the run's staging folder for its stages' tables."""
        if self.run is not None and table in self.run.tables:
            return staging.run_dir(self.root, self.run.run_id)
        return self.root

    def claim(self) -> None:
        """In a run: its staging folder, naming this process as its writer (a clean leaves it alone)."""
        if self.run is not None:
            staging.claim_run_dir(self.root, self.run.run_id)

    def stage_done(self) -> bool:
        """In a run: record that this step's stage has written all it writes; True once every stage of
        the run has (the step that sees it commits). Outside a run: True."""
        if self.run is None:
            return True
        return set(self.run.stages) <= staging.stage_done(self.root, self.run.run_id, self.run.stage)

    def commit(self) -> list[str]:
        """Swap what the run staged into place (layout.commit_run), under the locks of its layers;
        returns the partitions swapped in ([] outside a run)."""
        if self.run is None:
            return []
        staged = staging.staged_partitions(staging.run_dir(self.root, self.run.run_id))
        layers: dict[str, set[int]] = {}
        for relative in staged:
            _, model, layer = relative.split("/")
            layers.setdefault(model.removeprefix("model="), set()).add(int(layer.removeprefix("layer=")))
        with ExitStack() as stack:
            for model in sorted(layers):
                stack.enter_context(self.lock(model, layers[model]))
            return staging.commit_run(self.root, self.run.run_id)

    def staged_elsewhere(self, tables: Iterable[str], model: str, layers: Iterable[int],
                         run_going: Callable[[str], bool | None] | None = None) -> dict[str, list[str]]:
        """{another run that is going: the partitions of `tables` for these layers that this store reads
        in place and that run has staged, not yet swapped in} (storage.staging.staged_elsewhere)."""
        own = self.run.tables if self.run is not None else frozenset()
        wanted = {f"{table}/model={model}/layer={layer}" for table in tables if table not in own for layer in layers}
        return staging.staged_elsewhere(self.root, self.run.run_id if self.run is not None else "", wanted, run_going)

    @property
    def url(self) -> str:
        return url(self.root)

    def partition(self, table: str, model: str, layer: int) -> Partition:
        return Partition(self, table, model, layer)

    def has_files(self, table: str) -> bool:
        return layout.has_files(self.root, table)

    def has_model(self, table: str, model: str) -> bool:
        return layout.has_model(self.root, table, model)

    # ---- locks and housekeeping ------------------------------------------------------------------
    @contextmanager
    def lock(self, model: str, layers: Iterable[int] | None = None) -> Iterator[None]:
        """The locks of a model's layers (concurrent runs writing them go one after the other), or of
        the whole model when `layers` is None."""
        with (layout.model_lock(self.root, model) if layers is None
              else layout.partition_locks(self.root, model, layers)):
            yield

    def clean_abandoned_staging(self, run_going: Callable[[str], bool | None] | None = None) -> list[str]:
        return staging.clean_abandoned_staging(self.root, run_going)

    # ---- integrity -------------------------------------------------------------------------------
    def damaged(self) -> list[Damaged]:
        return catalog.verify_root(self.root).damaged

    def incomplete_layers(self) -> list[tuple[str, int, list[str]]]:
        return incomplete_layers(self.root, TABLES)

    # ---- the SQL catalog -------------------------------------------------------------------------
    def refresh(self) -> list[str]:
        """Re-create the catalog's views over the files that verify; returns the view names."""
        return catalog.refresh(self.root)

    def query(self, sql: str, params: list[object] | None = None, write: bool = False) -> pl.DataFrame:
        return catalog.query(self.root, sql, params, write)

    def reading(self) -> AbstractContextManager[Callable[[str, list[object] | None], pl.DataFrame]]:
        """Several reading statements over one connection: `with store.reading() as query: query(sql, params)`."""
        return catalog.reading(self.root)

    def catalog_path(self) -> Path | None:
        return catalog.catalog_path(self.root)
