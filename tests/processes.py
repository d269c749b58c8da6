"""A process id that no process has, for the tests of what dead writers leave behind."""

from __future__ import annotations

import os


def dead_pid(start: int = 2**22 + 4321) -> int:
    """The first id from `start` (above Linux's default pid_max) that no process has."""
    pid = start
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        pid += 1
