"""UpdateLens: the geometry of layer updates in language models (Dagster-free engine)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__version__ = "0.1.0"


def _source_hash() -> str:
    h = hashlib.sha1()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:8]


# Recorded with every result row: the release plus a hash of the engine's source, so a changed
# computation is visible even without a release bump.
CODE_VERSION = f"{__version__}+{_source_hash()}"
