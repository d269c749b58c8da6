"""Where the data root lives: a local folder or an object-store URL (`s3://bucket/prefix`, ...).

Every path the storage layer builds is a universal-pathlib `UPath`: for a local root it is a
`pathlib.Path` subclass (so the local code path is plain POSIX), for a URL it goes through the
URL's fsspec filesystem. Credentials and the endpoint come from the usual environment of that
filesystem (for S3: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`,
`AWS_DEFAULT_REGION`), or from `UPDATELENS_STORAGE_OPTIONS` (a JSON object passed to fsspec),
so every worker of a cluster builds the same filesystem from its environment.
"""

from __future__ import annotations

import os
import pathlib
from pathlib import Path
from typing import Any

import fsspec
from upath import UPath

from updatelens.config import json_object_env
from updatelens.errors import ConfigError

# A data root, or a path under one: a local path (str or os.PathLike) or a UPath (local or an object store)
RootLike = str | os.PathLike[str] | UPath

STORAGE_OPTIONS_ENV = "UPDATELENS_STORAGE_OPTIONS"
# The listing cache of an object-store filesystem would hide what other workers wrote.
_DEFAULT_OPTIONS: dict[str, dict[str, object]] = {"s3": {"use_listings_cache": False}}


def default_data_root() -> str:
    """$UPDATELENS_DATA, or ./data."""
    return os.environ.get("UPDATELENS_DATA", str(Path.cwd() / "data"))


def is_url(root: RootLike) -> bool:
    text = str(root)
    return "://" in text and not text.startswith("file://")


def existing_root(root: str | os.PathLike[str] | None, command: str) -> str:
    """The data root a reading command (sql, verify, report, notebook) opens: the given one or the
    default, refused in one line when it is a local path that does not exist (a mistyped
    --data-root); nothing is created there. Only `run` and the commands that compute create a root."""
    chosen = str(root or default_data_root())
    if not is_url(chosen) and not Path(chosen).expanduser().is_dir():
        raise ConfigError(f"no data root at {chosen}: {command} only reads results (check --data-root or "
                          f"$UPDATELENS_DATA; `updatelens run` creates a root)")
    return chosen


def storage_options(protocol: str) -> dict[str, object]:
    options = dict(_DEFAULT_OPTIONS.get(protocol, {}))
    if protocol in ("s3", "s3a") and os.environ.get("AWS_ENDPOINT_URL"):
        # explicit, so fsspec's instance cache (keyed by these options) never hands out a
        # filesystem bound to another endpoint than the environment's current one
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    options.update(json_object_env(STORAGE_OPTIONS_ENV) or {})
    return options


def key_value(name: str) -> str:
    """The value of a `key=value` folder name (a hive partition's: model=..., layer=..., config=...)."""
    key, eq, value = name.partition("=")
    if not eq or not key:
        raise ValueError(f"{name!r} is not a key=value folder name")
    return value


def hive_value(path: str, key: str) -> str:
    """The value of `key=value` among a path's or URL's folders."""
    return next(key_value(part) for part in path.split("/") if part.startswith(f"{key}="))


def local_path(path: RootLike) -> Path:
    """A local path (a root or a path under one, as str, Path or local UPath) as a pathlib Path."""
    return Path(path.path) if isinstance(path, UPath) else Path(path)


def as_root(root: RootLike) -> UPath:
    """A data root (or any path under it) as a UPath: local paths absolute, URLs with their options."""
    if isinstance(root, UPath):
        return root
    text = str(root)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if not is_url(text):
        return UPath(Path(text).resolve())
    protocol = text.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"data root {text}: no filesystem for {protocol}:// ({exc}); install its fsspec "
                          f"implementation (s3://: pip install 'updatelens[s3]')") from exc
    options: dict[str, Any] = storage_options(protocol)
    return UPath(text, **options)


def is_local(path: RootLike) -> bool:
    return isinstance(as_root(path), pathlib.Path)


def url(path: UPath) -> str:
    """What DuckDB and people see: an absolute local path or the full URL."""
    return str(path)
