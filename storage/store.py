"""A data root opened once: its partitions (write, read, lock) and its SQL catalog.

`Store.open(root)` takes a local folder or an object-store URL (storage.location) and normalises
it once; the stages, the reports and the commands then work through it instead of passing the
root around as a string. Each operation is the layout's, catalog's or integrity's function of the
same name (those modules stay the implementation and the API for scripts that hold a path).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
from upath import UPath

from updatelens import schemas
from updatelens.stages import TABLES
from updatelens.storage import catalog, layout
from updatelens.storage.integrity import Damaged, incomplete_layers
from updatelens.storage.location import as_root, url


@dataclass(frozen=True)
class Partition:
    """One (table, model, layer) partition of a store: `<root>/<table>/model=<m>/layer=<l>/part-0.parquet`."""

    store: Store
    table: str
    model: str
    layer: int

    @property
    def file(self) -> UPath:
        return layout.partition_file(self.store.root, self.table, self.model, self.layer)

    @property
    def url(self) -> str:
        return url(self.file)

    @property
    def relative(self) -> str:
        """The file's path within the data root (what metadata records: right wherever the root is moved)."""
        return self.url[len(url(self.store.root)):].lstrip("/")

    def exists(self) -> bool:
        return self.file.exists()

    @contextmanager
    def writer(self) -> Iterator[layout.ParquetSink]:
        """Append row groups with `sink.write(rows)`; committed whole on a normal exit, never seen otherwise."""
        with layout.partition_writer(self.store.root, self.table, self.model, self.layer, self.validate) as sink:
            yield sink

    def write(self, table: pa.Table) -> UPath:
        """Replace the partition whole with `table`; returns its file."""
        return layout.write_partition(self.store.root, self.table, self.model, self.layer, table, self.validate)

    def validate(self, table: pa.Table) -> None:
        """SchemaError unless `table` has this table's declared columns and types (updatelens.schemas):
        checked before a byte of it is written."""
        schemas.check(self.table, table)

    def require(self) -> UPath:
        """The file; FileNotFoundError naming the partition when it is not materialized."""
        return layout.existing_partition_file(self.store.root, self.table, self.model, self.layer)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All or some columns (the scalar ones are small whatever the vectors weigh)."""
        return layout.read_partition(self.store.root, self.table, self.model, self.layer, columns)

    def parts(self, columns: list[str] | None = None) -> Iterator[pa.Table]:
        """One row group at a time (memory: one row group)."""
        return layout.iter_parts(self.file, columns)

    def seqs(self, lo: int, hi: int, columns: list[str] | None = None) -> pa.Table:
        """The rows of sequences lo <= seq < hi (only the row groups that hold them are read)."""
        return layout.read_seq_range(self.file, lo, hi, columns)

    def delete(self) -> None:
        layout.delete_partition(self.store.root, self.table, self.model, self.layer)


@dataclass(frozen=True)
class Store:
    root: UPath

    @classmethod
    def open(cls, root: str | os.PathLike[str] | UPath) -> Store:
        return cls(as_root(root))

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

    def clean_abandoned_staging(self) -> list[str]:
        return layout.clean_abandoned_staging(self.root)

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

    def catalog_path(self) -> Path | None:
        return catalog.catalog_path(self.root)
