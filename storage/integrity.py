"""Which stored partition files can be trusted, and what to do with those that cannot.

Every partition file is written with a manifest beside it (`manifest.json` in the same partition
folder, committed in the same step: the folder rename locally, the entry-file order on an object
store): its rows, bytes and SHA-256, the config_id and code_version of its rows, and when. A file
verifies when its manifest lists it, its size and checksum match and its Parquet footer reads: a
truncated file, a partial copy, a flipped bit, a file written by hand or by an older version all
fail. The views read only files that verify, so one damaged partition does not break queries of
the others; staleness counts a damaged file as missing, so the next run recomputes it; `quarantine`
moves a damaged file aside under `<root>/_quarantine/` (never deleted) before it is replaced.
A manifest also says which partition it holds (table, model, layer, config_id, code_version): a
file copied or moved into another partition's folder, with its manifest, is damaged too, and so is
one whose rows name another model or layer than its folder (the footer's column statistics, no
extra read). Results are cached in-process by the size and mtime of the file and of its manifest,
so a run hashes each file about once (what verification costs: bench/records/verify_overhead-*.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
from upath import UPath

from updatelens.storage.location import RootLike, as_root, is_local, key_value, local_path, url

QUARANTINE = "_quarantine"
MANIFEST = "manifest.json"
# what a full verification found wrong with a partition, beside it: remembered until the partition is
# written anew (a new manifest), so the views leave it out and `run` recomputes it without --repair
DAMAGE_MARK = "damage.json"
PART_FILE = "part-0.parquet"  # the one data file of a partition (storage.layout writes it)
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Damaged:
    path: str  # url of the file
    table: str
    model: str
    layer: int
    reason: str


def _metadata(path: UPath) -> pq.FileMetaData:
    if is_local(path):
        return pq.read_metadata(path)
    with path.fs.open(path.path, "rb") as handle:
        return pq.read_metadata(handle)


def _footer(path: RootLike, rows: int | None = None) -> tuple[pq.FileMetaData | None, str | None]:
    """A stored Parquet file's footer, and why the file cannot be read (None: the footer reads and the
    file has rows, `rows` of them when given; none where its manifest says so: a stage that had
    nothing to store for the layer, e.g. the controls stage with no positive control)."""
    try:
        meta = _metadata(as_root(path))
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as exc:  # pyarrow: "Parquet magic bytes not found", "file size is 0"
        return None, f"unreadable Parquet ({exc})"
    if meta.num_rows == 0 and rows != 0:
        return meta, "no rows"
    if rows is not None and meta.num_rows != rows:
        return meta, f"{meta.num_rows} rows, its manifest says {rows}"
    return meta, None


def folder_identity(path: RootLike) -> dict[str, object] | None:
    """The (table, model, layer) a partition file's folder stands for:
    `.../<table>/model=<m>/layer=<l>/<file>`; None for a file outside that layout (a sweep record)."""
    path = as_root(path)
    layer_dir, model_dir = path.parent, path.parent.parent
    if not (layer_dir.name.startswith("layer=") and model_dir.name.startswith("model=")):
        return None
    try:
        layer = int(key_value(layer_dir.name))
    except ValueError:
        return None
    return {"table": model_dir.parent.name, "model": key_value(model_dir.name), "layer": layer}


def _column_values(meta: pq.FileMetaData, column: str) -> set[object] | None:
    """Every value a column takes, from its row-group statistics (min and max); None when the file
    has no such column or a row group has no statistics."""
    names = meta.schema.names
    if column not in names:
        return None
    index = names.index(column)
    values: set[object] = set()
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(index).statistics
        if stats is None or not stats.has_min_max:
            return None
        values.update((stats.min, stats.max))
    return values


def identity_error(path: RootLike, entry: dict, meta: pq.FileMetaData) -> str | None:
    """Why a partition file holds another partition than its folder says (None: its manifest and its
    rows' `model`, `layer` and `config_id` agree with the folder and with each other)."""
    expected = folder_identity(path)
    if expected is None:
        return None
    claimed = {key: entry.get(key) for key in expected}
    if claimed != expected:
        if any(value is None for value in claimed.values()):
            return "its manifest does not say which partition it holds (written by an older version)"
        return (f"its manifest says it holds {claimed['table']} model={claimed['model']} layer={claimed['layer']}, "
                f"its folder is {expected['table']} model={expected['model']} layer={expected['layer']} "
                f"(moved or copied from another partition)")
    if meta.num_rows == 0:
        return None  # an empty partition (its manifest says so): no rows to belong elsewhere
    for column, want in (("model", expected["model"]), ("layer", expected["layer"]),
                         ("config_id", entry.get("config_id"))):
        values = _column_values(meta, column)
        if values is not None and want is not None and values != {want}:
            shown = ", ".join(sorted(str(v) for v in values))
            return f"its rows have {column} {shown}, its folder and manifest say {want} (another partition's rows)"
    return None


def sha256_of(path: RootLike) -> str:
    path = as_root(path)
    digest = hashlib.sha256()
    with (open(local_path(path), "rb") if is_local(path) else path.fs.open(path.path, "rb")) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(file: Path, table: str, rows: int, provenance: dict[str, object]) -> Path:
    """The manifest of a just-written local partition file, beside it (fsynced). `provenance` names
    the partition it holds (model, layer) and its rows' config_id and code_version."""
    info = file.stat()
    entry = {"file": file.name, "table": table, "rows": rows, "bytes": info.st_size, "mtime_ns": info.st_mtime_ns,
             "sha256": sha256_of(file), **provenance,
             "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    target = file.parent / MANIFEST
    with open(target, "w") as handle:
        json.dump(entry, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    return target


def read_manifest(file: RootLike) -> dict | None:
    """The manifest entry of a stored partition file, or None when it has none (or another file's)."""
    path = as_root(file).parent / MANIFEST
    try:
        text = path.read_text()
    except (FileNotFoundError, OSError):
        return None
    try:
        entry = json.loads(text)
    except json.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) and entry.get("file") == as_root(file).name else None


_verified: dict[tuple[str, int, int, tuple[int, int] | None, tuple[int, int] | None], str | None] = {}


def _stamp(path: UPath) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file beside a partition, None where there is none: part of the key under
    which a partition's verification is remembered, so a new manifest or damage mark is seen."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return int(info.st_size), int(getattr(info, "st_mtime_ns", 0) or 0)


def layer_of(folder_name: str) -> int | None:
    """The layer a `layer=<n>` folder stands for, where the name is exactly the layout's spelling
    (`layer=7`, not `layer=07`, `layer=7.bak` or `layer=7 copy`); None otherwise."""
    text = folder_name.removeprefix("layer=")
    return int(text) if folder_name.startswith("layer=") and re.fullmatch(r"0|[1-9][0-9]*", text) else None


def link_on_the_way(file: str) -> str | None:
    """The first symbolic link among a local partition file's model folder, layer folder and the file
    itself (`file` as listed, not resolved), or None."""
    layer_dir = os.path.dirname(file)
    return next((part for part in (os.path.dirname(layer_dir), layer_dir, file) if os.path.islink(part)), None)


def layout_error(path: UPath) -> str | None:
    """Why a file found under `<table>/model=*/layer=*/` is not a partition the layout wrote (None: it
    may be): a folder that is not the layout's spelling of a layer (a second spelling of a key would
    be read as the same layer twice; a backup's name breaks the views' key column), or, under a local
    root, a symbolic link on the way (its target can change without this root's manifests knowing)."""
    layer_dir = path.parent
    if layer_of(layer_dir.name) is None:
        return (f"its folder {layer_dir.name!r} is not the layout's spelling of a layer (layer=<n>, no leading "
                f"zero): a copy or a backup, not a partition")
    link = link_on_the_way(path.path) if is_local(path) else None
    if link is not None:
        return f"{os.path.basename(link)} is a symbolic link, not a partition written under this root"
    return None


def partition_error(file: RootLike, full: bool = False) -> str | None:
    """Why a stored partition file cannot be trusted (None: listed in its manifest with this size
    and checksum, and its footer reads). A local file whose size and modification time are still the
    ones its manifest recorded when it was written is not hashed again unless `full` (`updatelens
    verify`): any write to it changes its mtime; only damage below the file system (a bit rotting on
    disk) waits for `verify`."""
    path = as_root(file)
    misplaced = layout_error(path)
    if misplaced is not None:
        return misplaced
    try:
        info = path.stat()
    except FileNotFoundError:
        return "missing"
    manifest_stamp, mark_stamp = _stamp(path.parent / MANIFEST), _stamp(path.parent / DAMAGE_MARK)
    key = (url(path), int(info.st_size), int(getattr(info, "st_mtime_ns", 0) or 0), manifest_stamp, mark_stamp)
    if is_local(path) and key in _verified and not full:
        return _verified[key]
    entry = read_manifest(path)
    if entry is None:
        reason: str | None = "not listed in a manifest (written by hand, by an older version, or its manifest is lost)"
    elif entry.get("bytes") != info.st_size:
        reason = f"{info.st_size} bytes, its manifest says {entry.get('bytes')} (truncated or replaced)"
    elif (full or not is_local(path) or entry.get("mtime_ns") != info.st_mtime_ns) and entry.get("sha256") != sha256_of(path):
        reason = "content differs from its manifest's SHA-256 (damaged on disk or in a copy)"
    else:
        meta, reason = _footer(path, entry.get("rows"))  # the footer read once, for both checks
        if reason is None and meta is not None:
            reason = identity_error(path, entry, meta)
    if entry is not None and is_local(path):
        if reason is not None and full:
            _mark_damage(path, entry, reason)
        elif reason is None:
            reason = recorded_damage(path, entry)
    if is_local(path):
        _verified[key] = reason
    return reason


def _mark_damage(path: UPath, entry: dict, reason: str) -> None:
    """Record beside a local partition what a full verification found (atomically: a temporary file,
    then a rename), tied to its manifest's checksum and write time."""
    mark = {"file": path.name, "manifest_sha256": entry.get("sha256"), "manifest_written_at": entry.get("written_at"),
            "reason": reason, "found_at": datetime.now(UTC).isoformat(timespec="seconds")}
    target = Path(path.path).parent / DAMAGE_MARK
    temporary = target.with_name(f".{DAMAGE_MARK}.{os.getpid()}")
    temporary.write_text(json.dumps(mark, indent=1))
    os.replace(temporary, target)


def recorded_damage(file: RootLike, entry: dict | None = None) -> str | None:
    """What a full verification recorded wrong with this partition, while its manifest is still the one
    it checked (a partition written anew has another: the mark no longer applies); None otherwise."""
    path = as_root(file)
    try:
        mark = json.loads((path.parent / DAMAGE_MARK).read_text())
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None
    entry = entry if entry is not None else read_manifest(path)
    if (not isinstance(mark, dict) or entry is None or mark.get("file") != path.name
            or mark.get("manifest_sha256") != entry.get("sha256")
            or mark.get("manifest_written_at") != entry.get("written_at")):
        return None
    return f"{mark.get('reason')} (found by `updatelens verify` at {mark.get('found_at')})"


def scan(root: RootLike, tables: tuple[str, ...], prefix: str = "",
         full: bool = False) -> tuple[dict[str, list[str]], list[Damaged]]:
    """The partition files of each table under `<root>/<prefix>` (prefix: "" for the main tables,
    "sweeps/config=*/" or "convergence/n_seq=*/" for a family of data roots) that verify, and those
    that do not."""
    root = as_root(root)
    if not is_local(root):
        root.fs.invalidate_cache()
    good: dict[str, list[str]] = {}
    damaged: list[Damaged] = []
    for table in tables:
        for file in sorted(root.glob(f"{prefix}{table}/model=*/layer=*/*.parquet"), key=str):
            reason = partition_error(file, full)
            if reason is None:
                good.setdefault(table, []).append(url(file))
            else:
                layer = layer_of(file.parent.name)
                damaged.append(Damaged(url(file), table, key_value(file.parent.parent.name), -1 if layer is None else layer,
                                       reason))
    return good, damaged


def quarantine(root: RootLike, file: RootLike, relative: str | None = None) -> UPath:
    """Move a damaged file, and the manifest beside it when it lists that file, to `<root>/_quarantine/<time>/<its path under
    root>` (or `relative`, for a file already moved out of its place); returns where the file went."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    if is_local(as_root(root)):  # a symbolic link on the way moves itself: its target is not this root's to move
        # (as_root resolves links: the path as listed is what says where the link is)
        top = os.path.abspath(str(root))
        link = link_on_the_way(os.path.abspath(str(file).removeprefix("file://")))
        if link is not None:
            moved = Path(top) / QUARANTINE / stamp / os.path.relpath(link, top)
            moved.parent.mkdir(parents=True, exist_ok=True)
            os.replace(link, moved)
            return as_root(moved)
    root, file = as_root(root), as_root(file)
    relative = relative or str(file).removeprefix(str(root)).lstrip("/")
    target = root / QUARANTINE / stamp / relative
    manifest, mark = file.parent / MANIFEST, file.parent / DAMAGE_MARK
    # the manifest goes only with the file it lists: a stray file beside a good one leaves it in place;
    # so does the damage mark
    listed = read_manifest(file) is not None
    moves = [(file, target)] + ([(manifest, target.parent / MANIFEST)] if listed else []) + (
        [(mark, target.parent / DAMAGE_MARK)] if listed and recorded_damage(file) is not None else [])
    for source, destination in moves:
        if is_local(root):
            local_path(destination).parent.mkdir(parents=True, exist_ok=True)
            os.replace(local_path(source), local_path(destination))
        else:
            root.fs.mv(source.path, destination.path)
    if is_local(root):
        try:
            os.rmdir(file.parent.path)  # a folder left empty (a copy's or a backup's) goes too
        except OSError:
            pass  # not empty: other files stay where they are
    return target


def layer_runs(root: RootLike, model: str, layer: int, tables: tuple[str, ...]) -> dict[str, list[str]]:
    """The configuration each table of a (model, layer) was written under, from the manifests: one key
    where the layer's tables agree; more after a run with other settings stopped between its stages.
    An empty partition (its rows state none) does not count. The tables' code versions may differ:
    each stage records its own (`updatelens.versions`), and a stage made by other code is stale, not
    damaged: the next run recomputes it and what reads it."""
    runs: dict[str, list[str]] = {}
    for table in tables:
        entry = read_manifest(as_root(root) / table / f"model={model}" / f"layer={layer}" / PART_FILE)
        if entry is not None and entry.get("config_id"):
            runs.setdefault(str(entry["config_id"]), []).append(table)
    return runs


def stored_revisions(root: RootLike, model: str, tables: tuple[str, ...],
                     stored: dict[tuple[str, int], set[str]] | None = None) -> dict[str, list[int]]:
    """{model_revision: its layers} over the manifests of a model's stored partitions with rows: the
    weights each layer's rows were made with (models.recorded_revision, its fingerprint). More than one
    key: the root holds two models' results under one name. A manifest from before revisions were
    recorded counts as '' (unknown). `stored`: `stored_layers(root, tables)`, where the caller has it."""
    found: dict[str, set[int]] = {}
    for (stored_model, layer), have in (stored if stored is not None else stored_layers(root, tables)).items():
        if stored_model != model:
            continue
        for table in have:
            entry = read_manifest(as_root(root) / table / f"model={model}" / f"layer={layer}" / PART_FILE)
            if entry is not None and entry.get("rows"):
                found.setdefault(str(entry.get("model_revision", "")), set()).add(layer)
    return {revision: sorted(layers) for revision, layers in sorted(found.items())}


def mixed_weights(root: RootLike, tables: tuple[str, ...]) -> dict[str, dict[str, list[int]]]:
    """{model: {model_revision: layers}} for every model whose stored rows come from more than one set
    of weights under its one name (`stored_revisions`); the root's files listed once for all models."""
    stored = stored_layers(root, tables)
    models = sorted({model for model, _ in stored})
    return {model: revisions for model in models
            if len(revisions := stored_revisions(root, model, tables, stored)) > 1}


def stored_layers(root: RootLike, tables: tuple[str, ...]) -> dict[tuple[str, int], set[str]]:
    """The tables stored for each (model, layer), from the files under the layout's folders (another
    spelling of a layer is listed as damaged by `scan`, not counted as the layer)."""
    root = as_root(root)
    stored: dict[tuple[str, int], set[str]] = {}
    for table in tables:
        for file in root.glob(f"{table}/model=*/layer=*/*.parquet"):
            layer = layer_of(file.parent.name)
            if layer is not None:
                stored.setdefault((key_value(file.parent.parent.name), layer), set()).add(table)
    return stored


def mixed_layers(root: RootLike, tables: tuple[str, ...]) -> list[tuple[str, int, dict[str, list[str]]]]:
    """(model, layer, tables per config_id) of every stored layer whose tables were written under more
    than one configuration: not one run's results."""
    out = []
    for model, layer in sorted(stored_layers(root, tables)):
        runs = layer_runs(root, model, layer, tables)
        if len(runs) > 1:
            out.append((model, layer, runs))
    return out


def incomplete_layers(root: RootLike, tables: tuple[str, ...]) -> list[tuple[str, int, list[str]]]:
    """(model, layer, missing tables) of every layer with some of its tables stored but not all
    (a deleted partition, or a run that stopped between stages)."""
    stored = stored_layers(root, tables)
    return [(model, layer, [t for t in tables if t not in have])
            for (model, layer), have in sorted(stored.items()) if len(have) < len(tables)]
