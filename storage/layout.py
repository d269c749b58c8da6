"""Hive layout `<root>/<table>/model=<slug>/layer=<l>/part-0.parquet`, written atomically.

A partition is written whole into `<root>/_staging/<uuid>/`, then swapped into place with two
renames on the same filesystem (old -> staging, new -> final). A reader globbing
`<root>/<table>/*/*/*.parquet` therefore sees either the old partition or the new one, never a
mix or a truncated file; a crash between the renames leaves the partition absent (and the next
run redoes it), never half-written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Every table the pipeline writes, by the asset that writes it.
TABLES_BY_ASSET: dict[str, tuple[str, ...]] = {
    "activations": ("activations",),
    "local_fits": ("local_fits",),
    "residuals": ("residuals",),
    "geometry": ("geometry", "spectra"),
    "functional_metrics": ("functional_metrics", "functional_summary"),
}
TABLES: tuple[str, ...] = tuple(t for ts in TABLES_BY_ASSET.values() for t in ts)
STAGING = "_staging"
PART_FILE = "part-0.parquet"


def partition_dir(root: Path, table: str, model: str, layer: int) -> Path:
    return Path(root) / table / f"model={model}" / f"layer={layer}"


def partition_file(root: Path, table: str, model: str, layer: int) -> Path:
    return partition_dir(root, table, model, layer) / PART_FILE


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_partition(root: Path, table_name: str, model: str, layer: int, table: pa.Table) -> Path:
    """Replace one partition whole; returns the final file path."""
    root = Path(root)
    staging = root / STAGING / uuid.uuid4().hex
    staging.mkdir(parents=True)
    tmp_file = staging / PART_FILE
    try:
        pq.write_table(table, tmp_file, compression="zstd")
        with open(tmp_file, "rb+") as f:
            os.fsync(f.fileno())
        final = partition_dir(root, table_name, model, layer)
        final.parent.mkdir(parents=True, exist_ok=True)
        old = None
        if final.exists():
            old = root / STAGING / f"{uuid.uuid4().hex}.old"
            os.rename(final, old)
        os.rename(staging, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final / PART_FILE
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def read_partition(root: Path, table_name: str, model: str, layer: int) -> pa.Table:
    path = partition_file(root, table_name, model, layer)
    if not path.exists():
        raise FileNotFoundError(f"{table_name} for model={model} layer={layer} is not materialized "
                                f"({path}); materialize the upstream asset first")
    return pq.read_table(path)


def delete_partition(root: Path, table_name: str, model: str, layer: int) -> None:
    path = partition_dir(root, table_name, model, layer)
    if path.exists():
        trash = Path(root) / STAGING / f"{uuid.uuid4().hex}.old"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def has_files(root: Path, table_name: str) -> bool:
    return any((Path(root) / table_name).glob(f"model=*/layer=*/{PART_FILE}"))


def glob_pattern(root: Path, table_name: str) -> str:
    return str(Path(root).resolve() / table_name / "model=*" / "layer=*" / "*.parquet")
