"""Progress of long work, for a terminal and for logs.

`progress(desc, total, unit)` counts work done against a known total. On an interactive terminal it
draws a tqdm bar (rate and time left); whatever the terminal, it logs a line through the
`updatelens` logger at every `log_every` fraction of the total once the work has run for
`QUIET_S` seconds (short work logs only its final line), and at the end, with the same rate and
time left, so an orchestrator that captures Python logging (Dagster: see
`updatelens.assets.common.engine_logs`) shows the progress of a run step by step.

$UPDATELENS_PROGRESS: `auto` (default: a bar when stderr is a terminal), `bar` (always, on stderr),
`tty` (on the controlling terminal: what `updatelens run` sets when started from one, because
Dagster captures a step's stderr into its log files) or `off` (no bar; the log lines stay).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm.auto import tqdm

log = logging.getLogger("updatelens")
PROGRESS_ENV = "UPDATELENS_PROGRESS"
QUIET_S = 5.0  # no intermediate log lines before this much time has passed


def _open_tty() -> TextIO | None:
    try:
        return open("/dev/tty", "w")
    except OSError:  # no controlling terminal
        return None


def _bar_file() -> TextIO | None:
    """Where the bar goes, or None for no bar."""
    mode = os.environ.get(PROGRESS_ENV, "auto")
    if mode == "bar" or (mode == "auto" and sys.stderr.isatty()):
        return sys.stderr
    return _open_tty() if mode == "tty" else None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Work done of `total`; see the module docstring."""

    def __init__(self, desc: str, total: int, unit: str, log_every: float = 0.05) -> None:
        self.desc, self.total, self.unit = desc, max(int(total), 0), unit
        self.done = 0
        self._lock = threading.Lock()  # updates may come from worker threads (threaded fits)
        self.started = time.perf_counter()
        self._step = max(1, int(self.total * log_every)) if self.total else 1
        self._next_log = self._step
        self._file = _bar_file() if self.total else None
        self._bar = tqdm(total=self.total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=self._file) \
            if self._file is not None else None

    def line(self) -> str:
        """`desc: done/total unit (pct%), rate unit/s, time left m:ss` for the work so far."""
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100 * self.done // self.total if self.total else 100
        eta = _duration(left) if left == left else "?"
        return (f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct}%), {rate:.3g} {self.unit}/s, "
                f"{'done in ' + _duration(elapsed) if self.done >= self.total else 'time left ' + eta}")

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done = min(self.total, self.done + n)
            if self._bar is not None:
                self._bar.update(n)
            quiet = time.perf_counter() - self.started < QUIET_S and self.done < self.total
            if self.done >= self._next_log and not quiet:
                log.info(self.line())
                while self._next_log <= self.done:
                    self._next_log += self._step
                if self.done >= self.total:
                    self._next_log = self.total + 1  # the final line once

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None and self._file not in (sys.stderr, sys.stdout):
            self._file.close()


@contextmanager
def progress(desc: str, total: int, unit: str = "it", log_every: float = 0.05) -> Iterator[Progress]:
    bar = Progress(desc, total, unit, log_every)
    try:
        yield bar
    finally:
        bar.close()
