"""Which stored partition files can be read, and what to do with those that cannot.

Every partition file is verified by its Parquet footer (magic bytes, schema and row-group index,
read without the data): a truncated file, a partial copy or a file that is not Parquet fails. The
views read only files that verify, so one damaged partition does not break queries of the others;
staleness counts a damaged file as missing, so the next run recomputes it; `quarantine` moves a
damaged file aside under `<root>/_quarantine/` (never deleted) before it is replaced.

Not caught here: a bit flip inside a data page leaves the footer readable (see the open issue on a
manifest with content checksums).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
from upath import UPath

from storage.location import as_root, is_local, url

QUARANTINE = "_quarantine"


@dataclass(frozen=True)
class Damaged:
    path: str  # url of the file
    table: str
    model: str
    layer: int
    reason: str


def footer_error(path: str | Path) -> str | None:
    """Why a stored Parquet file cannot be read (None: its footer reads and it has rows)."""
    path = as_root(path)
    try:
        if is_local(path):
            meta = pq.read_metadata(path)
        else:
            with path.fs.open(path.path, "rb") as handle:
                meta = pq.read_metadata(handle)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:  # pyarrow: "Parquet magic bytes not found", "file size is 0"
        return f"unreadable Parquet ({exc})"
    if meta.num_rows == 0:
        return "no rows"
    return None


def _key(value: str) -> str:
    return value.split("=", 1)[1]


def scan(root: str | Path, tables: tuple[str, ...], prefix: str = "") -> tuple[dict[str, list[str]], list[Damaged]]:
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
            reason = footer_error(file)
            if reason is None:
                good.setdefault(table, []).append(url(file))
            else:
                damaged.append(Damaged(url(file), table, _key(file.parent.parent.name), int(_key(file.parent.name)),
                                       reason))
    return good, damaged


def quarantine(root: str | Path, file: str | Path, relative: str | None = None) -> UPath:
    """Move a damaged file to `<root>/_quarantine/<time>/<its path under root>` (or `relative`, for a
    file already moved out of its place); returns where."""
    root, file = as_root(root), as_root(file)
    relative = relative or str(file).removeprefix(str(root)).lstrip("/")
    target = root / QUARANTINE / time.strftime("%Y%m%dT%H%M%S") / relative
    if is_local(root):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        os.replace(file, target)
    else:
        root.fs.mv(file.path, target.path)
    return target


def find_damage(root: str | Path, tables: tuple[str, ...], sweep_tables: tuple[str, ...]) -> list[Damaged]:
    """Every partition file under the root that does not verify: main tables, sweeps, convergence."""
    return [*scan(root, tables)[1], *scan(root, sweep_tables, "sweeps/config=*/")[1],
            *scan(root, tables, "convergence/n_seq=*/")[1]]


def incomplete_layers(root: str | Path, tables: tuple[str, ...]) -> list[tuple[str, int, list[str]]]:
    """(model, layer, missing tables) of every layer with some of its tables stored but not all
    (a deleted partition, or a run that stopped between stages)."""
    root = as_root(root)
    stored: dict[tuple[str, int], set[str]] = {}
    for table in tables:
        for file in root.glob(f"{table}/model=*/layer=*/*.parquet"):
            stored.setdefault((_key(file.parent.parent.name), int(_key(file.parent.name))), set()).add(table)
    return [(model, layer, [t for t in tables if t not in have])
            for (model, layer), have in sorted(stored.items()) if len(have) < len(tables)]
