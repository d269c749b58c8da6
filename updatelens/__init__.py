"""UpdateLens: the geometry of layer updates in language models (Dagster-free engine)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

__version__ = "0.1.0"


# Folders installed as updatelens.<name> (in a checkout they sit beside the engine, mapped in by
# pyproject.toml); of them, assets/ and storage/ decide what is stored, so they count in the version.
_MAPPED = ("assets", "storage", "reports", "orchestration")
_RECORDED = ("assets", "storage")


def _mapped_dir(name: str) -> Path:
    """Where updatelens.<name> lives: under the engine when installed, beside it in a checkout."""
    import importlib.util

    spec = importlib.util.find_spec(f"{__name__}.{name}")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{__name__}.{name} is not installed with the engine")
    return Path(next(iter(spec.submodule_search_locations)))


def _source_hash() -> str:
    """The engine's code and that of assets/ and storage/ (`_code_of`: comments and docstrings left
    out), by path relative to the package: the same in a checkout (editable install) and in an
    installed wheel of the same commit."""
    root = Path(__file__).parent
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
             if p.relative_to(root).parts[0] not in _MAPPED]
    for name in _RECORDED:
        folder = _mapped_dir(name)
        files += [(f"{name}/{p.relative_to(folder).as_posix()}", p) for p in folder.rglob("*.py")]
    raw = hashlib.sha1()
    sources = []
    for relative, path in sorted(files):
        source = path.read_bytes()
        raw.update(relative.encode() + b"\0" + source + b"\0")
        sources.append((relative, source))

    def version() -> str:
        h = hashlib.sha1()
        for relative, source in sources:
            h.update(relative.encode())
            h.update(_code_of(source))
        return h.hexdigest()[:8]

    # parsing every module costs about 0.2 s: the light paths (sql, verify) pay it once per code change
    return _memoized("code_version", raw.hexdigest(), version)


def _memoized(kind: str, key: str, compute: Callable[[], str]) -> str:
    """`compute()`, kept on disk under `kind`/`key` ($UPDATELENS_CACHE, default ~/.cache/updatelens):
    a version computed from the sources is kept per exact set of their bytes (`key`). Written whole
    (a temporary file, then renamed); a read-only home computes it again next time."""
    memo = Path(os.environ.get("UPDATELENS_CACHE", Path.home() / ".cache" / "updatelens")) / kind
    try:
        return (memo / key).read_text()
    except OSError:
        pass
    value = compute()
    try:
        memo.mkdir(parents=True, exist_ok=True)
        partial = memo / f"{key}.{os.getpid()}.tmp"
        partial.write_text(value)
        os.replace(partial, memo / key)
    except OSError:
        pass
    return value


def _code_of(source: bytes) -> bytes:
    """What a module computes, without its comments, docstrings or layout: its syntax tree with the
    docstrings dropped (a fixed typo in a comment or a docstring leaves every result current)."""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False).encode()


# The release plus a hash of the sources that compute and store results: the key of the catalog's cache
# and the version of the reports and of the calibration study's rows. The stages' rows record their own
# stage's version instead (updatelens.versions), so a change to one stage leaves the others current.
# Computed when first asked for (`from updatelens import CODE_VERSION`), not when the package is imported.
CODE_VERSION: str


def __getattr__(name: str) -> str:
    if name == "CODE_VERSION":
        value = f"{__version__}+{_source_hash()}"
        globals()["CODE_VERSION"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
