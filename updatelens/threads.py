"""Small LAPACK calls on every core: a batched LAPACK call (eigh, QR, SVD of small matrices) runs its
matrices one after another on one core whatever torch's thread count, so on the CPU such work runs in
chunks on one worker thread per core, each single-threaded (torch releases the GIL)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Within the context torch's intra-op thread count is n; the previous count is restored on
    exit, also when the body fails. The setting is process-wide."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def per_core_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None) -> list[R]:
    """[fn(item) for item in items], in order, on `workers` threads (default: torch's thread count)
    with torch single-threaded meanwhile; one worker runs in the calling thread as is."""
    items = list(items)
    n = min(torch.get_num_threads() if workers is None else workers, len(items))
    if n <= 1:
        return [fn(item) for item in items]
    with torch_threads(1), ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, items))
