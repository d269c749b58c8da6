"""The DuckDB catalog: one view per table over its Parquet, plus derived views (their SQL, the
method's, is `updatelens.views`; this module verifies the files and registers the views over them).

Over 600 lines (about 650): verification, view registration, the catalog file's life (refresh,
set aside, the record of what was verified) and the read-only query path share the root's
fingerprint and the view digest; split apart, each would import the others' internals.

`layer_summary` is the public SQL interface: one row per (model, layer, fn_class, config_id);
`findings_by_class` and `findings` measure the paper's claims over it. Convention sweeps live in
their own tables (`sweep_geometry`, ...) with the same derived views prefixed `sweep_`, and
`sensitivity` shows how each finding moves with each convention.
Views are rebuilt after each materialization (and by `updatelens sql`), so they always cover
the partitions on disk; a view is created only for a table that has files.

On an object-store root (s3://...) DuckDB reads the Parquet through the root's fsspec filesystem,
registered on each connection (DuckDB's httpfs extension would need a download); the catalog file
is then not written (its views would only open where that filesystem is registered):
`connect()` / `query()` / `updatelens sql` build the views in memory instead.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

if TYPE_CHECKING:
    import polars as pl

from updatelens import CODE_VERSION, schemas
from updatelens.findings import (
    EXACT,
    JACKKNIFE_FIRST,
)
from updatelens.schemas import CONTROL_PREFIX
from updatelens.stages import STUDY_TABLES, SWEEP_TABLES, TABLES
from updatelens.storage.integrity import QUARANTINE, Damaged, scan
from updatelens.storage.layout import (
    CONVERGENCE,
    DAGSTER_DIR,
    LOCKS,
    STAGING,
    SWEEPS,
    has_sweep_runs,
    partition_file,
    sweep_runs_glob,
)
from updatelens.storage.location import RootLike, as_root, hive_value, is_local, key_value, local_path, url
from updatelens.views import (
    ACROSS_MODELS_SQL,
    CONTROL_REPLICATES,
    CONVERGENCE_SQL,
    NO_CONTROLS,
    NO_SAMPLED_SQL,
    SAMPLED_SQL,
    context_split_summary_sql,
    findings_sql,
    jackknife_half_width,
    layer_summary_sql,
    sensitivity_sql,
    sql_string,
)

CATALOG_FILE = "updatelens.duckdb"

def catalog_path(root: RootLike) -> Path | None:
    """The DuckDB file with the views, for a local root; None on an object store."""
    root = as_root(root)
    return local_path(root) / CATALOG_FILE if is_local(root) else None


def _read_parquet(files: list[str], hive_types: str) -> str:
    """The table expression over an explicit list of verified files (hive keys read from their paths)."""
    listed = ", ".join(sql_string(f) for f in files)
    return (f"read_parquet([{listed}], hive_partitioning = true, union_by_name = true, "
            f"hive_types = {{{hive_types}}})")


def _parquet_view(name: str, files: list[str], hive_types: str, select: str = "*") -> str:
    """A view over an explicit list of verified files."""
    return f"CREATE OR REPLACE VIEW {name} AS SELECT {select} FROM {_read_parquet(files, hive_types)}"


# Per-token tables whose views carry each token (`token_id`, `token`, `context`) from `tokens`. The
# others stay plain: layer_summary and the findings aggregate `geometry` and need no join.
WITH_TEXT = ("residuals", "functional_metrics")


def _text_view(name: str, files: list[str], hive_types: str) -> str:
    """A per-token view with the token's text joined from the `tokens` view (same model, layer,
    corpus slice, sequence and position)."""
    return (f"CREATE OR REPLACE VIEW {name} AS SELECT m.*, t.token_id, t.token, t.context FROM "
            f"{_read_parquet(files, hive_types)} m LEFT JOIN tokens t ON t.model = m.model AND t.layer = m.layer "
            f"AND t.corpus_slice = m.corpus_slice AND t.seq = m.seq AND t.pos = m.pos")


MAIN_HIVE = "'model': VARCHAR, 'layer': INTEGER"
SWEEP_HIVE = "'config': VARCHAR, 'model': VARCHAR, 'layer': INTEGER"  # rows carry config_id: `config=` dropped
CONV_HIVE = "'n_seq': INTEGER, 'model': VARCHAR, 'layer': INTEGER"  # n_seq is part of config_id: dropped


def damaged_view_sql(damaged: list[Damaged]) -> str:
    """`damaged_partitions(path, table_name, model, layer, reason)`: the files the views leave out,
    and the `tokens` partitions whose absence leaves the text columns NULL."""
    if not damaged:
        return ("CREATE OR REPLACE VIEW damaged_partitions AS SELECT NULL::VARCHAR AS path, NULL::VARCHAR AS "
                "table_name, NULL::VARCHAR AS model, NULL::INTEGER AS layer, NULL::VARCHAR AS reason WHERE false")
    rows = ", ".join(f"({sql_string(d.path)}, {sql_string(d.table)}, {sql_string(d.model)}, {d.layer}, "
                     f"{sql_string(d.reason)})" for d in damaged)
    return f"CREATE OR REPLACE VIEW damaged_partitions AS SELECT * FROM (VALUES {rows}) t(path, table_name, model, layer, reason)"


DERIVED_VIEWS = ("layer_summary", "layer_replicates", "layer_bands", "finding_replicates", "findings_by_class",
                 "findings")
# the derived relations computed into tables (FINDING_REPLICATES_SQL), per family prefix. layer_bands and
# findings stay views: as tables they made each refresh of the SmolLM2 root 1.15 s longer (1.70 -> 2.85 s),
# and a refresh follows every stage
DERIVED_TABLES = ("finding_replicates",)
FAMILY_PREFIXES = ("", "sweep_", "conv_", "control_", "conv_control_")
# the positive controls' tables (updatelens.steps.controls): the geometry stage's tables, one per control
CONTROL_TABLES = tuple(t for t in TABLES if t.startswith(CONTROL_PREFIX))
PLAIN_TABLES = tuple(t for t in TABLES if t not in CONTROL_TABLES)


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list[object] | None = None) -> tuple[Any, ...]:
    """The single row of an aggregate query."""
    row = con.execute(sql, params or []).fetchone()
    assert row is not None, sql
    return row


def _drop(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Drop the view or table `name` if there is one (a catalog of an older version may hold as a
    view what is now a table)."""
    if _one(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [name])[0]:
        con.execute(f"DROP TABLE {name}")
    con.execute(f"DROP VIEW IF EXISTS {name}")


def _create_family(con: duckdb.DuckDBPyConnection, present: set[str], prefix: str,
                   controls: str = NO_CONTROLS) -> list[str]:
    """layer_summary, findings_by_class and findings over one family of tables (main or sweep_).
    Where every stored file of a table predates a column the derived views read (results of an older
    version, all stale, while a run recomputes them), the derived views are left out until the
    rerun has written files with it: the per-table views still answer."""
    views = []
    try:
        if "geometry" in present:
            con.execute(layer_summary_sql("functional_summary" in present, prefix))
            views.append(f"{prefix}layer_summary")
        if {"geometry", "functional_summary", "spectra"} <= present:
            replicates = {"geometry_bootstrap", "functional_bootstrap"} <= present
            for table in DERIVED_TABLES:  # tables now: an older catalog's views go first
                _drop(con, f"{prefix}{table}")
            for statement in findings_sql(prefix, replicates, controls):
                con.execute(statement)
            views += [f"{prefix}layer_replicates", f"{prefix}layer_bands"] * replicates + [f"{prefix}finding_replicates",
                                                                   f"{prefix}findings_by_class", f"{prefix}findings"]
    except duckdb.BinderException:
        views = []
    for name in DERIVED_VIEWS:
        if f"{prefix}{name}" not in views:
            _drop(con, f"{prefix}{name}")
    return views


def column_comments(con: duckdb.DuckDBPyConnection, view: str, table: str) -> list[str]:
    """The statements that give each column of a table's view its declared description
    (updatelens.schemas) as a DuckDB comment: `SELECT column_name, comment FROM duckdb_columns() WHERE
    table_name = 'geometry'`, or a SQL client's column list, says what a column means. The joined
    token text is described as in `tokens`."""
    names = [row[0] for row in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                           [view]).fetchall()]
    return [f"COMMENT ON COLUMN {view}.{name} IS {sql_string(text)}" for name in names
            if (text := schemas.describe_column(table, name) or schemas.describe_column("tokens", name))]


def _comment(con: duckdb.DuckDBPyConnection, views: dict[str, str]) -> None:
    """Every column comment of `views` (view -> its table) in one transaction: one by one, each
    would commit to the catalog file on its own, many times slower."""
    statements = [st for view, table in views.items() for st in column_comments(con, view, table)]
    con.execute("BEGIN TRANSACTION")
    for statement in statements:
        con.execute(statement)
    con.execute("COMMIT")


def _family_views(con: duckdb.DuckDBPyConnection, good: dict[str, list[str]], tables: tuple[str, ...],
                  prefix: str, hive: str, select: str = "*") -> set[str]:
    """One view per table with verified files (the others dropped); the tables that have one."""
    present = set()
    for table in tables:
        if table in good and _create_view(con, f"{prefix}{table}", good[table],
                                          functools.partial(_parquet_view, f"{prefix}{table}", hive_types=hive,
                                                            select=select)):
            present.add(table)
        else:
            con.execute(f"DROP VIEW IF EXISTS {prefix}{table}")
    return present


def _control_family(con: duckdb.DuckDBPyConnection, files: dict[str, list[str]], present: set[str], prefix: str,
                    hive: str, exclude: str = "") -> tuple[list[str], str]:
    """The positive controls' views of one family (main: prefix "", convergence: "conv_"): one view per
    control table, keyed `<config_id>/<control>` (so the findings render over them unchanged), the
    findings over them (`{prefix}control_findings_by_class`, ...), and the relation of their finding
    replicates for the family's own findings (NO_CONTROLS where there are none)."""
    select = f"* {exclude} REPLACE (config_id || '/' || control AS config_id)"
    made = _family_views(con, files, CONTROL_TABLES, prefix, hive, select)
    family = {t[len(CONTROL_PREFIX):] for t in made}
    for table in ("functional_summary", "functional_bootstrap"):  # no KL is measured on a control
        if table in present:
            con.execute(f"CREATE OR REPLACE VIEW {prefix}{CONTROL_PREFIX}{table} AS SELECT * FROM {prefix}{table} WHERE false")
            family.add(table)
        else:
            con.execute(f"DROP VIEW IF EXISTS {prefix}{CONTROL_PREFIX}{table}")
    views = [f"{prefix}{t}" for t in CONTROL_TABLES if t in made]
    derived = _create_family(con, family, f"{prefix}{CONTROL_PREFIX}") if made else []
    for name in DERIVED_VIEWS:
        if f"{prefix}{CONTROL_PREFIX}{name}" not in derived:
            _drop(con, f"{prefix}{CONTROL_PREFIX}{name}")
    controls = (CONTROL_REPLICATES.format(prefix=prefix) if f"{prefix}{CONTROL_PREFIX}finding_replicates" in derived
                else NO_CONTROLS)
    return views + derived, controls


def _create_view(con: duckdb.DuckDBPyConnection, name: str, files: list[str], sql: Callable[[list[str]], str]) -> bool:
    """Create a view over `files`; False if none is left. DuckDB opens the files when the view is
    created: a run replacing a partition at that moment (its old file moved aside after this process
    verified it) makes the creation fail; the files still in place are then used (the partition being
    replaced shows again once its run commits)."""
    for _ in range(3):
        try:
            con.execute(sql(files))
            return True
        except duckdb.IOException:
            files = [f for f in files if as_root(f).exists()]
            if not files:
                return False
    con.execute(sql(files))
    return True


@dataclass
class Verified:
    """The partition files under a root that verify, per family (main tables, sweeps, convergence
    sizes) and table, and those that do not."""

    main: dict[str, list[str]]
    sweeps: dict[str, list[str]]
    convergence: dict[str, list[str]]
    damaged: list[Damaged]
    missing_text: list[Damaged]  # layers whose per-token views would show NULL text: no verified `tokens`


def _partition_of(file: str) -> tuple[str, int]:
    """(model, layer) of a partition file's url."""
    path = as_root(file)
    return key_value(path.parent.parent.name), int(key_value(path.parent.name))


def missing_text(root: RootLike, good: dict[str, list[str]]) -> list[Damaged]:
    """The (model, layer)s with a per-token table that joins its text (WITH_TEXT) but no verified
    `tokens` partition: their `token` and `context` would be NULL without a word."""
    have = {_partition_of(f) for f in good.get("tokens", [])}
    wanting = sorted({_partition_of(f) for table in WITH_TEXT for f in good.get(table, [])} - have)
    return [Damaged(url(partition_file(root, "tokens", model, layer)), "tokens", model, layer,
                    f"missing: the token text (token, context) of {' and '.join(WITH_TEXT)} is NULL for this layer")
            for model, layer in wanting]


def listed_sweeps(files: dict[str, list[str]], runs: list[str]) -> dict[str, list[str]]:
    """The sweep partitions of the (model, configuration)s a finished sweep lists: `runs` are the
    sweep_runs records, written after all of a sweep's tables, so a sweep in progress or cut short
    shows none of its tables."""
    listed = {(hive_value(r, "model"), hive_value(r, "config")) for r in runs}
    return {table: [f for f in found if (hive_value(f, "model"), hive_value(f, "config")) in listed]
            for table, found in files.items()}


def verify_root(root: RootLike, full: bool = False) -> Verified:
    """Every partition file of every family under the root, checked (storage.integrity; `full`: every
    checksum recomputed, as `updatelens verify` does)."""
    main, damaged = scan(root, TABLES + STUDY_TABLES, full=full)
    sweeps, sweep_damaged = scan(root, SWEEP_TABLES, f"{SWEEPS}/config=*/", full)
    convergence, conv_damaged = scan(root, TABLES, f"{CONVERGENCE}/n_seq=*/", full)
    return Verified(main, sweeps, convergence, damaged + sweep_damaged + conv_damaged, missing_text(root, main))


def create_views(con: duckdb.DuckDBPyConnection, root: RootLike) -> list[str]:
    """(Re)create on `con` the views of every table with verified files; drop the others. Files whose
    Parquet footer does not read are left out and listed in `damaged_partitions`."""
    return _create_views(con, root)[0]


def _create_views(con: duckdb.DuckDBPyConnection, root: RootLike) -> tuple[list[str], list[str]]:
    """The views created, and every file they read."""
    root = as_root(root)
    if not is_local(root):
        con.register_filesystem(root.fs)
    verified = verify_root(root)
    present = _family_views(con, verified.main, PLAIN_TABLES + STUDY_TABLES, "", MAIN_HIVE)
    if "tokens" in present:
        for table in (t for t in WITH_TEXT if t in present):
            _create_view(con, table, verified.main[table], functools.partial(_text_view, table, hive_types=MAIN_HIVE))
    runs = [url(f) for f in sorted(root.glob(sweep_runs_glob()), key=str)] if has_sweep_runs(root) else []
    sweeps = listed_sweeps(verified.sweeps, runs)
    swept = _family_views(con, sweeps, SWEEP_TABLES, "sweep_", SWEEP_HIVE, "* EXCLUDE (config)")
    if runs:  # an explicit file list: the read-only engine opens only listed files
        listed = ", ".join(sql_string(f) for f in runs)
        con.execute(f"CREATE OR REPLACE VIEW sweep_runs AS SELECT * FROM read_parquet([{listed}], union_by_name = true)")
    else:
        con.execute("DROP VIEW IF EXISTS sweep_runs")
    control_views, controls = _control_family(con, verified.main, present, "", MAIN_HIVE)
    views = [t for t in PLAIN_TABLES + STUDY_TABLES if t in present] + control_views + _create_family(con, present, "", controls)
    views += [f"sweep_{t}" for t in SWEEP_TABLES if t in swept] + _create_family(con, swept, "sweep_")
    conv_files = {t: f for t, f in verified.convergence.items() if t != "activations"}  # results, not states
    converged = _family_views(con, conv_files, PLAIN_TABLES, "conv_", CONV_HIVE, "* EXCLUDE (n_seq)")
    conv_control_views, conv_controls = _control_family(con, conv_files, converged, "conv_", CONV_HIVE, "EXCLUDE (n_seq)")
    views += ([f"conv_{t}" for t in PLAIN_TABLES if t in converged] + conv_control_views
              + _create_family(con, converged, "conv_", conv_controls))
    if "findings" in views:
        con.execute(ACROSS_MODELS_SQL.format(sampled=SAMPLED_SQL if "activations" in views else NO_SAMPLED_SQL,
                                             jackknife_first=JACKKNIFE_FIRST, exact_class=EXACT,
                                             jk_value=jackknife_half_width("value"),
                                             jk_diff=jackknife_half_width("ja.value - jb.value", "ja.replicate")))
        views.append("findings_across_models")
    else:
        con.execute("DROP VIEW IF EXISTS findings_across_models")
    if "conv_findings_by_class" in views and "conv_geometry_bootstrap" in views:
        con.execute(CONVERGENCE_SQL)
        views.append("convergence")
    else:
        con.execute("DROP VIEW IF EXISTS convergence")
    if runs and "sweep_findings" in views:
        con.execute(sensitivity_sql())
        views += ["sweep_runs", "sensitivity"]
    else:
        con.execute("DROP VIEW IF EXISTS sensitivity")
    if {"context_split", "context_split_bootstrap"} <= present:
        con.execute(context_split_summary_sql())
        views.append("context_split_summary")
    else:
        con.execute("DROP VIEW IF EXISTS context_split_summary")
    con.execute(damaged_view_sql(verified.damaged + verified.missing_text))
    made_controls = {t for t in CONTROL_TABLES if t in control_views}
    families = (("", present | made_controls, TABLES + STUDY_TABLES), ("sweep_", swept, SWEEP_TABLES),
                ("conv_", converged, PLAIN_TABLES))
    _comment(con, {f"{prefix}{t}": t for prefix, made, tables in families for t in tables if t in made})
    read = [f for family in (verified.main, sweeps, conv_files) for files in family.values() for f in files]
    return [*views, "damaged_partitions"], read + runs


def catalog_error(db_path: Path) -> str | None:
    """Why the catalog file cannot be used (None: absent, in use by another process, or a DuckDB
    database holding views only, as the catalog does). It holds no data: a damaged or foreign one is
    moved aside and rebuilt (`refresh`)."""
    if not db_path.exists():
        return None
    try:
        with duckdb.connect(str(db_path), read_only=True) as con:
            tables = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name NOT IN "
                                 f"({', '.join(sql_string(n) for n in _derived_table_names())})").fetchone()
    except duckdb.Error as exc:
        message = str(exc).splitlines()[0]
        if "lock" in message.lower():  # open in another process (a `duckdb` shell): busy, not damaged
            return None
        return f"not a readable DuckDB database ({message})"
    if tables and tables[0]:
        return (f"holds {tables[0]} tables of its own: not an UpdateLens catalog, which holds views and the "
                f"tables it derives ({', '.join(_derived_table_names())})")
    return None


def _derived_table_names() -> list[str]:
    return [f"{prefix}{name}" for prefix in FAMILY_PREFIXES for name in DERIVED_TABLES]


def _set_aside(root: RootLike, db_path: Path, reason: str) -> Path:
    """Move a damaged or foreign catalog (and its write-ahead log) to the quarantine; never deleted."""
    target = local_path(as_root(root)) / QUARANTINE / time.strftime("%Y%m%dT%H%M%S") / db_path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(db_path, target)
    wal = db_path.with_name(db_path.name + ".wal")
    if wal.exists():
        os.replace(wal, target.with_name(wal.name))
    warnings.warn(f"the catalog {db_path} was {reason}; moved it to {target} and rebuilt it", stacklevel=3)
    return target


def refresh(root: RootLike, db_path: Path | None = None, wait: bool = True) -> list[str]:
    """Rebuild the catalog file's views; returns the view names (object store: checked in memory).
    The new catalog is built in a file of its own and renamed over the old one: a reader with the
    old one open keeps reading it, and no reader's lock on it can make a writer's refresh fail.
    A damaged or foreign catalog file is set aside first (it holds only views and derived tables).
    Beside it, the record of what was verified (`VERIFIED_SUFFIX`): the stored files' fingerprint
    taken before verifying, the files the views read and the views' definitions, so that a query
    finding the same files unchanged reads the catalog without verifying them again. `wait=False`:
    BlockingIOError at once when another process is refreshing it."""
    db_path = db_path or catalog_path(root)
    if db_path is None:
        with duckdb.connect() as con:
            return create_views(con, root)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    # One refresh at a time (each builds the whole catalog; the last to finish is the current one).
    with open(db_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        verified = _verified_path(db_path)
        verified.unlink(missing_ok=True)  # the record never outlives the views it describes
        if reason := catalog_error(db_path):
            _set_aside(root, db_path, reason)
        fingerprint = root_fingerprint(root)  # before verifying: a file changed meanwhile does not match later
        building = db_path.with_name(f"{db_path.name}.{os.getpid()}.building")
        # only a refresh holding the lock builds: any other building file is a killed refresh's
        for stale in db_path.parent.glob(f"{glob.escape(db_path.name)}.*.building*"):
            stale.unlink(missing_ok=True)
        try:
            with duckdb.connect(str(building)) as con:
                views, readable = _create_views(con, root)
            with duckdb.connect(str(building), read_only=True) as con:  # the definitions as a reader reads them back
                definitions = _view_digest(con)
        except BaseException:  # a full disk, an interrupt: no half-built catalog is left behind
            for part in (building, building.with_name(building.name + ".wal")):
                part.unlink(missing_ok=True)
            raise
        db_path.with_name(db_path.name + ".wal").unlink(missing_ok=True)  # an old log would replay onto it
        os.replace(building, db_path)
        record = {"code_version": CODE_VERSION, "root": root_identity(root), "fingerprint": fingerprint,
                  "views": definitions, "readable": readable}
        tmp = verified.with_name(verified.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, verified)
        return views


# ---- queries without verifying again what has not changed ----------------------------------------
VERIFIED_SUFFIX = ".verified.json"
# under a local root, what the fingerprint leaves out: what is not a stored result
NOT_RESULTS = frozenset({QUARANTINE, STAGING, LOCKS, DAGSTER_DIR, "_notebook", "reports", "bench"})


def _verified_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + VERIFIED_SUFFIX)


def root_fingerprint(root: RootLike) -> str:
    """SHA-256 of (path, size, modification time) of every file under a local root's result folders
    (the partitions, their manifests, stray files, sweep records): any file written, replaced,
    touched, added or removed changes it; it reads no file's contents."""
    top = local_path(as_root(root))
    entries = []
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath == str(top):
            dirnames[:] = [d for d in dirnames if d not in NOT_RESULTS]
            continue  # the catalog's own files
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            entries.append(f"{os.path.relpath(path, top)}\t{st.st_size}\t{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()


def root_identity(root: RootLike) -> str:
    """Which folder a local root is: its real path and its inode. A copy (`cp -a` keeps every file's
    size and time, so the fingerprint alone would match) or a moved root is another folder: its
    catalog, whose views name the files it was built over, is verified again and rebuilt over its
    own files before it serves a query."""
    top = local_path(as_root(root))
    st = os.stat(top)
    return f"{os.path.realpath(top)}\t{st.st_dev}\t{st.st_ino}"


def _view_digest(con: duckdb.DuckDBPyConnection) -> str:
    """SHA-256 of every view's definition and of every table's name and rows (the derived tables: a
    row changed by a plain DuckDB client after the refresh changes it)."""
    views = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
    names = [row[0] for row in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
    rows = [[name, *_one(con, f"SELECT count(*), bit_xor(hash(t)) FROM {name} t")] for name in names]
    return hashlib.sha256(json.dumps([views, rows], default=str).encode()).hexdigest()


def _verified_catalog(root: RootLike) -> tuple[duckdb.DuckDBPyConnection, list[str]] | None:
    """A read-only connection to the catalog file and the files its views read, when nothing under the
    root changed since `refresh` verified it (the same folder, fingerprint and code version, the
    views as written); None otherwise (the caller verifies)."""
    db_path = catalog_path(root)
    if db_path is None or not db_path.exists():
        return None
    try:
        record = json.loads(_verified_path(db_path).read_text())
    except (OSError, ValueError):
        return None
    if (record.get("code_version") != CODE_VERSION or record.get("root") != root_identity(root)
            or record.get("fingerprint") != root_fingerprint(root)):
        return None
    try:
        con = duckdb.connect(str(db_path), read_only=True)
    except duckdb.Error:  # in use by a writer, or damaged
        return None
    try:
        if _view_digest(con) == record.get("views"):
            return con, list(record["readable"])
    except duckdb.Error:
        pass
    con.close()
    return None


def _refreshed(root: RootLike) -> bool:
    """For a reader that found the catalog out of date (files changed, or written by another code
    version): rebuild it now, so that the next query reads it without verifying again. False where
    that cannot be done at once (an object store, another process refreshing it or holding it open
    for writing, a root this user cannot write): the reader then verifies in memory."""
    if catalog_path(root) is None:
        return False
    try:
        refresh(root, wait=False)
    except (OSError, duckdb.Error):  # BlockingIOError is an OSError
        return False
    return True


def connect(root: RootLike, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection with the catalog's views. `read_only` on a root unchanged since the last refresh
    (`_verified_catalog`, the catalog refreshed first when it is not: `_refreshed`): the catalog file
    itself, read-only, without verifying again; otherwise an in-memory connection whose views are made
    over the files verified now (never blocked by a writer's file lock).
    `read_only` (a local root): the engine may then open only the verified files the views read,
    and its settings are locked, so no statement can write a file, attach a database, install or
    load an extension, or lift these limits."""
    cached = _verified_catalog(root) if read_only else None
    if cached is None and read_only and _refreshed(root):
        cached = _verified_catalog(root)
    if cached is not None:
        con, readable = cached
    else:
        con = duckdb.connect()
        _, readable = _create_views(con, root)
    if read_only and is_local(as_root(root)):
        con.execute(f"SET allowed_paths = [{', '.join(sql_string(f) for f in readable)}]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


class ReadOnlyError(ValueError):
    """A statement that could write (COPY, CREATE, ATTACH, ...) where only reading was allowed."""


def _explained(con: duckdb.DuckDBPyConnection, text: str) -> list[duckdb.Statement]:
    """The statements an EXPLAIN [ANALYZE] [(options)] statement wraps: the first suffix of its text,
    from one of its tokens on, that parses ([] when none does)."""
    for position, _ in duckdb.tokenize(text)[1:]:
        try:
            return con.extract_statements(text[position:])
        except duckdb.Error:
            continue
    return []


def refuse_writes(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """ReadOnlyError unless every statement of `sql` is a SELECT (DESCRIBE, SHOW, SUMMARIZE and
    PRAGMA show_* parse as SELECT) or an EXPLAIN of statements that all are, however nested or
    commented: EXPLAIN ANALYZE executes what it wraps."""
    for statement in con.extract_statements(sql):
        kind = statement.type.name
        if kind == "EXPLAIN":
            inner = _explained(con, statement.query)
            if not inner:
                raise ReadOnlyError("read-only: an EXPLAIN whose statement cannot be read is not allowed")
            refuse_writes(con, ";".join(st.query for st in inner))
        elif kind != "SELECT":
            raise ReadOnlyError(f"read-only: {kind} statements are not allowed (updatelens sql --write allows them)")


class QueryTimeout(Exception):
    """A query ran past its time limit and was interrupted."""


def fetch(root: RootLike, sql: str, params: list[object] | None = None, write: bool = False,
          timeout_s: float | None = None) -> tuple[list[str], list[tuple[object, ...]]]:
    """`query` as column names and rows, without polars (what `updatelens sql` prints: its import is
    most of a small query's time). The query runs in a worker thread while this one waits, so a
    Ctrl-C (KeyboardInterrupt, raised here) or `timeout_s` (QueryTimeout) stops it through DuckDB's
    interrupt, whether or not DuckDB itself looks at the signal."""
    import threading
    import time

    with connect(root, read_only=not write) as con:
        if not write:
            refuse_writes(con, sql)
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                rel = con.execute(sql, params) if params else con.execute(sql)
                columns = [d[0] for d in rel.description] if rel.description else []
                outcome["rows"] = (columns, rel.fetchall() if columns else [])
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
                outcome["error"] = exc

        worker = threading.Thread(target=work, name="updatelens-query", daemon=True)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.05)
                if deadline is not None and time.monotonic() > deadline and worker.is_alive():
                    outcome["expired"] = True
                    con.interrupt()
                    worker.join()
        except KeyboardInterrupt:
            con.interrupt()
            worker.join()
            raise
        error = outcome.get("error")
        if error is None:
            return outcome["rows"]
        if isinstance(error, duckdb.InterruptException) and outcome.get("expired"):
            raise QueryTimeout(f"the query ran past its limit of {timeout_s:g} s and was stopped") from error
        raise error


def query(root: RootLike, sql: str, params: list[object] | None = None, write: bool = False) -> pl.DataFrame:
    """Run SQL over the stored tables, with `$1`.. bound to `params`; returns a polars frame (empty
    for statements without rows). Unless `write`, only reading statements run: a COPY ... TO, CREATE,
    ATTACH, INSTALL or SET is refused (ReadOnlyError) before anything executes, and the engine
    itself is limited to reading the verified files (`connect(read_only=True)`)."""
    with connect(root, read_only=not write) as con:
        if not write:
            refuse_writes(con, sql)
        return _rows(con, sql, params)


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[object] | None) -> pl.DataFrame:
    rel = con.sql(sql, params=params) if params else con.sql(sql)
    if rel is not None:
        return rel.pl()
    import polars as pl

    return pl.DataFrame()


@contextmanager
def reading(root: RootLike) -> Iterator[Callable[[str, list[object] | None], pl.DataFrame]]:
    """`query` for several reading statements over one connection (each opening costs a check that
    nothing under the root changed): yields a function (sql, params) -> polars frame."""
    with connect(root, read_only=True) as con:
        def read(sql: str, params: list[object] | None = None) -> pl.DataFrame:
            refuse_writes(con, sql)
            return _rows(con, sql, params)

        yield read
