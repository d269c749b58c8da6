"""Writing the reports' figures as PNG files, in two processes where two CPUs are free.

Drawing a figure is matplotlib's Agg renderer driven from Python (ticks, texts, markers): 0.05 to
0.5 s for each of a report's figures, and the larger part of a report's time. It holds the
interpreter lock, so threads would not share the work; on Linux a forked child draws figures while
this process draws others. The two take the figures' numbers one at a time from a pipe (a read of one
byte from a pipe goes to one reader only), so neither waits while figures are left. The child only
renders figures that already exist (matplotlib, numpy and the PNG encoder; no polars, DuckDB or
other I/O than its files) and leaves with `os._exit`. If it fails or is killed, every figure this
process did not draw is drawn again here, so an error surfaces in this process with its traceback
and no partial file stays. The files go into the report's staging folder, which is published only once
complete (storage.layout.publish_dir).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

DPI = 90
MAX_FORKED = 255  # figures numbered by one byte each


def png(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=DPI)
    plt.close(figure)


def two_processes() -> bool:
    """Whether figures are drawn in two processes: on Linux (fork without the platform caveats of macOS),
    with two CPUs or more to run on."""
    return sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) >= 2


def save_pngs(figures: dict[Path, Figure], parallel: bool | None = None) -> None:
    """Write each figure to its path and close it; in two processes where `parallel` (default:
    `two_processes()`) and there are two figures or more. The files are those one process writes."""
    paths = sorted(figures, key=lambda p: -len(figures[p].axes))  # the larger first: the two end together
    if len(paths) < 2 or len(paths) > MAX_FORKED or not (two_processes() if parallel is None else parallel):
        for path in paths:
            png(figures[path], path)
        return
    read, write = os.pipe()
    os.write(write, bytes(range(len(paths))))  # far below a pipe's buffer: never blocks
    os.close(write)
    pid = os.fork()
    if pid == 0:  # the child: draw what it takes, then leave without this process's exit handlers
        code = 1
        try:
            while taken := os.read(read, 1):
                figures[paths[taken[0]]].savefig(paths[taken[0]], dpi=DPI)
            code = 0
        finally:
            os._exit(code)
    ours: set[int] = set()
    try:
        while taken := os.read(read, 1):
            ours.add(taken[0])
            png(figures[paths[taken[0]]], paths[taken[0]])
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    failed = os.waitstatus_to_exitcode(status) != 0  # failed or killed: its files may be missing or partial
    for i in (i for i in range(len(paths)) if i not in ours):
        if failed:
            png(figures[paths[i]], paths[i])
        else:
            plt.close(figures[paths[i]])
