"""The bodies of the `updatelens` commands that compute: `run`, `worker`, `report`, `sweep`, `converge`,
`calibrate` (cli.py parses the arguments and dispatches here; the commands that only read or serve a
root are in serving.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from updatelens.orchestration.output import print_frame

if TYPE_CHECKING:
    from collections.abc import Callable

    import dagster as dg
    import polars as pl

    from updatelens.assets.resources import UpdateLensResource
    from updatelens.storage.store import Store

SUMMARY_SQL = """
SELECT layer, fn_class, n_tokens,
       round(rel_err_median, 3) AS rel_err_med,
       round(cos_full_tok_median, 3) AS cos_upd,
       round(cos_full_tok_map_median, 3) AS cos_map,
       round(frac_res_angle_gt60, 3) AS res_gt60,
       round(proj_tok_m16, 3) AS proj_tok16,
       round(proj_res_m16, 3) AS proj_res16,
       round(kl_mean, 4) AS kl_mean,
       round(spearman_relerr_kl, 3) AS rho_relerr_kl
FROM layer_summary WHERE model = $1 AND config_id = $2
ORDER BY layer, fn_class
"""


FINDINGS_SQL = """
SELECT model, config_id, finding, fn_class, round(value, 3) AS value, round(ci_lo, 3) AS ci_lo, round(ci_hi, 3) AS ci_hi,
       threshold, round(null_value, 3) AS null, null_outcome AS vs_null,
       round(self_first_value, 3) AS self_first, round(linear_value, 3) AS linear, control_outcome AS vs_control,
       coalesce(verdict, CASE WHEN note IS NOT NULL THEN 'not measured' END) AS verdict
FROM findings WHERE list_contains($1, model) ORDER BY model, config_id, finding
"""


def _held_configurations(lens: UpdateLensResource, model: str, layers: list[int]) -> dict[int, str]:
    """The configuration each of `layers` holds now (its activations partition's manifest), where one is stored."""
    from updatelens.storage.integrity import layer_runs

    held: dict[int, str] = {}
    for layer in layers:
        runs = layer_runs(lens.root, model, layer, ("activations",))
        if runs:
            held[layer] = next(iter(runs))
    return held


def _say_replaced(lens: UpdateLensResource, model: str, config_id: str, held: dict[int, str], n_layers: int) -> None:
    """After a run that rewrote layers holding another configuration: which, and what each configuration's
    findings now cover (a layer holds one configuration; a finding over fewer layers than it needs is
    'not measured')."""
    replaced: dict[str, list[int]] = {}
    for layer, old in sorted(held.items()):
        if old != config_id:
            replaced.setdefault(old, []).append(layer)
    if not replaced:
        return
    counts = lens.store.query("SELECT config_id, count(DISTINCT layer) AS n FROM layer_summary WHERE model = $1 "
                              "GROUP BY config_id ORDER BY n DESC, config_id", [model])
    cover = "; ".join(f"{c}: {n} of {n_layers} layers" for c, n in counts.iter_rows())
    for old, layers in replaced.items():
        print(f"\nnote: layer(s) {','.join(map(str, layers))} held configuration {old} and now hold {config_id}; "
              f"each configuration's findings cover only the layers it holds ({cover}), and a finding that "
              f"aggregates over fewer layers than it needs is 'not measured'")


def _parse_layers(text: str | None) -> list[int] | None:
    """"3-7", "0,15,29" or "3-7,10" -> sorted layers; None when not given. ValueError naming the bad
    part: an empty list, a part that is no layer, a reversed range."""
    if text is None:
        return None
    if not text.strip():
        raise ValueError("--layers is empty; give layers like 3-7, 0,15,29 or 3-7,10 (or leave it out for all)")
    layers: set[int] = set()
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        if not a.isdigit() or (dash and not b.isdigit()):
            raise ValueError(f"--layers {text!r}: {part.strip()!r} is not a layer or a range like 3-7")
        if dash and int(b) < int(a):
            raise ValueError(f"--layers {text!r}: the range {part.strip()!r} is reversed; write {b}-{a}")
        layers.update(range(int(a), int(b) + 1) if dash else [int(a)])
    return sorted(layers)


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """The analysis settings of the command line (preset, --set, flags), checked: an unknown key or a
    value of the wrong type is a ConfigError naming it."""
    from updatelens.config import AnalysisConfig, flag_fields, parse_setting, preset_settings
    from updatelens.errors import ConfigError

    preset = getattr(args, "preset", None)
    settings: dict[str, object] = preset_settings(preset) if preset else {}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set k=32")
        settings[key.strip()] = parse_setting(key.strip(), value)
    for field in flag_fields():  # the flags of the settings that have one (e.g. --k), after --set
        if getattr(args, field.name, None) is not None:
            settings[field.name] = parse_setting(field.name, getattr(args, field.name))
    AnalysisConfig.from_dict(settings)
    return settings


def cmd_run(args: argparse.Namespace) -> int:
    import dagster as dg

    from updatelens.assets.common import run_going
    from updatelens.config import preset_layers
    from updatelens.errors import UpdateLensError
    from updatelens.orchestration.deployments import PROFILE_ENV, active_profile
    from updatelens.orchestration.runner import (
        check_inputs,
        check_verdicts,
        failure_message,
        materialize_model,
        project_dagster_home,
        release_dead_runs,
        run_groups,
        stale_layers,
    )
    from updatelens.stages import STAGE_NAMES

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.stderr.isatty():  # progress bars on this terminal (Dagster captures the steps' stderr)
        os.environ.setdefault("UPDATELENS_PROGRESS", "tty")
    try:  # every input checked before anything is written (the data root, the Dagster home)
        layers = _parse_layers(args.layers)
        profile = active_profile(args.profile)
        lens = _lens_from(args)
        cfg = lens.config()
        cfg.validate()
    except (UpdateLensError, ValueError) as exc:
        print(f"updatelens run: {exc}", file=sys.stderr)
        return 2
    print(f"updatelens: model {args.model}, corpus {args.corpus}, config {cfg.config_id}, data {lens.data_root}",
          flush=True)
    start = time.perf_counter()
    try:
        report = check_inputs(args.model, lens, layers, args.preset)
    except (UpdateLensError, ValueError, OSError) as exc:
        print(f"updatelens run: {exc}", file=sys.stderr)
        return 2
    os.environ[PROFILE_ENV] = profile.name  # the run processes and their workers build the same executor
    os.environ["DAGSTER_HOME"] = str(project_dagster_home(lens.data_root))
    with dg.DagsterInstance.get() as instance:  # what killed runs left, before the plan reads the root
        for run_id in release_dead_runs(instance):
            print(f"run {run_id} was killed before it ended: marked failed, its pool slot freed", flush=True)
        for name in lens.store.clean_abandoned_staging(run_going(instance)):
            print(f"removed staging {name} left by a crashed run")
    wanted = layers or (preset_layers(args.preset, report.n_layers) if args.preset else list(range(report.n_layers)))
    other = _other_weights(lens, args.model, report.revision, wanted)
    if other:
        print(f"updatelens run: {other}", file=sys.stderr)
        return 2
    plan = stale_layers(lens, args.model, wanted, force=args.force, revision=report.revision)
    todo = sorted(plan)
    if not todo:
        print("every requested partition is up to date (same code version of each stage and config); --force recomputes")
    held = _held_configurations(lens, args.model, todo)  # what the layers to be rewritten hold now
    checks: list[tuple[str, bool, str]] = []  # (asset.check, passed, description)
    failures: list[str] = []
    with dg.DagsterInstance.get() as instance:  # entering makes it the current instance for Dagster
        if profile.per_layer_runs and todo:
            from updatelens.orchestration.distributed import materialize_layers_distributed

            print(f"profile {profile.name}: one run per layer for {len(todo)} layers, {args.max_runs} at a time",
                  flush=True)
            for run in materialize_layers_distributed(args.model, lens, instance, todo, args.max_runs, report=report,
                                                      stages=plan):
                checks += [(f"{name} (layer {run.layer})", passed, text) for name, passed, text in run.checks]
                where = ", ".join(f"{step}@{host}" for step, host in run.workers.items())
                print(f"  layer {run.layer}: run {run.run_id} {'ok' if run.success else 'FAILED'}"
                      + (f"; steps ran on {where}" if where else ""))
                failures += [f"layer {run.layer}: {run.failure}"] if not run.success else []
        for stages, layer_range in run_groups(plan) if not profile.per_layer_runs else []:
            which = "" if len(stages) == len(STAGE_NAMES) else f" ({', '.join(stages)}: the stages before are current)"
            print(f"running layers {layer_range[0]}-{layer_range[-1]}{which}", flush=True)
            result = materialize_model(args.model, lens, instance, layers=layer_range, log_level="INFO",
                                       raise_on_error=False, report=report, stages=stages)
            checks += check_verdicts(result)
            failures += [failure_message(result)] if not result.success else []
    wall = time.perf_counter() - start
    peak = _peak_rss_gib()
    if checks:
        print("\nData-quality checks:")
    for name, passed, text in checks:
        print(f"  {name}: {'passed' if passed else 'FAILED'}" + (f" - {text}" if text else ""))
    if failures:
        print(f"updatelens run: the run failed: {failures[0]}", file=sys.stderr)
        return 1
    print(f"\nPer-layer summary ({args.model}, config {cfg.config_id}; SQL view layer_summary):")
    print_frame(lens.store.query(SUMMARY_SQL, [args.model, cfg.config_id]))
    _say_replaced(lens, args.model, cfg.config_id, held, report.n_layers)
    where = "of the launcher; the steps ran in the workers" if profile.per_layer_runs else "of this process"
    print(f"\npipeline wall time {wall:.1f} s, peak RSS {peak:.2f} GiB ({where}); "
          f"catalog {lens.store.catalog_path() or 'in memory (updatelens sql)'}")
    if args.summary_json:  # for scripts (the bench): the same figures, machine-readable
        Path(args.summary_json).write_text(json.dumps({"pipeline_s": wall, "peak_rss_gib": peak, "layers": todo,
                                                       "model": args.model, "config_id": cfg.config_id}))
    if args.no_report:
        print("reports not built (--no-report): `updatelens report` builds them from the stored results")
        return 0
    with dg.DagsterInstance.get() as instance:
        return _reports([args.model], lens, instance)


def cmd_worker(args: argparse.Namespace) -> int:
    """A Celery worker for the `celery` profile (replaces this process)."""
    import importlib.util
    import socket

    from updatelens.errors import ConfigError
    from updatelens.orchestration.deployments import PROFILE_ENV

    if importlib.util.find_spec("dagster_celery") is None:
        raise ConfigError("the celery profile needs dagster-celery: pip install 'updatelens[celery]'")

    os.environ[PROFILE_ENV] = "celery"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = args.name or f"{args.queues.replace(',', '-')}-{os.getpid()}@{socket.gethostname()}"
    cmd = [sys.executable, "-m", "celery", "-A", "updatelens.orchestration.celery_app", "worker", "-Q", args.queues, "-n", name,
           "--prefetch-multiplier", "1", "-l", args.loglevel]
    cmd += ["--pool", "solo"] if args.concurrency == 1 else ["--concurrency", str(args.concurrency)]
    print(" ".join(cmd), flush=True)
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def _reports(models: list[str], lens: UpdateLensResource, instance: dg.DagsterInstance) -> int:
    """Materialize the models' reports and the comparison (the Dagster assets, after a run); print where they are."""
    from updatelens.orchestration.runner import failure_message, materialize_reports

    results = materialize_reports(models, lens, instance, raise_on_error=False)
    for result in results:
        if not result.success:
            print(f"updatelens: the report failed: {failure_message(result)}", file=sys.stderr)
            return 1
    _print_reports(lens.store, models)
    return 0


def _print_reports(store: Store, models: list[str]) -> None:
    """The models' findings, the weights they ran with, and where their reports and the comparison are."""
    from updatelens.reports.build import COMPARISON, reports_root

    base = reports_root(store.root)
    print("\nFindings (SQL view findings, docs/method.md): the null is the same measure without the claimed "
          "structure; self_first and linear, the same measure when the truth is tokenwise by construction "
          "(positive controls); estimator-limited: the value does not clear and the tokenwise target does not "
          "either, so the estimator cannot show the structure at this sample size")
    with store.reading() as query:
        print_frame(query(FINDINGS_SQL, [list(models)]))
        for line in _power_lines(query, models):
            print(line)
        weights = query("SELECT DISTINCT model, weights FROM findings WHERE list_contains($1, model) "
                        "ORDER BY model", [list(models)])
    for row in weights.to_dicts():
        print(f"{row['model']} ran with {row['weights']}")
    for model in models:
        print(f"report: {base / model / 'index.html'}")
    print(f"comparison across models: {base / COMPARISON / 'index.html'}")


def _power_lines(query: Callable[[str, list[object] | None], pl.DataFrame], models: list[str]) -> list[str]:
    """Per model, what the calibration study says of finding 1's power at the size this root's sample
    has: from the root's `calibration` view where it holds the model's rows, else the record shipped
    for the model (updatelens.power); nothing for a model with neither."""
    from updatelens.power import COLUMNS, power_line, shipped_rows

    views = set(query("SELECT view_name FROM duckdb_views()", None)["view_name"].to_list())
    if "layer_summary" not in views:
        return []
    sizes = query("SELECT model, max(n_tokens) AS n_tokens FROM layer_summary WHERE list_contains($1, model) "
                  "GROUP BY model ORDER BY model", [list(models)])
    has_view = "calibration" in views
    lines = []
    for row in sizes.to_dicts():
        model = row["model"]
        measured = (query(f"SELECT {', '.join(COLUMNS)} FROM calibration WHERE model = $1", [model])
                    if has_view else None)
        if measured is not None and not measured.is_empty():
            lines.append(f"{model}: " + power_line(measured, int(row["n_tokens"]), "this root's view calibration"))
            continue
        shipped = shipped_rows(model)
        if shipped is not None:
            lines.append(f"{model}: " + power_line(shipped, int(row["n_tokens"]),
                                                    f"the record shipped in updatelens/power/calibration-{model}.json"))
    return lines


def _lens_from(args: argparse.Namespace) -> UpdateLensResource:
    from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
    from updatelens.storage.location import is_url

    kwargs: dict[str, Any] = {}
    if getattr(args, "corpus", None):
        kwargs["corpus"] = args.corpus
    if args.data_root:
        kwargs["data_root"] = args.data_root if is_url(args.data_root) else str(Path(args.data_root).resolve())
    if getattr(args, "registry", None):
        kwargs["registry"] = str(Path(args.registry).resolve())
    return UpdateLensResource(analysis=AnalysisSettings(**_settings(args)), **kwargs)


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild reports from stored results: no model is loaded, nothing is recomputed, and neither
    torch nor Dagster is imported (the same builders as the Dagster assets `report` and
    `comparison_report`, which a run or the UI materializes)."""
    from updatelens.config import AnalysisConfig
    from updatelens.reports.build import (
        COMPARISON_FIGURES,
        MODEL_FIGURES,
        Reads,
        build_comparison,
        build_model_report,
        report_problems,
    )
    from updatelens.storage.location import existing_root
    from updatelens.storage.store import Store

    store = Store.open(existing_root(args.data_root, "report"))  # as_root makes a local path absolute
    config_id = AnalysisConfig.from_dict(_settings(args)).config_id  # the configuration shown first
    stored = store.query("SELECT DISTINCT model FROM layer_summary ORDER BY model") \
        if store.has_files("geometry") else None
    available = stored["model"].to_list() if stored is not None else []
    models = [args.model] if args.model else available
    missing = [m for m in models if m not in available]
    if not models or missing:
        what = f"model {missing[0]!r}" if missing else "any model"
        print(f"updatelens report: no results for {what} under {store.root}; stored: "
              f"{', '.join(available) or 'none'} (run `updatelens run --model ...` first)", file=sys.stderr)
        return 2
    reads: Reads = {}  # rows read once and shared by the reports of this command: they show the same rows
    built = [(build_model_report(store.root, model, config_id, reads), MODEL_FIGURES) for model in models]
    built.append((build_comparison(store.root, reads), COMPARISON_FIGURES))
    problems = [f"{report.index}: {problem}" for report, captions in built for problem in report_problems(report, captions)]
    if problems:
        print(f"updatelens report: incomplete: {'; '.join(problems)}", file=sys.stderr)
        return 1
    _print_reports(store, models)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """A convention sweep for one model; then its report (with the sensitivity table)."""
    import dagster as dg

    from updatelens.errors import UpdateLensError
    from updatelens.orchestration.runner import (
        check_inputs,
        failure_message,
        materialize_model,
        materialize_sweep,
        project_dagster_home,
        stale_layers,
    )
    from updatelens.sweep import DEFAULT_GRID, SWEEP_LAYERS, parse_grid, spread_layers, sweep_baseline, sweep_runs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sweep_config: dict[str, object] = {"grid": args.grid or json.dumps(DEFAULT_GRID)}
    if args.layers:
        sweep_config["layers"] = _parse_layers(args.layers)
    if args.n_layers:
        sweep_config["n_layers"] = args.n_layers
    if args.with_controls:
        sweep_config["with_controls"] = True
    try:
        lens = _lens_from(args)
        runs = sweep_runs(sweep_baseline(lens.config(), args.with_controls), parse_grid(str(sweep_config["grid"])))
        report = check_inputs(args.model, lens, _parse_layers(args.layers))
        layers = _parse_layers(args.layers) or spread_layers(report.n_layers, args.n_layers or SWEEP_LAYERS)
        # the sweep analyses the stored sample: capture the swept layers that have no current activations
        uncaptured = sorted(layer for layer, stages in stale_layers(lens, args.model, layers).items()
                            if "activations" in stages)
    except (UpdateLensError, ValueError, OSError) as exc:
        print(f"updatelens sweep: {exc}", file=sys.stderr)
        return 2
    os.environ["DAGSTER_HOME"] = str(project_dagster_home(lens.data_root))
    print(f"updatelens sweep: {args.model}, {len(runs)} configurations: "
          + ", ".join(f"{r.convention}={r.setting} ({r.config.config_id})" for r in runs), flush=True)
    start = time.perf_counter()
    with dg.DagsterInstance.get() as instance:
        if uncaptured:
            span = list(range(uncaptured[0], uncaptured[-1] + 1))
            print(f"updatelens sweep: capturing the activations of layers {span[0]}-{span[-1]} first "
                  f"(the sweep analyses the stored sample)", flush=True)
            captured = materialize_model(args.model, lens, instance, layers=span, stages=["activations"],
                                         log_level="WARNING", raise_on_error=False, report=report)
            if not captured.success:
                print(f"updatelens sweep: the capture failed: {failure_message(captured)}", file=sys.stderr)
                return 1
        result = materialize_sweep(args.model, lens, instance, sweep_config, raise_on_error=False)
        if not result.success:
            print(f"updatelens sweep: the sweep failed: {failure_message(result)}", file=sys.stderr)
            return 1
        print(f"\nsweep wall time {time.perf_counter() - start:.1f} s. Sensitivity (SQL view sensitivity):")
        print_frame(lens.store.query("SELECT finding, convention, setting, fn_class, round(value, 3) AS value, "
                                     "verdict, round(delta, 3) AS delta, round(delta_ci_lo, 3) AS delta_lo, "
                                     "round(delta_ci_hi, 3) AS delta_hi, flips FROM sensitivity "
                                     "WHERE model = $1 ORDER BY finding, convention, setting", [args.model]))
        has_main = lens.store.has_model("geometry", args.model)
        return _reports([args.model], lens, instance) if has_main else 0


def cmd_converge(args: argparse.Namespace) -> int:
    """Nested samples of one model (the first n windows, for growing n), each analysed in full;
    the `convergence` view shows every finding at every size with its interval."""

    from updatelens.errors import UpdateLensError
    from updatelens.orchestration.convergence import convergence_table, plan_convergence, run_convergence

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        lens = _lens_from(args)
        tokens = [int(t) for t in args.tokens.split(",")]
        plan = plan_convergence(args.model, lens, tokens, _parse_layers(args.layers))
    except (UpdateLensError, ValueError, OSError) as exc:
        print(f"updatelens converge: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    failure = run_convergence(plan, args.force, log=lambda line: print(line, flush=True))
    if failure is not None:
        print(f"updatelens converge: the run failed: {failure}", file=sys.stderr)
        return 1
    print(f"\nconverge wall time {time.perf_counter() - start:.1f} s, peak RSS {_peak_rss_gib():.2f} GiB. "
          f"Convergence (SQL view convergence):")
    print_frame(convergence_table(lens, args.model))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """The estimator's power: the real update and the positive controls fitted and scored at each
    sample size and k; the `calibration` view holds every figure with its interval."""
    from updatelens.errors import UpdateLensError
    from updatelens.orchestration.calibration import calibration_table, run_calibration

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    try:
        lens = _lens_from(args)
        tokens = [int(t) for t in args.tokens.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
        run_calibration(args.model, lens, tokens, ks, _parse_layers(args.layers), args.anchors,
                        log=lambda line: print(line, flush=True))
    except (UpdateLensError, ValueError, OSError) as exc:
        print(f"updatelens calibrate: {exc}", file=sys.stderr)
        return 2
    print(f"\ncalibrate wall time {time.perf_counter() - start:.1f} s, peak RSS {_peak_rss_gib():.2f} GiB. "
          f"Calibration (SQL view calibration; target real: the layer, the others tokenwise by construction):")
    print_frame(calibration_table(lens, args.model))
    return 0


def _peak_rss_gib() -> float:
    """High-water mark of this process's memory (the run executes in-process).

    VmHWM belongs to the process image: unlike ru_maxrss, it does not carry over the RSS of the
    parent it was forked from (a subprocess of a large process, like the bench's pipeline runs,
    would otherwise report the parent's size)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _other_weights(lens: UpdateLensResource, model: str, revision: str | None, wanted: list[int]) -> str:
    """Why a run of `wanted` would leave the model's rows made by two sets of weights under one name
    (stored layers outside `wanted` made with other weights than `revision`), or ''."""
    from updatelens.orchestration.serving import layer_list
    from updatelens.stages import TABLES
    from updatelens.storage.integrity import stored_revisions

    if revision is None:
        return ""
    others = {rev: [layer for layer in layers if layer not in wanted]
              for rev, layers in stored_revisions(lens.store.root, model, TABLES).items() if rev != revision}
    others = {rev: layers for rev, layers in others.items() if layers}
    if not others:
        return ""
    rev, layers = next(iter(others.items()))
    return (f"the root holds {model} rows of layers {layer_list(layers)} made with other weights "
            f"({rev or 'weights unrecorded'}; now {revision}), which this run would not recompute: the weights "
            f"under the name {model!r} changed. Run every stored layer to replace them all, or register these "
            f"weights under another name")
