"""The commands that read or serve a data root and compute nothing: `sql`, `verify`, `ui` and
`notebook` (cli.py parses their arguments and dispatches here; the commands that compute are in
commands.py). None of them imports torch or transformers: they answer in a second."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from updatelens.orchestration.output import print_rows

if TYPE_CHECKING:
    from updatelens.storage.location import RootLike


def cmd_sql(args: argparse.Namespace) -> int:
    import duckdb

    from updatelens.storage import catalog
    from updatelens.storage.location import existing_root

    root = existing_root(args.data_root, "sql")
    try:
        columns, rows = catalog.fetch(root, args.query, write=args.write, timeout_s=args.timeout)
    except (duckdb.Error, catalog.ReadOnlyError, catalog.QueryTimeout) as exc:
        print(f"updatelens sql: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("updatelens sql: interrupted; nothing was written", file=sys.stderr)
        return 130
    if columns:
        print_rows(columns, rows)
    return 0


def layer_list(layers: list[int]) -> str:
    """Layers as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    from updatelens.orchestration.runner import contiguous_ranges

    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in contiguous_ranges(layers))


def cmd_verify(args: argparse.Namespace) -> int:
    """Every stored partition file checked against its manifest; damaged ones listed and, with --repair,
    moved to <root>/_quarantine/ (the next `updatelens run` recomputes them); incomplete layers listed."""
    from updatelens.stages import TABLES
    from updatelens.storage import catalog
    from updatelens.storage.integrity import incomplete_layers, mixed_layers, mixed_weights, quarantine
    from updatelens.storage.location import existing_root
    from updatelens.storage.store import Store

    root = existing_root(args.data_root, "verify")
    damaged = catalog.verify_root(root, full=True).damaged  # every checksum recomputed
    for d in damaged:
        print(f"damaged: {d.path}: {d.reason}")
        if args.repair:
            print(f"  quarantined to {quarantine(root, d.path)}")
    incomplete = incomplete_layers(root, TABLES)
    for model, layer, missing in incomplete:
        print(f"incomplete: model={model} layer={layer}: no {', '.join(missing)}")
    for model, layer, runs in mixed_layers(root, TABLES):  # a run with other settings stopped midway
        parts = "; ".join(f"{', '.join(tables)} at config {config}" for config, tables in runs.items())
        print(f"incomplete: model={model} layer={layer}: its tables come from different runs: {parts}")
        incomplete.append((model, layer, []))
    mixed = mixed_weights(root, TABLES)
    for model, revisions in mixed.items():  # another model's weights stored under the same name
        parts = "; ".join(f"layers {layer_list(layers)} from {rev or 'unrecorded weights'}"
                          for rev, layers in revisions.items())
        print(f"mixed weights: model={model}: its rows come from {len(revisions)} sets of weights: {parts}")
    db_path = catalog.catalog_path(root)
    catalog_damage = catalog.catalog_error(db_path) if db_path is not None else None
    if catalog_damage:
        print(f"damaged: the catalog {db_path}: {catalog_damage}"
              + (" (set aside and rebuilt)" if args.repair else "; the next run or `verify --repair` rebuilds it"))
    if args.repair:
        for name in Store.open(root).clean_abandoned_staging():
            print(f"removed abandoned staging {name}")
        if damaged or catalog_damage:
            catalog.refresh(root)
    if not damaged and not catalog_damage and not incomplete and not mixed:
        print("every stored partition verifies; every stored layer is complete")
        return 0
    if mixed:
        print("`updatelens run` over every stored layer of a mixed model recomputes them with the weights it "
              "now finds")
    if (damaged or catalog_damage) and not args.repair:
        print("run `updatelens verify --repair` to move the damaged files aside; `updatelens run` then recomputes "
              "them and the incomplete layers")
    elif incomplete or damaged:
        print("`updatelens run` (with the same --layers and settings) recomputes what is missing")
    return 1


def location_name(root: RootLike) -> str:
    """The UI's code location name for a data root: `updatelens` and the root, as letters, digits,
    dashes and underscores (e.g. updatelens-work-main-data)."""
    from updatelens.storage.location import is_url, local_path

    text = str(root) if is_url(str(root)) else str(local_path(root).resolve())
    return "updatelens-" + (re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-") or "root")


def cmd_ui(args: argparse.Namespace) -> int:
    from updatelens.orchestration.runner import project_dagster_home
    from updatelens.storage.location import default_data_root

    root = args.data_root or default_data_root()
    home = project_dagster_home(root)
    env = dict(os.environ, DAGSTER_HOME=str(home), UPDATELENS_DATA=str(root), HF_HUB_OFFLINE="1")
    # the code location by module (what workspace.yaml names), named after the data root it serves so the
    # UI says which root its runs and materializations belong to; works from any directory, installed or not
    workspace = home / "workspace.yaml"
    workspace.write_text("load_from:\n  - python_module:\n      module_name: updatelens.orchestration.definitions\n"
                         f"      location_name: {location_name(root)}\n")
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(workspace), "-h", args.host, "-p", str(args.port)]
    print(f"Dagster UI on http://{args.host}:{args.port} for the data root {root} (DAGSTER_HOME={home})", flush=True)
    return serve(cmd, env)


def serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run a server (dagster dev, marimo) until it ends; SIGTERM and SIGINT sent to this process are
    passed on to it, so stopping `updatelens ui` or `notebook` stops the server too (its default
    signal handling restored, so this holds even when started with `&`)."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: (
        signal.signal(signal.SIGINT, signal.SIG_DFL), signal.signal(signal.SIGTERM, signal.SIG_DFL)))

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait()


def cmd_notebook(args: argparse.Namespace) -> int:
    """Serve the exploration notebook (marimo) over the data root's catalog: the app, with its answers
    on the page as it opens, or (--edit) an editable copy in the data root."""
    import importlib.util

    from updatelens.errors import ConfigError

    if importlib.util.find_spec("marimo") is None or importlib.util.find_spec("altair") is None:
        raise ConfigError("the notebook needs marimo and altair: pip install 'updatelens[notebook]'")
    import shutil

    from updatelens.reports import notebook
    from updatelens.storage.location import existing_root, is_url

    root = existing_root(args.data_root, "notebook")
    env = dict(os.environ, UPDATELENS_DATA=root)
    # the app: every cell runs when the page opens, the code stays hidden, and marimo writes nothing
    # (its editor keeps session files beside the notebook: the editable copy lives in the data root)
    path = Path(notebook.__file__)
    if args.edit:
        if is_url(root):
            raise ConfigError("--edit keeps its copy of the notebook in the data root: use a local --data-root")
        copy = Path(root) / "_notebook" / "notebook.py"
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
        path = copy
    cmd = [sys.executable, "-m", "marimo", "edit" if args.edit else "run", str(path), "--host", args.host,
           "--port", str(args.port)]
    if args.headless:
        cmd.append("--headless")
    print(" ".join(cmd), flush=True)
    return serve(cmd, env)
