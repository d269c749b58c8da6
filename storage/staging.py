"""What a data root stages before it shows it, and cleaning up after writers that died.

A run's staging ("stage, then swap"): a run writes every partition of its stages under
`<root>/_staging/run-<run id>/` (the layout's own shape), its later stages read them back from
there, and the last of its stages to finish (`stage_done`) swaps them all into place (`commit_run`),
so a run that stops before (an error, a blocking check, a kill) leaves every stored partition as it
was. The folder's `owner.json` names the process that last wrote into it; its `commit.json`, written
before the first swap, lists each partition with its file's SHA-256, so a commit cut short is
finished (never undone) by the next clean. `clean_abandoned_staging` removes what crashed writers left anywhere under a root.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from upath import UPath

from updatelens.storage import layout
from updatelens.storage.integrity import PART_FILE, partition_error, read_manifest
from updatelens.storage.location import RootLike, as_root, is_local, local_path

RUN_PREFIX = "run-"
RUN_OWNER = "owner.json"
RUN_COMMIT = "commit.json"


def run_dir(root: RootLike, run_id: str) -> UPath:
    """Where a run stages its partitions (nothing is created)."""
    return as_root(root) / layout.STAGING / f"{RUN_PREFIX}{run_id}"


def claim_run_dir(root: RootLike, run_id: str) -> UPath:
    """The run's staging folder, created, naming this process as the one writing into it (a later clean
    leaves the folder alone while that process lives)."""
    where = run_dir(root, run_id)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
    if is_local(where):
        Path(str(where)).mkdir(parents=True, exist_ok=True)
        tmp = Path(str(where)) / f".{RUN_OWNER}.{os.getpid()}"
        tmp.write_text(json.dumps(owner))
        os.replace(tmp, Path(str(where)) / RUN_OWNER)
    else:
        (where / RUN_OWNER).write_text(json.dumps(owner))
    return where


RUN_DONE = "done"  # a file per stage of the run that has written all it writes


def stage_done(root: RootLike, run_id: str, stage: str) -> set[str]:
    """Record in the run's folder that `stage` has written all it writes; returns the run's stages done
    so far. A run's stages that read the same tables run in whatever order (or at once) the
    executor picks, so the step that finds every stage of its run done is the one that commits."""
    done = claim_run_dir(root, run_id) / RUN_DONE
    if is_local(done):
        Path(str(done)).mkdir(exist_ok=True)
    (done / stage).write_text("")
    if not is_local(done):
        done.fs.invalidate_cache()
    return {p.name for p in done.iterdir()}


def staged_partitions(staged: RootLike) -> list[str]:
    """The partitions a run staged, as paths `<table>/model=<m>/layer=<l>` relative to its folder."""
    staged = as_root(staged)
    if not is_local(staged):
        staged.fs.invalidate_cache()
    found = staged.glob(f"*/model=*/layer=*/{PART_FILE}")
    return sorted(str(f.parent)[len(str(staged)):].strip("/") for f in found)


def staged_elsewhere(root: RootLike, run_id: str, wanted: set[str],
                     run_going: Callable[[str], bool | None] | None = None) -> dict[str, list[str]]:
    """{another run that is going: the partitions of `wanted` (`<table>/model=<m>/layer=<l>`) it has staged
    and not yet swapped in}: what another run is writing that this run would read in place. A run is
    going as `_clean_runs` judges it (the orchestrator's word first, else its writer alive)."""
    root = as_root(root)
    if not is_local(root):
        root.fs.invalidate_cache()
    found: dict[str, list[str]] = {}
    for staged in sorted((root / layout.STAGING).glob(f"{RUN_PREFIX}*"), key=str):
        other = staged.name[len(RUN_PREFIX):]
        if other == run_id or not (mine := sorted(set(staged_partitions(staged)) & wanted)):
            continue
        going = run_going(other) if run_going is not None else None
        if going or (going is None and _run_owner_alive(staged)):
            found[other] = mine
    return found


def _write_json(path: UPath, value: object) -> None:
    """A small JSON file written whole (locally: a temporary file renamed into place, fsynced)."""
    if not is_local(path):
        path.write_text(json.dumps(value))
        return
    local = Path(str(path))
    tmp = local.with_name(f".{local.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, local)
    layout._fsync_dir(local.parent)


def _file_sha(part_dir: UPath) -> str | None:
    entry = read_manifest(part_dir / PART_FILE)
    return None if entry is None else entry.get("sha256")


def commit_run(root: RootLike, run_id: str) -> list[str]:
    """Swap every partition the run staged into its place (each one whole, as `staged_dir` does), then
    remove the run's folder; returns the partitions swapped in. The list of what to swap, with each
    file's SHA-256, is written first: run again after a crash, it finishes the commit (a partition
    already holding its new file is skipped; one whose staged file is gone is named in a warning)."""
    root = as_root(root)
    where = run_dir(root, run_id)
    journal = where / RUN_COMMIT
    if not is_local(root):
        root.fs.invalidate_cache()
    if not where.exists():
        return []
    resuming = journal.exists()
    if resuming:
        plan: dict[str, str | None] = json.loads(journal.read_text())
    else:
        plan = {relative: _file_sha(where / relative) for relative in staged_partitions(where)}
        _write_json(journal, plan)
    swapped = []
    for relative, sha in plan.items():
        final, staged = root / relative, where / relative
        if resuming and sha is not None and _file_sha(final) == sha and partition_error(final / PART_FILE) is None:
            continue  # swapped in before the commit was cut short (a fresh commit swaps all: a recomputed
            # file can be byte-identical to a damaged one's manifest)
        if not (staged / PART_FILE).exists() or _file_sha(staged) != sha:
            warnings.warn(f"run {run_id}: the staged {relative} is gone; the stored one is left as it is", stacklevel=2)
            continue
        if is_local(root):
            layout._install(root, staged, final)
        else:
            _install_remote(root, staged, final)
        swapped.append(relative)
    if is_local(root):
        shutil.rmtree(local_path(where), ignore_errors=True)
    elif layout._find(where):
        root.fs.rm(where.path, recursive=True)
    return swapped


def _install_remote(root: UPath, staged: UPath, final: UPath) -> None:
    """On an object store: copy a staged partition's objects onto its final keys (the data file, then
    its manifest, last), drop what the old version had and this one lacks, remove the staged keys."""
    fs = root.fs
    names = sorted((key[len(staged.path):].lstrip("/") for key in layout._find(staged)),
                   key=lambda name: (layout.ENTRY_FILES.index(name) + 1 if name in layout.ENTRY_FILES else 0, name))
    layout._quarantine_damaged_remote(root, final)
    for name in names:
        fs.copy((staged / name).path, (final / name).path)
    new = {(final / name).path for name in names}
    stale = [key for key in layout._find(final) if key not in new]
    if stale:
        fs.rm(stale)
    fs.rm(staged.path, recursive=True)


def _run_owner_alive(staged: UPath) -> bool:
    """Whether the process that last wrote into a run's folder may still be writing: alive on this host;
    on another host (or unreadable), written to within layout.STALE_STAGING_S."""
    try:
        owner = json.loads((staged / RUN_OWNER).read_text())
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        owner = {}
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return _alive(owner["pid"])
    return time.time() - float(owner.get("at", 0.0)) < layout.STALE_STAGING_S


def _clean_runs(root: UPath, run_going: Callable[[str], bool | None] | None) -> list[str]:
    """The staging folders of runs that are over: a commit cut short is finished, anything else removed.
    `run_going` is the orchestrator's word (True: going, False: over, None: it does not know the run);
    the steps of one run may be separate processes, so its word comes first. Without it, a run is over
    when the process that last wrote into its folder is gone."""
    removed = []
    for staged in sorted((root / layout.STAGING).glob(f"{RUN_PREFIX}*"), key=str):
        run_id = staged.name[len(RUN_PREFIX):]
        going = run_going(run_id) if run_going is not None else None
        if going or (going is None and _run_owner_alive(staged)):
            continue
        if (staged / RUN_COMMIT).exists():
            commit_run(root, run_id)
            removed.append(f"{staged.name} (its commit, cut short, finished)")
            continue
        if is_local(root):
            shutil.rmtree(local_path(staged), ignore_errors=True)
        else:
            root.fs.rm(staged.path, recursive=True)
        removed.append(staged.name)
    return removed


def clean_abandoned_staging(root: RootLike, run_going: Callable[[str], bool | None] | None = None) -> list[str]:
    """Remove what a crashed writer left anywhere under the root: the staging dirs of the main tables
    and of every family root (each sweep configuration, each convergence size), and sweeps computed
    out of sight whose process is gone (`next_sweep_root`); locally those whose process is gone, on an
    object store those older than layout.STALE_STAGING_S; and the staging folders of runs that are over
    (`_clean_runs`, told by `run_going`). Returns their names."""
    root = as_root(root)
    if not is_local(root):
        root.fs.invalidate_cache()
    families = [root, *sorted(root.glob(f"{layout.SWEEPS}/config=*"), key=str),
                *sorted(root.glob(f"{layout.CONVERGENCE}/n_seq=*"), key=str)]
    removed = [name for family in families for name in _clean_runs(family, run_going) + _clean_staging(family)]
    for staged in sorted(root.glob(f"{layout.SWEEPS}/{layout.NEXT_SWEEP}/*"), key=str):
        pid = staged.name.split("-", 1)[0]
        alive = _alive(int(pid)) if pid.isdigit() and is_local(root) else not is_local(root)
        if not alive:  # a sweep in progress on an object store is not told from an abandoned one: kept
            layout.remove_next_sweep(root, staged)
            removed.append(f"{layout.SWEEPS}/{layout.NEXT_SWEEP}/{staged.name}")
    return removed


def _clean_staging(root: RootLike) -> list[str]:
    """The abandoned staging dirs of one root (the main tables' or a family's)."""
    root = as_root(root)
    removed: list[str] = []
    if not is_local(root):
        fs = root.fs
        staging = root / layout.STAGING
        if not fs.exists(staging.path):
            return removed
        newest: dict[str, float] = {}
        for key, info in fs.find(staging.path, detail=True).items():
            name = key[len(staging.path) + 1:].split("/", 1)[0]
            if name.startswith(RUN_PREFIX):
                continue  # a run's staging folder: _clean_runs
            modified = info.get("LastModified")
            stamp = modified.timestamp() if modified is not None else time.time()
            newest[name] = max(newest.get(name, 0.0), stamp)
        for name, stamp in newest.items():
            if time.time() - stamp > layout.STALE_STAGING_S:
                fs.rm((staging / name).path, recursive=True)
                removed.append(name)
        return removed
    for entry in sorted((root / layout.STAGING).glob("*"), key=lambda p: p.name.endswith(layout.TARGET_SUFFIX)):
        pid = entry.name.split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)) or not (entry.exists() or entry.is_symlink()):
            continue  # a live writer's, or a marker already handled with its folder
        marker = entry.parent / f"{entry.name}{layout.TARGET_SUFFIX}"
        if marker.exists():  # a folder its writer moved aside and never replaced: put it back
            target = Path(marker.read_text())
            if not target.exists() and entry.exists():
                os.rename(local_path(entry), local_path(target))
            marker.unlink(missing_ok=True)
        if entry.is_dir():
            shutil.rmtree(local_path(entry), ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
