"""Hive layout `<root>/<table>/model=<slug>/layer=<l>/part-0.parquet`, written atomically.

The root is a local folder or an object-store URL (storage.location); this module is the one
place that writes, lists or deletes under it.

Local root: a partition is written whole into `<root>/_staging/<uuid>/`, then swapped into place
with two renames on the same filesystem (old -> staging, new -> final). A reader globbing
`<root>/<table>/*/*/*.parquet` therefore sees either the old partition or the new one, never a
mix or a truncated file; a crash between the renames leaves the partition absent (and the next
run redoes it), never half-written.

A run stages its partitions in its own folder and swaps them in at its end (storage.staging): a run
that stops midway leaves the stored partitions as they were.

Object store: there is no rename, but a single object is atomic (a PUT or a server-side COPY
becomes visible whole or not at all). A partition is one object: it is written to a local temp
file, uploaded to a temporary key `<root>/_staging/<uuid>/...`, then committed by a server-side
copy onto its final key, so readers see the old object or the new one; the temporary key is
removed after. A folder of several files (a report) is committed file by file with its entry
file (`index.html`, self-contained) last.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from updatelens.storage.integrity import MANIFEST, PART_FILE, layer_of, partition_error, quarantine, write_manifest
from updatelens.storage.location import RootLike, as_root, is_local, key_value, local_path, url

# a local path or an object-store one (storage.location.as_root makes either a UPath)
PathLike = RootLike
STAGING = "_staging"
# beside a `<pid>-<uuid>.old` folder moved out of its place (the two-rename fallback of staged_dir):
# where it came from, so that an abandoned one is put back when nothing replaced it
TARGET_SUFFIX = ".target"
LOCKS = "_locks"
DAGSTER_DIR = "_dagster"  # a local data root's own Dagster instance (orchestration.runner.root_dagster_home)
ROW_GROUP_ROWS = 8192
# Files committed last when a folder is published to an object store (readers open these first).
ENTRY_FILES = ("index.html", PART_FILE, "run.parquet", MANIFEST)  # committed last, the manifest after its file
# Object-store staging keys older than this are from a crashed writer (no pid to ask there).
STALE_STAGING_S = 3600.0
LOCK_DIR_ENV = "UPDATELENS_LOCK_DIR"


def partition_dir(root: RootLike, table: str, model: str, layer: int) -> UPath:
    return as_root(root) / table / f"model={model}" / f"layer={layer}"


def partition_file(root: RootLike, table: str, model: str, layer: int) -> UPath:
    return partition_dir(root, table, model, layer) / PART_FILE


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging_dir(root: UPath) -> UPath:
    # the pid lets a later run tell an abandoned staging dir (its writer is dead) from a live one
    return root / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}"


class ParquetSink:
    """Row groups appended to one Parquet file as they come (the file is opened on the first write,
    with that table's schema; `validate`, when given, is called on every table before it is written:
    the store checks each against its declared schema). `close` fsyncs it."""

    def __init__(self, path: Path, table_name: str, partition: tuple[str, int] | None = None,
                 validate: Callable[[pa.Table], None] | None = None) -> None:
        self.path = path
        self.table_name = table_name
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._validate = validate
        # the manifest names the partition it holds: verification compares it with the folder
        self._provenance: dict[str, object] = {"model": partition[0], "layer": partition[1]} if partition else {}

    def write(self, table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS) -> None:
        if self._validate is not None:
            self._validate(table)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="zstd")
            self._provenance |= {c: str(table[c][0].as_py()) for c in ("config_id", "code_version", "model_revision")
                                 if c in table.column_names and len(table)}
        for batch in table.to_batches(max_chunksize=row_group_rows):
            self._writer.write_batch(batch)
            self.rows += batch.num_rows

    def close(self) -> None:
        if self._writer is None:
            raise ValueError(f"nothing was written to {self.path}: a partition is never committed empty")
        self._writer.close()
        with open(self.path, "rb+") as f:
            os.fsync(f.fileno())
        # the manifest sits beside the file in the same staging folder: it is committed with the data
        write_manifest(self.path, self.table_name, self.rows, self._provenance)


def _write_parquet(table: pa.Table, path: Path, table_name: str, partition: tuple[str, int] | None = None,
                   validate: Callable[[pa.Table], None] | None = None) -> None:
    sink = ParquetSink(path, table_name, partition, validate)
    sink.write(table)
    sink.close()


@contextmanager
def staged_dir(root: PathLike, final: PathLike) -> Iterator[Path]:
    """A local folder to fill; on a normal exit it becomes `final` whole: readers see the old
    directory or the new one, never a half-written file (module docstring). On an exception
    nothing under `final` changes and the folder is removed."""
    root, final = as_root(root), as_root(final)
    if not is_local(root):
        with tempfile.TemporaryDirectory(prefix="updatelens-publish-") as tmp:
            yield Path(tmp)
            _commit_remote(root, final, Path(tmp))
        return
    staging = _staging_dir(root)
    staging.mkdir(parents=True)
    try:
        yield Path(str(staging))
        _install(root, staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(str(staging), ignore_errors=True)


def _install(root: UPath, staging: PathLike, final: PathLike) -> None:
    """Make the local folder `staging` (on the root's file system) `final`, whole: readers of `final`
    see the old folder or the new one. `staging` is left holding nothing of value (removed or emptied)."""
    new, target = Path(str(staging)), Path(str(final))
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        os.rename(new, target)
        _fsync_dir(target.parent)
        return
    # judged where they stand: the run's staleness check has usually verified them already (a partition's
    # folder only: a sweep's run record or a report is no partition, and was judged one)
    damaged = ({f.name: reason for f in target.glob("*.parquet") if (reason := partition_error(f))}
               if layer_of(target.name) is not None else {})
    if _exchange(new, target):  # one atomic step: `staging` now holds the old folder
        old = new
    else:  # two renames; a crash between them leaves `final` absent until staging.clean_abandoned_staging
        old = Path(str(root / STAGING)) / f"{os.getpid()}-{uuid.uuid4().hex}.old"
        old.parent.mkdir(parents=True, exist_ok=True)
        (old.parent / f"{old.name}{TARGET_SUFFIX}").write_text(str(target))
        os.rename(target, old)
        os.rename(new, target)
    _fsync_dir(target.parent)
    _keep_damaged(root, as_root(old), as_root(target), damaged)
    shutil.rmtree(old, ignore_errors=True)
    (old.parent / f"{old.name}{TARGET_SUFFIX}").unlink(missing_ok=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: UPath | Path, b: UPath | Path) -> bool:
    """Swap two local paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE), so a reader
    of `b` always finds the old folder or the new one; False where the system or the filesystem
    cannot (the caller then renames twice)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _keep_damaged(root: UPath, old: UPath, final: UPath, damaged: dict[str, str]) -> None:
    """The damaged files of a replaced partition (name -> reason, judged before it moved to `old`)
    go to the quarantine, not away with it."""
    for name, reason in damaged.items():
        relative = f"{str(final).removeprefix(str(root)).lstrip('/')}/{name}"
        where = quarantine(root, old / name, relative)
        warnings.warn(f"replaced a damaged partition file ({reason}); kept it at {where}", stacklevel=2)


def publish_dir(root: PathLike, final: PathLike, fill: Callable[[Path], None]) -> UPath:
    """Build a directory with `fill(staging)` (a local folder), then make it `final` whole."""
    with staged_dir(root, final) as staging:
        fill(staging)
    return as_root(final)


@contextmanager
def partition_writer(root: RootLike, table_name: str, model: str, layer: int,
                     validate: Callable[[pa.Table], None] | None = None,
                     base: RootLike | None = None) -> Iterator[ParquetSink]:
    """Write one partition incrementally (`sink.write(rows)` per batch); it is committed whole when
    the block exits normally, and never appears if it fails. Memory: one batch at a time. Under
    `base` (a run's staging folder, storage.staging) where given, else in its place under the root."""
    final = partition_dir(base or root, table_name, model, layer)
    with staged_dir(root, final) as staging:
        sink = ParquetSink(staging / PART_FILE, table_name, (model, layer), validate)
        yield sink
        sink.close()


def _commit_remote(root: UPath, final: UPath, tmp: Path) -> None:
    fs = root.fs
    staging = _staging_dir(root)
    names = sorted((p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()),
                   key=lambda name: (ENTRY_FILES.index(name) + 1 if name in ENTRY_FILES else 0, name))
    try:
        for name in names:  # upload to temporary keys: nothing under `final` changes yet
            fs.put_file(str(tmp / name), (staging / name).path)
        _quarantine_damaged_remote(root, final)
        for name in names:  # commit: one server-side copy per object, the entry file last
            fs.copy((staging / name).path, (final / name).path)
        new = {(final / name).path for name in names}
        stale = [key for key in _find(final) if key not in new]
        if stale:  # what the previous version had and this one lacks
            fs.rm(stale)
    finally:
        if _find(staging):
            fs.rm(staging.path, recursive=True)


def _quarantine_damaged_remote(root: UPath, final: UPath) -> None:
    """On an object store, the damaged Parquet objects of a partition about to be replaced go to the
    quarantine (with their manifest) instead of being overwritten."""
    for key in _find(final):
        if key.endswith(".parquet"):
            file = final / key.removeprefix(final.path).lstrip("/")
            if reason := partition_error(file):
                where = quarantine(root, file)
                warnings.warn(f"replaced a damaged partition file ({reason}); kept it at {url(where)}", stacklevel=2)


def _find(path: UPath) -> list[str]:
    """Every object key under `path` on an object store ([] when there is none)."""
    fs = path.fs
    fs.invalidate_cache()
    return list(fs.find(path.path))


def read_schema(path: PathLike) -> pa.Schema:
    """The Arrow schema of one Parquet file of the store (its footer only)."""
    path = as_root(path)
    if is_local(path):
        return pq.read_schema(path)
    with path.fs.open(path.path, "rb") as f:
        return pq.read_schema(f)


def read_file(path: PathLike, columns: list[str] | None = None) -> pa.Table:
    """Read one Parquet file of the store (local path or object URL), all or some of its columns."""
    path = as_root(path)
    if is_local(path):
        return pq.read_table(path, columns=columns)
    return pq.read_table(path.path, columns=columns, filesystem=path.fs)


def iter_parts(path: PathLike, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """A stored file one row group at a time (memory: one row group)."""
    path = as_root(path)
    handle = open(local_path(path), "rb") if is_local(path) else path.fs.open(path.path, "rb")
    with handle, pq.ParquetFile(handle) as pf:
        for i in range(pf.num_row_groups):
            yield pf.read_row_group(i, columns=columns)


def read_seq_range(path: PathLike, lo: int, hi: int, columns: list[str] | None = None) -> pa.Table:
    """The rows of sequences lo <= seq < hi of a stored file: only the row groups whose `seq`
    statistics overlap the range are read (the writers keep row groups in sequence order)."""
    path = as_root(path)
    filters = [("seq", ">=", lo), ("seq", "<", hi)]
    if is_local(path):
        return pq.read_table(path, columns=columns, filters=filters)
    return pq.read_table(path.path, filesystem=path.fs, columns=columns, filters=filters)


def write_partition(root: RootLike, table_name: str, model: str, layer: int, table: pa.Table,
                    validate: Callable[[pa.Table], None] | None = None, base: RootLike | None = None) -> UPath:
    """Replace one partition whole (`validate` called on the table first; under `base`, a run's staging
    folder, where given); returns the file's path."""
    final = partition_dir(base or root, table_name, model, layer)
    publish_dir(root, final, lambda staging: _write_parquet(table, staging / PART_FILE, table_name, (model, layer),
                                                            validate))
    return final / PART_FILE


def lock_dir(root: RootLike) -> Path:
    """Lock files: `<root>/_locks` for a local root; for an object store a local folder per root
    ($UPDATELENS_LOCK_DIR or the temp dir), which serialises the processes of one host only:
    across hosts, single-object commits keep every partition whole (last writer wins)."""
    root = as_root(root)
    if is_local(root):
        return local_path(root) / LOCKS
    base = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "updatelens-locks")
    return base / hashlib.sha1(url(root).encode()).hexdigest()[:16]


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def model_lock(root: RootLike, model: str) -> Iterator[None]:
    """Serialise whole-model operations (a convention sweep replacing the model's sweep)."""
    with _flock(lock_dir(root) / f"{model}.lock"):
        yield


@contextmanager
def partition_locks(root: RootLike, model: str, layers: Iterable[int]) -> Iterator[None]:
    """Serialise the steps of concurrent runs that write the same (model, layer) partitions; runs
    on other layers or models proceed in parallel. Taken in layer order, so never deadlocks."""
    with ExitStack() as stack:
        for layer in sorted(set(layers)):
            stack.enter_context(_flock(lock_dir(root) / f"{model}.layer={layer}.lock"))
        yield


def existing_partition_file(root: RootLike, table_name: str, model: str, layer: int,
                            base: RootLike | None = None) -> UPath:
    """A partition's file (under `base`, a run's staging folder, where given); FileNotFoundError naming
    the partition when it is not there."""
    path = partition_file(base or root, table_name, model, layer)
    if not path.exists():
        if base is not None:
            raise FileNotFoundError(f"{table_name} for model={model} layer={layer} was staged by this run at "
                                    f"{url(path)} and is gone (its staging folder was removed while the run "
                                    "went on); rerun")
        raise FileNotFoundError(f"{table_name} for model={model} layer={layer} is not materialized "
                                f"({url(path)}); materialize the upstream asset first")
    return path


def read_partition(root: RootLike, table_name: str, model: str, layer: int,
                   columns: list[str] | None = None) -> pa.Table:
    """All or some columns of one partition (the scalar ones are small whatever the vectors weigh)."""
    return read_file(existing_partition_file(root, table_name, model, layer), columns)


def _remove_dir(root: UPath, path: UPath) -> bool:
    """Locally: rename a directory out of sight, then delete it. On an object store: delete its
    objects (each a whole partition file). False if it was not there."""
    if not is_local(root):
        keys = _find(path)
        if keys:
            root.fs.rm(keys)
        return bool(keys)
    if not path.exists():
        return False
    trash = root / STAGING / f"{os.getpid()}-{uuid.uuid4().hex}.old"
    trash.parent.mkdir(parents=True, exist_ok=True)
    os.rename(str(path), str(trash))
    shutil.rmtree(str(trash), ignore_errors=True)
    return True


def delete_partition(root: RootLike, table_name: str, model: str, layer: int) -> None:
    _remove_dir(as_root(root), partition_dir(root, table_name, model, layer))


def _any(base: UPath, pattern: str) -> bool:
    if not is_local(base):
        base.fs.invalidate_cache()
    return any(base.glob(pattern))


def has_files(root: RootLike, table_name: str) -> bool:
    return _any(as_root(root) / table_name, f"model=*/layer=*/{PART_FILE}")


def has_model(root: RootLike, table_name: str, model: str) -> bool:
    return _any(as_root(root) / table_name / f"model={model}", f"layer=*/{PART_FILE}")


# ---- convention sweeps --------------------------------------------------------------------------
# A sweep stores each configuration's analysis tables under `<root>/sweeps/config=<id>/` with the
# same layout as the main tables (so the same writer and the same SQL apply), and one record per
# (model, config) in `<root>/sweeps/runs/model=<slug>/config=<id>/run.parquet` saying which
# convention that configuration varies. Written last, the record is what makes a config visible
# in the `sensitivity` view.
SWEEPS = "sweeps"  # its tables: updatelens.stages.SWEEP_TABLES
SWEEP_RUN_FILE = "run.parquet"


def sweep_root(root: RootLike, config_id: str) -> UPath:
    return as_root(root) / SWEEPS / f"config={config_id}"


def sweep_runs_dir(root: RootLike, model: str) -> UPath:
    return as_root(root) / SWEEPS / "runs" / f"model={model}"


def sweep_runs_glob() -> str:
    """The sweep records under a root, as a glob relative to it."""
    return f"{SWEEPS}/runs/model=*/config=*/{SWEEP_RUN_FILE}"


def has_sweep_runs(root: RootLike) -> bool:
    return _any(as_root(root) / SWEEPS / "runs", f"model=*/config=*/{SWEEP_RUN_FILE}")


def write_sweep_run(root: RootLike, model: str, config_id: str, record: pa.Table) -> UPath:
    final = sweep_runs_dir(root, model) / f"config={config_id}"
    publish_dir(root, final, lambda staging: _write_parquet(record, staging / SWEEP_RUN_FILE, "sweep_runs"))
    return final / SWEEP_RUN_FILE


# `<root>/sweeps/_next/<pid>-<uuid>/sweeps/config=<id>/...`: a sweep being computed (a root of its own,
# laid out as the root's sweeps), seen by no view
NEXT_SWEEP = "_next"


def next_sweep_root(root: RootLike) -> UPath:
    """Where a sweep in progress writes its configurations' tables (a root whose sweeps are the new
    sweep: `sweep_root(next_sweep_root(root), config_id)` per configuration), out of the catalog's sight until
    `promote_sweep`; the pid tells an abandoned one (its process is gone) from a live one."""
    return as_root(root) / SWEEPS / NEXT_SWEEP / f"{os.getpid()}-{uuid.uuid4().hex}"


def promote_sweep(root: RootLike, staged: UPath, model: str,
                  records: dict[str, pa.Table]) -> None:
    """Replace a model's sweep with the complete one computed under `staged` (`next_sweep_root`), whose
    run records are `records` (config id -> record). Each partition moves into place whole (the old
    one or the new one, never a half-written file), then the new records are written, then the
    configurations the new sweep does not have lose their records, then their partitions: a process
    stopped on the way leaves the previous sweep's records listing complete partitions (of the
    previous sweep or, for a configuration both have, of the new one), never a partial one. On an
    object store (no renames) the previous sweep is cleared first and the new one copied in."""
    root = as_root(root)
    installed: set[str] = set()
    if not is_local(root):
        clear_sweeps(root, model)
        for key in _find(staged / SWEEPS):
            relative = key[len((staged / SWEEPS).path):].lstrip("/")
            if relative.startswith("config=") and f"/model={model}/" in f"/{relative}":
                root.fs.copy(key, (root / SWEEPS / relative).path)
    else:
        for partition in sorted((staged / SWEEPS).glob(f"config=*/*/model={model}/layer=*"), key=str):
            relative = str(partition).removeprefix(str(staged / SWEEPS)).lstrip("/")
            _install(root, partition, root / SWEEPS / relative)
            installed.add(relative)
    for config_id, record in records.items():
        write_sweep_run(root, model, config_id, record)
    runs = sweep_runs_dir(root, model)
    dropped = [d for d in sorted(runs.glob("config=*"), key=str) if key_value(d.name) not in records]
    for directory in dropped:
        _remove_dir(root, directory)
    if not is_local(root):
        return  # the previous sweep was cleared before the copy
    # what the new sweep does not have: the dropped configurations' partitions, and the layers and
    # tables of a configuration both sweeps have that the new one left out
    for partition in sorted((root / SWEEPS).glob(f"config=*/*/model={model}/layer=*"), key=str):
        if str(partition).removeprefix(str(root / SWEEPS)).lstrip("/") not in installed:
            _remove_dir(root, partition)
            with contextlib.suppress(OSError):
                os.rmdir(str(partition.parent))  # the model's folder, once empty


def remove_next_sweep(root: RootLike, staged: UPath) -> None:
    """Remove a sweep's staged tables (after its promotion, or its failure)."""
    root = as_root(root)
    _remove_dir(root, staged)
    if is_local(root):
        with contextlib.suppress(OSError):
            os.rmdir(str(staged.parent))  # `_next`, when no other sweep is in progress


def clear_sweeps(root: RootLike, model: str) -> int:
    """Remove a model's sweep records and partitions (a rerun of its sweep replaces it whole);
    returns how many directories went. Records go first, so no half-removed config is listed."""
    root = as_root(root)
    sweeps = root / SWEEPS
    if not is_local(root):
        root.fs.invalidate_cache()
    dirs = [sweep_runs_dir(root, model), *sorted(sweeps.glob(f"config=*/*/model={model}"), key=str)]
    return sum(_remove_dir(root, path) for path in dirs)


# ---- convergence studies ------------------------------------------------------------------------
# `updatelens converge` analyses nested samples of one model (the first n_seq windows, for growing
# n_seq); each sample size is a whole data root of its own under `<root>/convergence/n_seq=<n>/`
# (the same layout, writers and SQL), and the catalog reads them all as the `conv_` family.
CONVERGENCE = "convergence"


def convergence_root(root: RootLike, n_seq: int) -> UPath:
    return as_root(root) / CONVERGENCE / f"n_seq={n_seq}"
