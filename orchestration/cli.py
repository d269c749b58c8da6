"""`updatelens run | sql | verify | ui | notebook | report | sweep | converge | calibrate | worker`: the
command line over the data product. This module parses the arguments and dispatches; the commands
live in `commands.py` (those that compute) and `serving.py` (those that read or serve a root)."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys

from updatelens.config import field_help, flag_fields, settings_help
from updatelens.memory import limit_malloc_arenas
from updatelens.orchestration.commands import cmd_calibrate, cmd_converge, cmd_report, cmd_run, cmd_sweep, cmd_worker
from updatelens.orchestration.serving import cmd_notebook, cmd_sql, cmd_ui, cmd_verify
from updatelens.registry import DEFAULT_CORPUS, DEFAULT_MODEL
from updatelens.sweep import DEFAULT_GRID, SWEEP_LAYERS


def positive_seconds(text: str) -> float:
    """A time limit in seconds: a finite number above 0 (argparse names the flag and exits 2 otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The options several commands share, declared once (argparse parents): the data root; the model
    and corpus of the commands that compute; the registry."""
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument("--data-root", help="a local folder or an fsspec URL such as s3://bucket/prefix "
                                          "(default: $UPDATELENS_DATA or ./data)")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default=DEFAULT_MODEL, help=f"registry slug (default: the embedded {DEFAULT_MODEL})")
    model.add_argument("--corpus", default=DEFAULT_CORPUS, help=f"registry slug (default: {DEFAULT_CORPUS})")
    registry = argparse.ArgumentParser(add_help=False)
    registry.add_argument("--registry", help="default: $UPDATELENS_REGISTRY or registry/registry.toml")
    return root, model, registry


def main(argv: list[str] | None = None) -> int:
    limit_malloc_arenas()  # before any worker thread allocates (updatelens.memory)
    parser = argparse.ArgumentParser(prog="updatelens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    data_root, model_corpus, registry = shared_options()

    run = sub.add_parser("run", help="materialize every stage for a model, headless", epilog=settings_help(),
                         formatter_class=argparse.RawDescriptionHelpFormatter, parents=[model_corpus, data_root, registry])
    run.add_argument("--layers", help="layers like 3-7, 0,15,29 or 3-7,10 (default: all, or the preset's)")
    run.add_argument("--preset", help="named settings: study (1024 x 128 tokens; first, middle and last layer; "
                                      "intervals for every finding); --set and the flags override them")
    for field in flag_fields():  # from the configuration's declaration (updatelens.config.setting)
        run.add_argument(field.metadata["flag"], dest=field.name, help=field_help(field))
    run.add_argument("--force", action="store_true",
                     help="recompute partitions that are already up to date (default: only missing or stale)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="any setting listed below, e.g. --set exclusion=self --set controls=random")
    run.add_argument("--profile", choices=["local", "celery", "k8s"],
                     help="deployment profile (default: $UPDATELENS_PROFILE or local); celery/k8s run one "
                          "run per layer on the cluster's workers")
    run.add_argument("--max-runs", dest="max_runs", type=int, default=4,
                     help="per-layer runs in flight at once (celery/k8s profiles)")
    run.add_argument("--no-report", dest="no_report", action="store_true",
                     help="store the results only; build the model's report and the comparison later "
                          "(`updatelens report`)")
    run.add_argument("--summary-json", dest="summary_json", metavar="PATH",
                     help="also write the pipeline's wall time and peak memory to PATH as JSON")
    run.set_defaults(func=cmd_run)

    worker = sub.add_parser("worker", help="start a Celery worker for the celery profile (broker: "
                                           "$UPDATELENS_CELERY_BROKER, default redis://127.0.0.1:6379/0)")
    worker.add_argument("--queues", default="gpu,cpu",
                        help="comma-separated: gpu (steps that load the model), cpu (fits, residuals, geometry)")
    worker.add_argument("--name", help="worker name (default: <queues>-<pid>@<host>)")
    worker.add_argument("--concurrency", type=int, default=1,
                        help="steps at once (1: the solo pool, one model in memory)")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(func=cmd_worker)

    sql = sub.add_parser("sql", help="run SQL over the stored tables and print the result", parents=[data_root])
    sql.add_argument("query")
    sql.add_argument("--write", action="store_true",
                     help="allow statements that write (COPY ... TO, CREATE, ATTACH); default: read-only")
    sql.add_argument("--timeout", type=positive_seconds, metavar="SECONDS",
                     help="stop a query still running after this many seconds, a positive number (default: no limit)")
    sql.set_defaults(func=cmd_sql)

    verify = sub.add_parser("verify", help="check every stored partition file; list damaged files and incomplete "
                                           "layers (exit 1 if any)", parents=[data_root])
    verify.add_argument("--repair", action="store_true",
                        help="move damaged files to <root>/_quarantine/ (never deleted); `run` then recomputes them")
    verify.set_defaults(func=cmd_verify)

    ui = sub.add_parser("ui", help="start the Dagster UI (dagster dev) on 127.0.0.1; it serves one data root, with "
                                   "its own Dagster instance (<root>/_dagster)", parents=[data_root])
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=3000)
    ui.set_defaults(func=cmd_ui)

    nb = sub.add_parser("notebook", help="open the exploration notebook (marimo) over the stored results",
                        parents=[data_root])
    nb.add_argument("--host", default="127.0.0.1")
    nb.add_argument("--port", type=int, default=2718)
    nb.add_argument("--headless", action="store_true", help="serve without opening a browser")
    nb.add_argument("--edit", action="store_true",
                    help="open an editable copy (<data root>/_notebook/notebook.py, made once) in marimo's editor "
                         "instead of the app, whose cells run as the page opens")
    nb.set_defaults(func=cmd_notebook)

    rep = sub.add_parser("report", help="rebuild reports (HTML + PNG) from stored results, no recomputation",
                         parents=[data_root])
    rep.add_argument("--model", help="registry slug (default: every model with results)")
    rep.set_defaults(func=cmd_report, set=None, classes=None, n_seq=None, seq_len=None, k=None, rank=None, preset=None)

    swp = sub.add_parser("sweep", help="analyse a model under a grid of conventions; prints the sensitivity table",
                         parents=[model_corpus, data_root, registry])
    swp.add_argument("--grid", help="JSON {setting: [values]}, one at a time around the baseline "
                                    f"(default: {json.dumps(DEFAULT_GRID)})")
    swp.add_argument("--layers", help="comma-separated layers (default: --n-layers spread over the depth)")
    swp.add_argument("--n-layers", dest="n_layers", type=int, help=f"how many layers when --layers is not given ({SWEEP_LAYERS})")
    swp.add_argument("--with-controls", action="store_true", help="also run the random/crude controls per config")
    swp.add_argument("--set", action="append", metavar="KEY=VALUE", help="baseline AnalysisConfig fields")
    swp.set_defaults(func=cmd_sweep, classes=None, n_seq=None, seq_len=None, k=None, rank=None, preset=None)

    conv = sub.add_parser("converge", help="analyse nested samples of growing size; prints each finding "
                                           "against the sample size with its interval",
                          parents=[model_corpus, data_root, registry])
    conv.add_argument("--tokens", default="2048,8192,32768,131072",
                      help="sample sizes in tokens, multiples of seq_len (default 2048,8192,32768,131072)")
    conv.add_argument("--layers", help="layers like 3-7 or 0,15,29 (default: the first, middle and last)")
    conv.add_argument("--preset", default="study",
                      help="named settings of every size (default: study, so that 131k tokens is the study "
                           "preset's run; '' for the engine's defaults); --set overrides them")
    conv.add_argument("--force", action="store_true", help="recompute sizes that are already up to date")
    conv.add_argument("--set", action="append", metavar="KEY=VALUE", help="AnalysisConfig fields of every size")
    conv.set_defaults(func=cmd_converge, classes=None, n_seq=None, seq_len=None, k=None, rank=None)

    cal = sub.add_parser("calibrate", help="the estimator's power: the real update and the positive controls (tokenwise "
                                           "by construction) fitted at growing sample sizes and k",
                         parents=[model_corpus, data_root, registry])
    cal.add_argument("--tokens", default="2048,8192,32768",
                     help="sample sizes in tokens, multiples of seq_len, nested (default 2048,8192,32768)")
    cal.add_argument("--k", dest="ks", default="16,64,256", help="neighbour counts (default 16,64,256)")
    cal.add_argument("--layers", help="layers like 3-7 or 0,15,29 (default: the first, middle and last)")
    cal.add_argument("--anchors", type=int, default=2048, help="anchors scored per layer and size (default 2048)")
    cal.add_argument("--set", action="append", metavar="KEY=VALUE", help="AnalysisConfig fields")
    cal.set_defaults(func=cmd_calibrate, classes=None, n_seq=None, seq_len=None, k=None, rank=None, preset=None)


    args = parser.parse_args(argv)
    from updatelens.errors import UpdateLensError

    try:
        return int(args.func(args))
    except UpdateLensError as exc:  # a problem of the input or the setup: its message, not a traceback
        print(f"updatelens {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and for the commands that write, what is left
        left = ("; every partition is written whole or not at all, so what is stored verifies: `updatelens verify` "
                "names what is missing and the next `updatelens run` redoes it"
                if args.command in WRITERS else "")
        print(f"updatelens {args.command}: interrupted{left}", file=sys.stderr)
        return 130
    except Exception as exc:
        root = getattr(args, "data_root", None) or os.environ.get("UPDATELENS_DATA", "data")
        full = disk_full(exc)
        if full is not None:
            left = ("; every partition is written whole or not at all: what is stored verifies, and the next run "
                    "redoes what is missing" if args.command in WRITERS else "")
            print(f"updatelens {args.command}: the disk is full (or failing) writing under the data root {root} "
                  f"({full}): free some space and run again{left}", file=sys.stderr)
            return 1
        where = cannot_write(exc)
        if where is None:
            raise
        print(f"updatelens {args.command}: cannot write under the data root {root} ({where}); it is read-only "
              f"here: copy it to a writable place (`cp -a`; a copy re-verifies on first use) and point "
              f"--data-root at the copy", file=sys.stderr)
        return 2


WRITERS = ("run", "sweep", "converge", "calibrate", "report")  # the commands that write under the root
READ_ONLY_SIGNS = ("read-only file system", "readonly database", "permission denied")


FULL_DISK_SIGNS = ("no space left on device", "database or disk is full", "disk i/o error", "disk quota exceeded",
                   "file too large")


def _write_failure(exc: BaseException, errnos: tuple[int, ...], signs: tuple[str, ...]) -> str | None:
    """What could not be written, when `exc` or what caused it (an OSError under a DuckDB, SQLite,
    SQLAlchemy or Parquet error) is an OSError with one of `errnos`, or says one of `signs`; else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in errnos:
            return f"{current.strerror}: {current.filename}" if current.filename else str(current.strerror)
        text = str(current).strip()
        if any(sign in text.lower() for sign in signs):
            return text.splitlines()[0][:200]
        current = current.__cause__ or current.__context__
    return None


def disk_full(exc: BaseException) -> str | None:
    """What could not be written because the disk is full, over quota or failing; None otherwise."""
    return _write_failure(exc, (errno.ENOSPC, errno.EDQUOT, errno.EFBIG), FULL_DISK_SIGNS)


def cannot_write(exc: BaseException) -> str | None:
    """What could not be written because a file or folder is read-only or not ours to write; None otherwise."""
    return _write_failure(exc, (errno.EROFS, errno.EACCES, errno.EPERM), READ_ONLY_SIGNS)


if __name__ == "__main__":
    sys.exit(main())
