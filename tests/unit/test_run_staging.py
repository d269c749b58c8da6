"""Stage, then swap: a run's partitions are staged under `_staging/run-<id>/`, read back from there by the
run's later stages, and swapped into place by its last stage; a run that stops before leaves the stored
partitions as they were, and a commit cut short is finished by the next clean."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from tests.processes import dead_pid
from updatelens.storage import catalog, layout
from updatelens.storage.integrity import sha256_of
from updatelens.storage.layout import partition_file
from updatelens.storage.staging import RUN_COMMIT, RUN_OWNER, clean_abandoned_staging, run_dir
from updatelens.storage.store import Partition, RunScope, Store

STAGES = ("activations", "local_fits", "residuals")


@pytest.fixture(autouse=True)
def any_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tables are stand-ins of a few columns: the declared schemas are not what is tested here."""
    monkeypatch.setattr(Partition, "validate", lambda self, table: None)


def rows(layer: int, value: float, n: int = 4) -> pa.Table:
    return pa.table({"model": ["m"] * n, "layer": pa.array([layer] * n, pa.int32()), "config_id": ["c"] * n,
                     "seq": pa.array(range(n), pa.int32()), "pos": pa.array([1] * n, pa.int32()),
                     "corpus_slice": ["s"] * n, "v": [value] * n})


def stored(root: Path, value: float) -> dict[str, str]:
    """Every table of STAGES for layers 0 and 1, written in place; returns each file's SHA-256."""
    store = Store.open(root)
    for table in ("activations", "local_fits", "residuals"):
        for layer in (0, 1):
            store.partition(table, "m", layer).write(rows(layer, value))
    return files(root)


def files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_of(p) for p in sorted(root.glob("*/model=m/layer=*/part-0.parquet"))}


def step(root: Path, stage: str, run_id: str = "r1") -> Store:
    return Store.open(root).for_run(RunScope(run_id, STAGES, stage))


def test_a_runs_stages_read_what_it_staged_and_nothing_moves_until_its_last_stage_commits(tmp_path: Path) -> None:
    before = stored(tmp_path, 1.0)
    first, last = step(tmp_path, "activations"), step(tmp_path, "residuals")
    first.partition("activations", "m", 0).write(rows(0, 2.0))
    # the run's later stage reads the staged activations; the root and its views still hold the old ones
    assert last.partition("activations", "m", 0).read()["v"][0].as_py() == 2.0
    assert Store.open(tmp_path).partition("activations", "m", 0).read()["v"][0].as_py() == 1.0
    assert catalog.query(tmp_path, "SELECT max(v) AS v FROM activations")["v"][0] == 1.0
    assert files(tmp_path) == before
    # a table of a stage the run does not run is read in place
    other = Store.open(tmp_path).for_run(RunScope("r2", ("residuals",), "residuals"))
    assert other.partition("activations", "m", 0).file == partition_file(tmp_path, "activations", "m", 0)
    # the url and relative path name the place the commit puts it
    assert first.partition("activations", "m", 0).relative == "activations/model=m/layer=0/part-0.parquet"
    last.partition("residuals", "m", 0).write(rows(0, 2.0))
    assert sorted(last.commit()) == ["activations/model=m/layer=0", "residuals/model=m/layer=0"]
    now = Store.open(tmp_path)
    assert now.partition("activations", "m", 0).read()["v"][0].as_py() == 2.0
    assert now.partition("residuals", "m", 0).read()["v"][0].as_py() == 2.0
    assert now.partition("local_fits", "m", 0).read()["v"][0].as_py() == 1.0  # not staged: left as it was
    assert not run_dir(tmp_path, "r1").exists()


def test_a_run_that_stops_before_its_commit_leaves_every_stored_partition_and_is_cleaned_once_over(
        tmp_path: Path) -> None:
    before = stored(tmp_path, 1.0)
    store = step(tmp_path, "activations")
    for layer in (0, 1):
        store.partition("activations", "m", layer).write(rows(layer, 9.0))
    assert files(tmp_path) == before
    staged = run_dir(tmp_path, "r1")
    # its writer (this process) lives and nobody says otherwise: kept
    assert clean_abandoned_staging(tmp_path) == [] and staged.exists()
    # the orchestrator's word comes first: going is kept whoever wrote, over is removed
    assert clean_abandoned_staging(tmp_path, lambda run_id: True) == [] and staged.exists()
    assert clean_abandoned_staging(tmp_path, lambda run_id: False) == ["run-r1"] and not staged.exists()
    assert files(tmp_path) == before
    # without the orchestrator's word: removed once the process that wrote into it is gone
    step(tmp_path, "activations", "r3").partition("activations", "m", 0).write(rows(0, 9.0))
    owner = run_dir(tmp_path, "r3") / RUN_OWNER
    owner.write_text(json.dumps({**json.loads(owner.read_text()), "pid": dead_pid()}))
    assert clean_abandoned_staging(tmp_path, lambda run_id: None) == ["run-r3"]
    assert files(tmp_path) == before


def test_a_staged_table_that_is_gone_is_named_not_read_from_the_root(tmp_path: Path) -> None:
    stored(tmp_path, 1.0)
    step(tmp_path, "activations").partition("activations", "m", 0).write(rows(0, 2.0))
    shutil.rmtree(run_dir(tmp_path, "r1"))
    with pytest.raises(FileNotFoundError, match="was staged by this run .* and is gone"):
        step(tmp_path, "local_fits").partition("activations", "m", 0).read()


def test_a_commit_cut_short_is_finished_by_the_next_clean_never_undone(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    stored(tmp_path, 1.0)
    store = step(tmp_path, "residuals")
    for table in STAGES:
        store.partition(table, "m", 1).write(rows(1, 5.0))
    staged_sha = {t: sha256_of(partition_file(run_dir(tmp_path, "r1"), t, "m", 1)) for t in STAGES}
    install, calls = layout._install, []

    def crash_on_the_second(*args: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-commit")
        install(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layout, "_install", crash_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        store.commit()
    monkeypatch.setattr(layout, "_install", install)
    assert (run_dir(tmp_path, "r1") / RUN_COMMIT).exists()
    assert sha256_of(partition_file(tmp_path, "activations", "m", 1)) == staged_sha["activations"]
    assert sha256_of(partition_file(tmp_path, "local_fits", "m", 1)) != staged_sha["local_fits"]
    removed = clean_abandoned_staging(tmp_path, lambda run_id: False)
    assert removed == ["run-r1 (its commit, cut short, finished)"]
    for table in STAGES:  # every partition of the run is its new one; nothing was put back
        assert sha256_of(partition_file(tmp_path, table, "m", 1)) == staged_sha[table]
    assert not run_dir(tmp_path, "r1").exists()


def test_a_scope_names_the_pipelines_stages() -> None:
    with pytest.raises(ValueError, match="not the pipeline's stages"):
        RunScope("r", ("activations", "fits"), "activations")
    with pytest.raises(ValueError, match="not the pipeline's stages"):
        RunScope("r", ("activations",), "residuals")


def test_the_step_that_finishes_the_runs_last_stage_to_finish_is_the_one_that_commits(tmp_path: Path) -> None:
    """A run's stages that read the same tables finish in whatever order the executor picks."""
    assert [step(tmp_path, stage).stage_done() for stage in ("residuals", "activations")] == [False, False]
    assert step(tmp_path, "local_fits").stage_done()
    assert Store.open(tmp_path).stage_done()  # outside a run: every write is in place already


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)


def _context(stage: str, keys: list[str], going: dict[str, bool]) -> Any:
    """What await_staged_inputs reads of a step's context: its asset, partitions, log and the instance's runs."""
    runs = {run_id: SimpleNamespace(is_finished=not on) for run_id, on in going.items()}
    return SimpleNamespace(asset_key=dg.AssetKey(stage), partition_keys=keys, log=_Log(),
                           instance=SimpleNamespace(get_run_by_id=runs.get))


def test_a_step_waits_while_another_going_run_has_staged_its_inputs_and_goes_on_once_they_are_swapped_in(
        tmp_path: Path) -> None:
    """Declarative automation can launch a stage on the record of its upstream's step before that step's
    run has swapped the partitions in: the launched step waits for them (before the layers' locks,
    which the commit takes), reads them once in place, and gives up with the run named after its wait."""
    from updatelens.assets.common import await_staged_inputs

    backfill = step(tmp_path, "activations", "backfill")
    for layer in (0, 1):
        backfill.partition("activations", "m", layer).write(rows(layer, 3.0))
    later = Store.open(tmp_path).for_run(RunScope("auto", ("local_fits",), "local_fits"))
    wanted = ["activations/model=m/layer=0", "activations/model=m/layer=1"]
    assert later.staged_elsewhere(["activations"], "m", [0, 1]) == {"backfill": wanted}  # its writer: alive
    assert later.staged_elsewhere(["activations"], "m", [0, 1], lambda run: False) == {}  # over: not waited for
    assert later.staged_elsewhere(["activations"], "m", [2]) == {}
    # the backfill's own later stage reads them from its folder: nothing to wait for
    assert step(tmp_path, "local_fits", "backfill").staged_elsewhere(["activations"], "m", [0, 1]) == {}

    context = _context("local_fits", ["m:00", "m:01"], {"backfill": True})
    with pytest.raises(RuntimeError, match="run\\(s\\) backfill still write inputs of this step"):
        await_staged_inputs(context, later, wait_s=0.0)
    assert context.log.lines == [f"waiting for run backfill, which is writing {', '.join(wanted)}: they appear "
                                 "when its last stage ends (stage, then swap)"]
    timer = threading.Timer(1.0, lambda: step(tmp_path, "activations", "backfill").commit())
    timer.start()
    started = time.monotonic()
    await_staged_inputs(_context("local_fits", ["m:00", "m:01"], {"backfill": True}), later, wait_s=60.0)
    timer.join()
    assert time.monotonic() - started >= 1.0
    assert later.partition("activations", "m", 1).read()["v"][0].as_py() == 3.0
