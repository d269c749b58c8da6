"""The bench driver behind `python -m bench`: loads the model, runs the engine's benchmarks
(bench.measures) and whole pipeline runs in fresh processes, prints the tables and writes the
records. Targets and measurements live in bench.measures; this module only drives them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from updatelens.orchestration.output import print_frame
from updatelens.registry import DEFAULT_CORPUS, DEFAULT_MODEL

if TYPE_CHECKING:
    from bench.measures import Record


def _pipeline_run(layers: str, root: Path, home: Path, device: str = "cpu",
                  settings: tuple[str, ...] = ()) -> tuple[float, float]:
    """(pipeline wall s, peak RSS GiB) of `updatelens run --layers ...` in a fresh process, from the
    summary it writes (--summary-json)."""
    env = dict(os.environ, DAGSTER_HOME=str(home), HF_HUB_OFFLINE="1")
    extra = [arg for setting in settings for arg in ("--set", setting)]
    summary = Path(home) / "run-summary.json"
    subprocess.run([sys.executable, "-m", "updatelens.orchestration.cli", "run", "--layers", layers, "--force",
                    "--data-root", str(root), "--set", f"device={device}", *extra, "--summary-json", str(summary)],
                   env=env, capture_output=True, text=True, check=True)
    figures = json.loads(summary.read_text())
    return float(figures["pipeline_s"]), float(figures["peak_rss_gib"])


def step_times(home: Path) -> list[dict[str, object]]:
    """Every step of every run recorded in the Dagster home `home`, oldest run first: the run's
    partitions, the step (asset) and its seconds."""
    import dagster as dg

    from updatelens.assets.partitions import tagged_key_span

    rows: list[dict[str, object]] = []
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for run in reversed(instance.get_runs()):
            first, last = tagged_key_span(run.tags) or ("", "")
            for stat in instance.get_run_step_stats(run.run_id):
                if stat.start_time is not None and stat.end_time is not None:
                    rows.append({"partitions": first if first == last else f"{first}..{last}", "step": stat.step_key,
                                 "seconds": round(stat.end_time - stat.start_time, 1)})
    return rows


def forward_floors(model: str, layers: list[int] | None, device: str, registry: Path | None = None,
                   default_job: bool = False) -> list[Record]:
    """The float32 matmul rate of `device` and the forward-pass floor of the study preset for `model`
    (its layers, or the preset's) and, with `default_job`, of the engine's default configuration
    over all layers: the dense FLOPs of their passes, counted from the loaded weights, at that rate."""
    import torch

    from bench import measures as bench
    from updatelens.config import AnalysisConfig, preset_layers, preset_settings
    from updatelens.models import load_model
    from updatelens.perturbation import output_layer
    from updatelens.registry import get_model
    from updatelens.steps.functional_metrics import patched_pass_count

    lm = load_model(get_model(model, registry), device=device)
    head = output_layer(lm)
    if head is None:
        raise ValueError(f"{model} has no output layer to count")
    blocks, head_flops = [bench.dense_flops(block) for block in lm.blocks], bench.dense_flops(head)
    n_layers = lm.n_layers
    del lm

    def work(cfg: AnalysisConfig, chosen: list[int]) -> bench.ForwardWork:
        return bench.forward_work(blocks, head_flops, chosen, patched_pass_count(cfg), cfg.n_seq * cfg.seq_len)

    gemm = bench.matmul_flops(4096, torch.float32, device=device)
    study = work(AnalysisConfig(**preset_settings("study")), layers or preset_layers("study", n_layers))  # type: ignore[arg-type]
    records = [bench.gemm_record(gemm, device), bench.floor_record("study", study, gemm, bench.STUDY_TARGET_S, device)]
    if default_job:
        records.append(bench.floor_record("default_job", work(AnalysisConfig(), list(range(n_layers))), gemm,
                                          bench.DEFAULT_JOB_TARGET_S, device))
    return records


def study_record(home: Path, summary: dict[str, Any], n_tokens: int, device: str, out: Path,
                 registry: Path | None = None) -> str:
    """The study's records (bench_study.json) and step times (study.json) under `out`, from a finished
    `updatelens run --preset study`: its Dagster home and its --summary-json figures, with the
    forward-pass floor measured now (see `forward_floors`; the model from `registry`, default the
    project's). The table."""
    from bench import measures as bench

    steps = step_times(home)
    layers = [int(x) for x in summary["layers"]]
    floor = forward_floors(str(summary["model"]), layers, device, registry)
    records = floor + bench.study_records(
        float(summary["pipeline_s"]), float(summary["peak_rss_gib"]),
        [bench.StepTime(str(s["partitions"]), str(s["step"]), float(s["seconds"]))  # type: ignore[arg-type]
         for s in steps], n_tokens, layers, device,
        forward_floor_s=next(r.value for r in floor if r.name == "study_forward_floor_s"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({**summary, "n_tokens": n_tokens, "device": device,
                                                "steps": steps}, indent=1))
    bench.write_json(records, out / "bench_study.json")
    return bench.table(records)


def _bench_study(args: argparse.Namespace, root: Path) -> int:
    """The study preset as a researcher runs it, in a fresh process with a Dagster home of its own
    (its results under `<root>/study/`): study.json (the figures and every step's time) and the
    records in bench_study.json."""
    import tempfile

    from updatelens.config import PRESETS

    tokens = int(PRESETS["study"]["n_seq"]) * int(PRESETS["study"]["seq_len"])  # type: ignore[call-overload]
    with tempfile.TemporaryDirectory() as home:
        summary = Path(home) / "run-summary.json"
        subprocess.run([sys.executable, "-m", "updatelens.orchestration.cli", "run", "--preset", "study", "--force",
                        "--data-root", str(root / "study"), "--set", f"device={args.device}",
                        "--summary-json", str(summary)],
                       env=dict(os.environ, DAGSTER_HOME=home, HF_HUB_OFFLINE="1"), check=True)
        print(study_record(Path(home), json.loads(summary.read_text()), tokens, args.device, root / "bench"))
    print(f"\nwritten {root / 'bench' / 'study.json'} and bench_study.json")
    return 0


def _bench_floor(args: argparse.Namespace, root: Path) -> int:
    """The forward-pass floors of the study preset and the default job of `--model` on this device,
    without running them (a minute): bench_floor-<model>.json."""
    from bench import measures as bench

    records = forward_floors(args.model, None, args.device, default_job=True)
    print(bench.table(records))
    out = root / "bench" / f"bench_floor-{args.model}.json"
    bench.write_json(records, out)
    print(f"\nwritten {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Every hot stage against a reference measured in the same run; table + bench.json."""
    import tempfile

    import numpy as np
    import torch

    from bench import measures as bench
    from updatelens.capture import capture, kept_mask
    from updatelens.config import AnalysisConfig
    from updatelens.corpus import make_sample
    from updatelens.errors import ConfigError
    from updatelens.models import load_model
    from updatelens.registry import get_corpus, get_model
    from updatelens.storage.location import default_data_root, is_url

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if is_url(args.data_root or default_data_root()):
        print("python -m bench: the bench writes to a local data root; pass --data-root PATH", file=sys.stderr)
        return 2
    root = Path(args.data_root or default_data_root())
    if args.only == "scale":
        return _bench_scale(args, root)
    if args.only == "knn":
        return _bench_knn(args, root)
    if args.only == "study":
        return _bench_study(args, root)
    if args.only == "floor":
        return _bench_floor(args, root)
    cfg = AnalysisConfig(device=args.device)
    try:
        cfg.validate()
    except ConfigError as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2
    if cfg.device != "cpu" and not torch.cuda.is_available():
        print(f"python -m bench: --device {cfg.device}, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = cfg.device
    lm = load_model(get_model(DEFAULT_MODEL), device=device)
    sample = make_sample(get_corpus(DEFAULT_CORPUS), lm.tokenizer, cfg.n_seq, cfg.seq_len, 0, cfg.windows_per_doc)
    records = [bench.bench_capture(lm, sample.input_ids[:8])]
    cap = capture(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch)
    kept = kept_mask(sample.attention_mask, True)
    mid = lm.n_layers // 2
    f64 = bench.matmul_flops(2048, torch.float64, device=device)
    f32 = bench.matmul_flops(4096, torch.float32, device=device)
    records += bench.bench_fits(cap.states[mid][kept], cap.states[mid + 1][kept], np.nonzero(kept)[0], cfg, f64, f32,
                                device)
    records += bench.bench_knn(cap.states[1:].reshape(-1, lm.d_model), cfg.k, device=device)
    records.append(bench.bench_perturbation(lm, sample.input_ids, cap.states, cfg.patch_batch))
    del cap
    ns = tuple(int(n) for n in args.scaling_n.split(","))
    scaling, scaling_records = bench.bench_scaling(ns, (288, 576, 1152), lm.d_model, args.scaling_d_at, cfg)
    records += scaling_records
    # End to end: two runs centred on the middle layer. A layer's cost falls linearly with its depth
    # (its patched passes resume there), so the runs' per-layer cost is the mean over all layers:
    # total = run of 2 + (L - 2) x (run of 6 - run of 2) / 4. RSS: the 6-layer run against the 2-layer one.
    lo = mid - 1
    with tempfile.TemporaryDirectory() as tmp:
        t_a, rss_a = _pipeline_run(f"{lo}-{lo + 1}", Path(tmp) / "a", Path(tmp) / "home", device)
        t_b, rss_b = _pipeline_run(f"{lo - 2}-{lo + 3}", Path(tmp) / "b", Path(tmp) / "home", device)
    per_layer = (t_b - t_a) / 4
    t_all = t_a + per_layer * (lm.n_layers - 2)
    records.append(bench.Record("pipeline_peak_rss_gib", rss_b, "GiB", rss_a, rss_b / rss_a, "<= 3 GiB, flat in layers",
                                rss_b <= 3 and rss_b / rss_a <= 1.1, "6-layer run vs 2-layer run (reference)", device))
    records.append(bench.Record("pipeline_end_to_end_s", t_all, "s", None, None, f"<= {bench.DEFAULT_JOB_TARGET_S} s",
                                t_all <= bench.DEFAULT_JOB_TARGET_S,
                                f"estimated for {lm.n_layers} layers from runs of layers {lo}-{lo + 1} ({t_a:.0f} s) "
                                f"and {lo - 2}-{lo + 3} ({t_b:.0f} s): {per_layer:.1f} s per layer", device))
    print(bench.scaling_table(scaling))
    print()
    print(bench.table(records))
    path = root / "bench" / "bench.json"
    bench.write_json(records, path, scaling=scaling)
    print(f"\nwritten {path}")
    return 0


def _bench_knn(args: argparse.Namespace, root: Path) -> int:
    """Approximate k-NN at research scale on SmolLM2's real states: search settings tuned on one layer,
    every method judged on another (ann.json: every point; bench_knn.json: the records)."""
    from bench import measures as bench
    from updatelens.config import AnalysisConfig
    from updatelens.corpus import make_sample
    from updatelens.models import load_model
    from updatelens.registry import get_corpus, get_model

    tune_layer, judge_layer = (int(v) for v in args.ann_layers.split(","))
    cfg = AnalysisConfig(device=args.device)
    lm = load_model(get_model(DEFAULT_MODEL), device=cfg.device)
    sample = make_sample(get_corpus(DEFAULT_CORPUS), lm.tokenizer, args.ann_tokens // cfg.seq_len, cfg.seq_len)
    start = time.perf_counter()
    (tune_x, judge_x), groups = bench.layer_states(lm, sample.input_ids, sample.attention_mask,
                                                   (tune_layer, judge_layer), cfg.capture_batch)
    print(f"knn: captured layers {tune_layer} and {judge_layer}, {len(groups)} kept tokens, "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    del lm
    points, records = bench.bench_ann(tune_x, judge_x, groups, cfg.k, (tune_layer, judge_layer), cfg.device)
    print()
    print(bench.ann_table(points))
    print()
    print(bench.table(records))
    bench.write_points_json(points, root / "bench" / "ann.json")
    bench.write_json(records, root / "bench" / "bench_knn.json")
    print(f"\nwritten {root / 'bench' / 'ann.json'} and bench_knn.json")
    return 0


def _bench_scale(args: argparse.Namespace, root: Path) -> int:
    """One layer of the whole pipeline (the study's classes and controls) at each sample size, each in a
    fresh process: peak RSS and wall time against N; scale.json and the records in bench_scale.json.
    Each size's results stay under `<root>/convergence/n_seq=<n>/`: the runs are also a convergence
    study of that layer (SQL view `convergence` over the bench's data root)."""
    import tempfile

    from bench import measures as bench
    from updatelens.config import PRESETS
    from updatelens.storage.layout import convergence_root
    from updatelens.storage.location import local_path

    sizes = sorted({int(t) for t in args.scale_tokens.split(",")})
    study: dict[str, Any] = PRESETS["study"]
    settings = tuple(f"{key}={json.dumps(value)}" for key, value in study.items() if key != "n_seq")
    points = []
    for tokens in sizes:
        n_seq = tokens // int(study["seq_len"])
        with tempfile.TemporaryDirectory() as home:
            wall, rss = _pipeline_run(str(args.scale_layer), local_path(convergence_root(root, n_seq)), Path(home),
                                      args.device, (*settings, f"n_seq={n_seq}"))
        points.append(bench.ScalePoint(tokens, wall, rss))
        print(f"scale: {tokens} tokens, layer {args.scale_layer}: {wall:.1f} s, peak RSS {rss:.2f} GiB", flush=True)
    records = bench.scale_records(points, args.device)
    print()
    print(bench.table(records))
    bench.write_points_json(points, root / "bench" / "scale.json")
    bench.write_json(records, root / "bench" / "bench_scale.json")
    print(f"\nwritten {root / 'bench' / 'scale.json'} and bench_scale.json")
    from updatelens.storage import catalog

    catalog.refresh(root)
    print(f"\nThe runs as a convergence study of layer {args.scale_layer} (SQL view convergence):")
    print_frame(catalog.query(root, "SELECT finding, fn_class, n_tokens, round(value, 3) AS value, round(ci_lo, 3) "
                                     "AS ci_lo, round(ci_hi, 3) AS ci_hi, verdict, threshold FROM convergence "
                                     "ORDER BY finding, fn_class, n_tokens"))
    return 0
