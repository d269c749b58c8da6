"""UpdateLens: the geometry of layer updates in language models (Dagster-free engine)."""

from __future__ import annotations

import hashlib
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
    """The engine's sources and those of assets/ and storage/, by path relative to the package: the
    same in a checkout (editable install) and in an installed wheel of the same commit."""
    root = Path(__file__).parent
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
             if p.relative_to(root).parts[0] not in _MAPPED]
    for name in _RECORDED:
        folder = _mapped_dir(name)
        files += [(f"{name}/{p.relative_to(folder).as_posix()}", p) for p in folder.rglob("*.py")]
    h = hashlib.sha1()
    for relative, path in sorted(files):
        h.update(relative.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:8]


# Recorded with every result row: the release plus a hash of the sources that compute and store the
# results, so a changed computation is visible even without a release bump.
CODE_VERSION = f"{__version__}+{_source_hash()}"
