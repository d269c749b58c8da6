"""Process-killing faults for the crash tests and the fault drill, injected by patching the storage
writer in this process (nothing in the product reads them):

    python -m bench.faults FAULT TABLE -- updatelens CLI arguments...

runs the CLI (in this process: `updatelens run` materializes in process) with the writer patched to
SIGKILL the process at FAULT while it writes a partition of TABLE:

- `mid_write`: once the first half of the partition's first table reached the staging file;
- `before_manifest`: the data file complete and fsynced, its manifest not yet written;
- `mid_replace`: the new partition swapped in, the old folder not yet removed;
- `fail_stage`: the stage named TABLE raises an error once it has read its inputs (a late failure:
  the run's earlier stages have written their partitions by then; the process is not killed).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

FAULTS = ("mid_write", "before_manifest", "mid_replace", "fail_stage")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: str, table: str) -> None:
    """Patch the writer so that it kills this process at `fault` on `table`."""
    from updatelens.storage import layout

    if fault == "mid_write":
        write = layout.ParquetSink.write

        def write_then_kill(self: layout.ParquetSink, rows: Any, row_group_rows: int = layout.ROW_GROUP_ROWS) -> None:
            if self.table_name != table:
                return write(self, rows, row_group_rows)
            write(self, rows.slice(0, max(1, len(rows) // 2)), row_group_rows)
            _kill()

        layout.ParquetSink.write = write_then_kill  # type: ignore[method-assign, assignment]  # the planted fault
    elif fault == "before_manifest":
        write_manifest = layout.write_manifest

        def kill_before(path: Any, table_name: str, *args: Any, **kwargs: Any) -> Any:
            if table_name == table:
                _kill()
            return write_manifest(path, table_name, *args, **kwargs)

        layout.write_manifest = kill_before  # type: ignore[assignment]  # the planted fault
    elif fault == "mid_replace":
        keep_damaged = layout._keep_damaged

        def kill_after_swap(root: Any, old: Any, final: Any, damaged: Any) -> None:
            if final.parent.parent.name == table:
                _kill()
            keep_damaged(root, old, final, damaged)

        layout._keep_damaged = kill_after_swap
    elif fault == "fail_stage":
        from updatelens.assets import common

        finish = common.finish

        def fail_in_stage(store: Any, *args: Any, **kwargs: Any) -> Any:
            if store.run is not None and store.run.stage == table:
                raise RuntimeError(f"planted failure at the end of stage {table}")
            return finish(store, *args, **kwargs)

        common.finish = fail_in_stage  # the planted fault (every stage finishes through it: StageRun.finish)
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    install(argv[0], argv[1])
    from updatelens.orchestration.cli import main as cli

    return cli(argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
