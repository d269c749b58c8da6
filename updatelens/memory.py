"""Bounding what glibc's allocator keeps: a process that runs the stages holds at most two malloc arenas.

glibc gives each thread that allocates its own arena (up to 8 per core), and an arena keeps the
pages of the blocks freed in it for reuse instead of returning them. The stages allocate from torch's
and faiss's worker threads, numpy and DuckDB, so freed working memory piles up across arenas: the
Gemma 3 270M default job peaked at 3.80 GiB resident with glibc's default arenas, and at 3.03 GiB with
MALLOC_ARENA_MAX=2 (the same job on the same machine and day). Two arenas, not one, keep two
cores' threads from queueing on one lock.

`limit_malloc_arenas` is called where a process starts running stages (the CLI, and the Dagster code
location that the UI's runs load): arenas made before it stay, later threads share the two. A user's
own `MALLOC_ARENA_MAX` is left as set. `release_free_memory` hands the arenas' free pages back to the
system when a stage ends, so the next stage starts from what is really held. Elsewhere than glibc
(macOS, musl) both do nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_ARENA_MAX = -8  # mallopt's parameter number (glibc malloc.h)
ARENAS = 2


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas from now on in this process; True where glibc took the limit."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Return the free pages of every arena to the system (glibc's malloc_trim(0)); True where some were."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
