"""Hive layout `<root>/<table>/model=<slug>/layer=<l>/part-0.parquet`, written atomically.

A partition is written whole into `<root>/_staging/<uuid>/`, then swapped into place with two
renames on the same filesystem (old -> staging, new -> final). A reader globbing
`<root>/<table>/*/*/*.parquet` therefore sees either the old partition or the new one, never a
mix or a truncated file; a crash between the renames leaves the partition absent (and the next
run redoes it), never half-written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
LOCKS = "_locks"
PART_FILE = "part-0.parquet"
ROW_GROUP_ROWS = 8192
# Fault injection for the crash tests: SIGKILL this process in the middle of writing a partition of
# this table (after its first row group reached the staging file, before the rename).
KILL_MID_WRITE_ENV = "UPDATELENS_FAULT_KILL_MID_WRITE"


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


def _staging_dir(root: Path) -> Path:
    # the pid lets a later run tell an abandoned staging dir (its writer is dead) from a live one
    return Path(root) / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}"


def _write_parquet(table: pa.Table, path: Path, table_name: str) -> None:
    kill = os.environ.get(KILL_MID_WRITE_ENV) == table_name
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for i, batch in enumerate(table.to_batches(max_chunksize=ROW_GROUP_ROWS if not kill else max(1, len(table) // 2))):
            writer.write_batch(batch)
            if kill and i == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def publish_dir(root: Path, final: Path, fill: Callable[[Path], None]) -> Path:
    """Build a directory with `fill(staging)` under `<root>/_staging`, then swap it into `final`
    with two renames: readers see the old directory or the new one, never a half-written one."""
    root = Path(root)
    staging = _staging_dir(root)
    staging.mkdir(parents=True)
    try:
        fill(staging)
        final.parent.mkdir(parents=True, exist_ok=True)
        old = None
        if final.exists():
            old = root / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}.old"
            os.rename(final, old)
        os.rename(staging, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def write_partition(root: Path, table_name: str, model: str, layer: int, table: pa.Table) -> Path:
    """Replace one partition whole; returns the final file path."""
    final = partition_dir(root, table_name, model, layer)
    publish_dir(root, final, lambda staging: _write_parquet(table, staging / PART_FILE, table_name))
    return final / PART_FILE


def clean_abandoned_staging(root: Path) -> list[str]:
    """Remove staging dirs whose writer process is gone (a crash mid-write); returns their names."""
    removed = []
    for entry in (Path(root) / STAGING).glob("*"):
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def model_lock(root: Path, model: str) -> Iterator[None]:
    """Serialise the steps of concurrent runs on the same model (different models run in parallel)."""
    path = Path(root) / LOCKS / f"{model}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_partition(root: Path, table_name: str, model: str, layer: int) -> pa.Table:
    path = partition_file(root, table_name, model, layer)
    if not path.exists():
        raise FileNotFoundError(f"{table_name} for model={model} layer={layer} is not materialized "
                                f"({path}); materialize the upstream asset first")
    return pq.read_table(path)


def _remove_dir(root: Path, path: Path) -> bool:
    """Rename a directory out of sight, then delete it; False if it was not there."""
    if not path.exists():
        return False
    trash = Path(root) / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}.old"
    trash.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def delete_partition(root: Path, table_name: str, model: str, layer: int) -> None:
    _remove_dir(root, partition_dir(root, table_name, model, layer))


def has_files(root: Path, table_name: str) -> bool:
    return any((Path(root) / table_name).glob(f"model=*/layer=*/{PART_FILE}"))


def glob_pattern(root: Path, table_name: str) -> str:
    return str(Path(root).resolve() / table_name / "model=*" / "layer=*" / "*.parquet")


# ---- convention sweeps --------------------------------------------------------------------------
# A sweep stores each configuration's analysis tables under `<root>/sweeps/config=<id>/` with the
# same layout as the main tables (so the same writer and the same SQL apply), and one record per
# (model, config) in `<root>/sweeps/runs/model=<slug>/config=<id>/run.parquet` saying which
# convention that configuration varies. Written last, the record is what makes a config visible
# in the `sensitivity` view.
SWEEPS = "sweeps"
SWEEP_TABLES: tuple[str, ...] = ("geometry", "spectra", "functional_metrics", "functional_summary")
SWEEP_RUN_FILE = "run.parquet"


def sweep_root(root: Path, config_id: str) -> Path:
    return Path(root) / SWEEPS / f"config={config_id}"


def sweep_glob_pattern(root: Path, table_name: str) -> str:
    return str(Path(root).resolve() / SWEEPS / "config=*" / table_name / "model=*" / "layer=*" / "*.parquet")


def has_sweep_files(root: Path, table_name: str) -> bool:
    return any((Path(root) / SWEEPS).glob(f"config=*/{table_name}/model=*/layer=*/{PART_FILE}"))


def sweep_runs_dir(root: Path, model: str) -> Path:
    return Path(root) / SWEEPS / "runs" / f"model={model}"


def sweep_runs_pattern(root: Path) -> str:
    return str(Path(root).resolve() / SWEEPS / "runs" / "model=*" / "config=*" / SWEEP_RUN_FILE)


def has_sweep_runs(root: Path) -> bool:
    return any((Path(root) / SWEEPS / "runs").glob(f"model=*/config=*/{SWEEP_RUN_FILE}"))


def write_sweep_run(root: Path, model: str, config_id: str, record: pa.Table) -> Path:
    final = sweep_runs_dir(root, model) / f"config={config_id}"
    publish_dir(root, final, lambda staging: _write_parquet(record, staging / SWEEP_RUN_FILE, "sweep_runs"))
    return final / SWEEP_RUN_FILE


def clear_sweeps(root: Path, model: str) -> int:
    """Remove a model's sweep records and partitions (a rerun of its sweep replaces it whole);
    returns how many directories went. Records go first, so no half-removed config is listed."""
    dirs = [sweep_runs_dir(root, model), *sorted((Path(root) / SWEEPS).glob(f"config=*/*/model={model}"))]
    return sum(_remove_dir(root, path) for path in dirs)
