"""The stages' process holds at most two malloc arenas (updatelens.memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from updatelens.memory import ARENAS, limit_malloc_arenas

# six threads alive at once each allocate; glibc's malloc_stats prints one "Arena i:" block per arena
PROBE = """
import ctypes, sys, threading
from updatelens.memory import limit_malloc_arenas
if sys.argv[1] == "limit":
    limit_malloc_arenas()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(6)
def work():
    barrier.wait()
    blocks = [libc.malloc(4096) for _ in range(200)]
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threads_share_at_most_two_arenas_once_limited() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def arenas(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True)
        return sum(line.startswith("Arena ") for line in done.stderr.splitlines())

    assert arenas("limit") <= ARENAS < arenas("none")


def test_a_users_own_setting_is_left_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert limit_malloc_arenas() is False


def test_the_cli_and_the_code_location_limit_the_arenas(monkeypatch: pytest.MonkeyPatch) -> None:
    from updatelens.orchestration import cli, definitions
    from updatelens.orchestration.deployments import active_profile

    calls: list[str] = []
    monkeypatch.setattr(cli, "limit_malloc_arenas", lambda: calls.append("cli") or True)
    monkeypatch.setattr(definitions, "limit_malloc_arenas", lambda: calls.append("defs") or True)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    definitions.build_defs(active_profile())
    assert calls == ["cli", "defs"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_memory_goes_back_to_the_system() -> None:
    """Blocks freed inside an arena's heap stay resident until trimmed: release_free_memory hands them back."""
    probe = """
import ctypes
from updatelens.memory import release_free_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss():  # walked from the page tables (statm's counters lag behind a trim)
    line = next(line for line in open("/proc/self/smaps_rollup") if line.startswith("Rss:"))
    return int(line.split()[1]) * 1024
blocks, kept = [], []
for _ in range(3200):  # 200 MB in 64 KiB blocks (below the mmap threshold: in the heap), each followed by a
    blocks.append(libc.malloc(65536))  # small block that stays, so the freed ones are holes free() cannot return
    kept.append(libc.malloc(16))
for b in blocks:
    ctypes.memset(b, 1, 65536)
for b in blocks:
    libc.free(ctypes.c_void_p(b))
before = rss()
release_free_memory()
print(before - rss(), before)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    returned, held = map(int, done.stdout.split())
    assert held > 150 * 2**20 and returned > 150 * 2**20  # the holes were held after free(), and the trim returned them


def test_a_released_model_is_gone_from_memory(zoo: Path, tmp_path: Path) -> None:
    """The model the stages load stays cached for the next step until a step that has made its forward
    passes releases it: then nothing holds it (the weights' memory goes back before the work after)."""
    import gc
    import weakref

    from updatelens.assets import resources
    from updatelens.assets.resources import UpdateLensResource, release_models

    lens = UpdateLensResource(data_root=str(tmp_path / "data"), registry=str(zoo))
    lm = lens.load("tiny-gpt2")
    held = weakref.ref(lm.model)
    assert lens.load("tiny-gpt2") is lm  # cached between steps
    del lm
    gc.collect()
    assert held() is not None and resources._MODEL_CACHE
    release_models()
    assert held() is None and not resources._MODEL_CACHE
