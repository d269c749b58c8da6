"""The benchmark harness on tiny inputs: records are complete and consistent (no timing asserted)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import linregress

from bench import measures as bench
from updatelens.capture import capture
from updatelens.config import AnalysisConfig


def test_bench_records_on_a_tiny_model(tiny_models: dict, tmp_path: Path) -> None:
    lm = tiny_models["tiny-llama"]
    ids = np.random.default_rng(0).integers(5, 500, size=(4, 16))
    cap = capture(lm, ids, np.ones_like(ids))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((600, 16))
    y = x + np.tanh(x)
    groups = np.repeat(np.arange(60), 10)
    cfg = AnalysisConfig(k=16, rank=2)
    f64, f32 = bench.matmul_flops(256, torch.float64), bench.matmul_flops(256, torch.float32)
    records = [bench.bench_capture(lm, ids), *bench.bench_fits(x, y, groups, cfg, f64, f32),
               *bench.bench_knn(cap.states[1:].reshape(-1, lm.d_model).astype(np.float32), 8),
               bench.bench_perturbation(lm, ids, cap.states, 4)]
    names = {r.name for r in records}
    assert {"capture_tokens_per_s", "fit_lowrank_f64_flops", "fit_orthogonal_f32_flops", "fit_lowrank_speedup_vs_loop",
            "knn_exact_seconds", "perturbation_all_layers_seconds"} <= names
    for r in records:
        assert r.value > 0 and np.isfinite(r.value)
        if r.target:
            assert r.met in (True, False)
    capture_record = records[0]
    assert abs(capture_record.ratio - capture_record.value / capture_record.reference) < 1e-9
    perturbation = records[-1]
    n_bare = len(range(0, lm.n_layers, max(1, lm.n_layers // 6))) + 1  # spread through the patched passes
    assert f"median of {n_bare} spread" in perturbation.note
    assert abs(perturbation.ratio - perturbation.value / perturbation.reference) < 1e-9
    path = tmp_path / "bench" / "bench.json"
    bench.write_json(records, path)
    rows = json.loads(path.read_text())
    assert len(rows) == len(records)
    assert set(rows[0]) >= {"name", "value", "unit", "reference", "ratio", "target", "met", "device"}


def test_ann_bench_tunes_on_one_layer_and_judges_every_method_on_the_other(tmp_path: Path) -> None:
    """Settings are the smallest reaching recall 0.95 on the tuning states (clustered: at the threshold
    size and in full, the larger); the judging states time each method at its setting; records and
    points are complete."""
    rng = np.random.default_rng(0)
    scales = 1.0 / np.sqrt(1.0 + np.arange(24))
    tune, judge = (rng.standard_normal((3000, 24)).astype(np.float32) * scales for _ in range(2))
    groups = np.arange(3000) // 15
    points, records = bench.bench_ann(tune, judge, groups, 10, (3, 7), n_queries=300, ann_threshold=1500,
                                      threshold_sizes=(1000, 1500))
    tuned = [p for p in points if p.role == "tune"]
    for method, n in (("clustered", 1500), ("clustered", 3000), ("ivf", 3000), ("hnsw", 3000)):
        ladder = [p for p in tuned if p.method == method and p.n == n]
        assert ladder and all(p.layer == 3 for p in ladder)
        assert all(p.recall < bench.ANN_RECALL for p in ladder[:-1])  # stopped at the first that reaches it
    assert {p.n for p in tuned if p.method == "clustered"} == {1500, 3000}
    judged = {p.method: p for p in points if p.role == "judge"}
    assert set(judged) == {"exact", "clustered", "ivf", "ivf_batch", "hnsw"} and all(p.layer == 7 for p in judged.values())
    assert judged["ivf_batch"].param == judged["ivf"].param and judged["ivf_batch"].recall == judged["ivf"].recall
    assert judged["clustered"].param == max(p.param for p in tuned if p.method == "clustered")
    names = {r.name for r in records}
    assert {"knn_ann_recall_at_k", "knn_ann_speedup", "knn_ann_threshold_speedup"} <= names
    bench.write_points_json(points, tmp_path / "ann.json")
    assert len(json.loads((tmp_path / "ann.json").read_text())) == len(points)


def test_lowrank_loop_reference_agrees_with_the_batched_fit() -> None:
    rng = np.random.default_rng(2)
    X, Y = rng.standard_normal((30, 12)), rng.standard_normal((30, 12))
    xa = rng.standard_normal(12)
    from updatelens.fits import FitParams
    from updatelens.fits.lowrank import fit_lowrank

    fast = fit_lowrank(torch.tensor(X[None]), torch.tensor((Y - X)[None]), torch.tensor(xa[None]),
                       FitParams(rank=3, ridge=1e-2)).tx.numpy()[0]
    np.testing.assert_allclose(bench.reference_lowrank_loop(X, Y, xa, 3, 1e-2), fast, rtol=1e-6, atol=1e-8)


def test_scaling_sweep_rows_and_linearity_record(tmp_path: Path) -> None:
    cfg = AnalysisConfig(k=8, rank=2, subspace_ms=(1, 4))
    rows, records = bench.bench_scaling((256, 512, 1024), (16, 32), d_at=32, n_at=512, cfg=cfg)
    stages = {"neighbours (exact)", "fit lowrank f64", "geometry"}
    assert {(r.stage, r.n, r.d) for r in rows} == {(s, n, d) for s in stages for n, d in
                                                   ((256, 32), (512, 32), (1024, 32), (512, 16))}
    assert all(r.seconds > 0 for r in rows)
    (record,) = records
    fit = {r.n: r.seconds for r in rows if r.stage == "fit lowrank f64" and r.d == 32}
    slope = linregress(np.log([256, 512, 1024]), np.log([fit[256], fit[512], fit[1024]])).slope
    assert abs(record.value - slope) < 1e-9
    assert record.met == (record.value <= 1.1)
    bench.write_json(records, tmp_path / "bench.json", scaling=rows)
    assert len(json.loads((tmp_path / "scaling.json").read_text())) == len(rows)
    assert "us/token" in bench.scaling_table(rows)


def test_peak_memory_of_a_subprocess_excludes_its_parent() -> None:
    """ru_maxrss survives fork + exec (a child of the bench would report the bench's own size);
    the figure the CLI prints must be the child's own high-water mark."""
    import subprocess
    import sys

    parent = np.ones(400 * 2**20 // 8)  # 400 MiB resident in this process
    code = "from updatelens.orchestration.commands import _peak_rss_gib; print(_peak_rss_gib())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert parent.sum() > 0 and child < 0.3


def test_timeit_pair_alternates_and_returns_each_functions_median() -> None:
    calls: list[str] = []
    t_a, t_b = bench.timeit_pair(lambda: calls.append("a"), lambda: (calls.append("b"), time.sleep(0.02)), reps=4)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-ups, then a b / b a / ...
    assert t_b > 0.015 > t_a


def test_scale_records_bound_memory_and_fit_the_time_exponent(tmp_path: Path) -> None:
    points = [bench.ScalePoint(8192, 100.0, 2.0), bench.ScalePoint(32768, 400.0, 2.2),
              bench.ScalePoint(131072, 1600.0, 2.4)]
    records = {r.name: r for r in bench.scale_records(points)}
    assert records["scale_peak_rss_gib"].ratio == pytest.approx(1.2) and records["scale_peak_rss_gib"].met
    assert records["scale_time_exponent_in_n"].value == pytest.approx(1.0) and records["scale_time_exponent_in_n"].met
    grown = {r.name: r for r in bench.scale_records([*points[:2], bench.ScalePoint(131072, 3200.0, 3.5)])}
    assert not grown["scale_peak_rss_gib"].met and not grown["scale_time_exponent_in_n"].met
    bench.write_points_json(points, tmp_path / "scale.json")
    assert json.loads((tmp_path / "scale.json").read_text())[2] == {"n_tokens": 131072, "wall_s": 1600.0,
                                                                   "peak_rss_gib": 2.4}


def test_study_records_judge_time_and_memory_and_show_the_perturbation_share() -> None:
    steps = [bench.StepTime("m:00", "activations", 100.0), bench.StepTime("m:00", "functional_metrics", 2000.0),
             bench.StepTime("m:15", "functional_metrics", 900.0)]
    records = {r.name: r for r in bench.study_records(3500.0, 3.7, steps, 131072, [0, 15])}
    assert not records["study_wall_s"].met and records["study_peak_rss_gib"].met
    assert records["study_functional_s"].value == 2900.0
    assert records["study_functional_s"].ratio == pytest.approx(2900 / 3500)
    fast = {r.name: r for r in bench.study_records(2000.0, 4.5, steps[:1], 131072, [0])}
    assert fast["study_wall_s"].met and not fast["study_peak_rss_gib"].met


def test_forward_work_counts_one_capture_one_unpatched_pass_and_each_layers_patched_passes() -> None:
    # blocks of 1, 2, 3, 4 FLOPs per token, a head of 10; layers 0 and 2, 4 patched passes, 2 tokens
    work = bench.forward_work([1.0, 2.0, 3.0, 4.0], 10.0, [0, 2], 4, 2)
    assert work.capture == 2 * (1 + 2 + 3)  # up to the deepest layer's output
    assert work.unpatched == 2 * (2 + 3 + 4 + 10)  # resumed after the first layer
    assert work.patched == 2 * 4 * ((2 + 3 + 4 + 10) + (4 + 10))
    assert work.total == work.capture + work.unpatched + work.patched


def test_dense_flops_count_weight_matrices_not_biases_or_norms() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    assert bench.dense_flops(module) == 2 * (3 * 4 + 4 * 2)


def test_floor_records_and_the_study_judged_against_its_floor() -> None:
    work = bench.ForwardWork(1000, 1e12, 1e12, 8e12)
    gemm, floor = bench.gemm_record(1e10), bench.floor_record("study", work, 1e10, bench.STUDY_TARGET_S)
    assert gemm.value == pytest.approx(10.0) and floor.value == pytest.approx(1000.0)
    assert floor.name == "study_forward_floor_s" and floor.met is None
    assert floor.ratio == pytest.approx(1000.0 / bench.STUDY_TARGET_S)
    steps = [bench.StepTime("m:00", "activations", 300.0), bench.StepTime("m:00", "local_fits", 500.0),
             bench.StepTime("m:00", "geometry", 250.0), bench.StepTime("m:00", "functional_metrics", 3000.0)]
    records = {r.name: r for r in bench.study_records(4100.0, 3.7, steps, 1000, [0], forward_floor_s=floor.value)}
    bound = records["study_forward_at_gemm_rate_s"]
    assert bound.value == pytest.approx(1000.0 + 500.0 + 250.0) and bound.met  # 1750 s <= 2700 s
    slow = [*steps, bench.StepTime("m:00", "residuals", 1000.0)]
    assert not {r.name: r for r in bench.study_records(5100.0, 3.7, slow, 1000, [0], forward_floor_s=2000.0)}[
        "study_forward_at_gemm_rate_s"].met  # 2000 + 1750 s > 2700 s
    assert "study_forward_at_gemm_rate_s" not in {r.name for r in bench.study_records(4100.0, 3.7, steps, 1000, [0])}


def test_a_met_target_near_its_bound_is_marginal() -> None:
    near = bench.Record("x", 0.59, "", 1.0, 0.59, "<= 0.6 x L full forwards", True)
    clear = bench.Record("x", 0.40, "", 1.0, 0.40, "<= 0.6 x L full forwards", True)
    absolute = bench.Record("rss", 2.9, "GiB", None, None, "<= 3 GiB", True)
    assert bench.marginal(near) and not bench.marginal(clear) and bench.marginal(absolute)
    assert not bench.marginal(bench.Record("x", 0.61, "", 1.0, 0.61, "<= 0.6 x L full forwards", False))
    assert "marginal" in bench.table([near])


def test_the_default_job_record_weighs_the_steps_without_a_forward_pass_against_the_target_margin() -> None:
    from bench.default_job import record

    floor = [[{"name": "default_job_forward_floor_s", "value": 180.0}], [{"name": "default_job_forward_floor_s",
                                                                           "value": 220.0}]]  # before, after
    steps = [{"partitions": "m:00..m:29", "step": step, "seconds": s}
             for step, s in (("activations", 20.0), ("local_fits", 30.0), ("residuals", 5.0), ("geometry", 30.0),
                             ("functional_metrics", 300.0))]
    rows = {r["name"]: r for r in record({"model": "m", "config_id": "c", "layers": [0, 29], "pipeline_s": 390.0,
                                          "peak_rss_gib": 2.0}, floor, steps)}
    assert rows["default_job_wall_s"]["reference"] == 200.0  # the mean of the floors
    assert rows["default_job_wall_s"]["ratio"] == pytest.approx(1.95) and not rows["default_job_wall_s"]["met"]
    no_forward = rows["default_job_no_forward_steps_s"]
    assert no_forward["value"] == 65.0 and no_forward["reference"] == pytest.approx(60.0)  # 0.3 x the floor
    assert not no_forward["met"] and rows["default_job_step_geometry_s"]["value"] == 30.0
    steps[3]["seconds"] = 20.0  # fits, residuals and geometry within the margin: the target is not ruled out
    assert record({"model": "m", "config_id": "c", "layers": [0, 29], "pipeline_s": 390.0, "peak_rss_gib": 2.0},
                  floor, steps)[-1]["met"]


def test_the_code_cost_record_judges_the_job_against_the_earlier_codes_and_lists_every_step() -> None:
    from bench.code_cost import record

    base = {"model": "m", "config_id": "a", "layers": [0, 1], "pipeline_s": 100.0, "peak_rss_gib": 3.5}
    new = {**base, "config_id": "b", "pipeline_s": 124.0, "peak_rss_gib": 2.9}
    steps = [{"step": "activations", "seconds": 10.0}, {"step": "geometry", "seconds": 5.0},
             {"step": "geometry", "seconds": 5.0}]
    rows = {r["name"]: r for r in record(base, new, steps[:1], steps + [{"step": "controls", "seconds": 3.0}],
                                         "abc1234", 1.25)}
    assert rows["default_job_wall_s"]["met"] and rows["default_job_wall_s"]["ratio"] == 1.24
    assert rows["default_job_peak_rss_gib"]["met"] and "abc1234" in rows["default_job_wall_s"]["note"]
    assert rows["step_geometry_s"]["value"] == 10.0 and rows["step_geometry_s"]["reference"] is None
    assert rows["step_activations_s"]["ratio"] == 1.0 and rows["step_controls_s"]["value"] == 3.0
    slower = record(base, {**new, "pipeline_s": 126.0, "peak_rss_gib": 3.1}, [], [], "abc1234", 1.25)
    assert [r["met"] for r in slower] == [False, False]
