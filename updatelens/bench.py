"""Benchmarks of the hot stages against physical references measured in the same process.

Every figure is the median of several repetitions after a warm-up. Each record says what was
measured, against which reference, the ratio, the target and whether it is met:
    {name, value, unit, reference, ratio, target, met, note}
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from updatelens.capture import capture
from updatelens.config import AnalysisConfig
from updatelens.fits import FitParams, fit_local_batched
from updatelens.models import LoadedModel
from updatelens.neighbours import exclusion_width, knn, prepare, search_device
from updatelens.perturbation import Variant, original_output, patched_kl


@dataclass
class Record:
    name: str
    value: float
    unit: str
    reference: float | None = None  # the same-run baseline (its unit is described by `target`/`note`)
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""
    device: str = "cpu"  # where the measured stage ran


def timeit(fn: Callable[[], object], reps: int = 3, warmup: int = 1, device: str | torch.device = "cpu") -> float:
    """Median wall time of fn after a warm-up; on a GPU the queued work is waited for."""
    cuda = torch.device(device).type == "cuda"

    def run() -> None:
        fn()
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timeit_pair(a: Callable[[], object], b: Callable[[], object], reps: int = 4,
                device: str | torch.device = "cpu") -> tuple[float, float]:
    """Median wall times of a and b measured alternately (a b b a a b ...) after a warm-up of each,
    so that drift of a shared machine moves both alike."""
    for fn in (a, b):
        timeit(fn, reps=1, warmup=0, device=device)  # warm-up, discarded
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(reps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            times[j].append(timeit((a, b)[j], reps=1, warmup=0, device=device))
    return statistics.median(times[0]), statistics.median(times[1])


def matmul_flops(n: int, dtype: torch.dtype, reps: int = 3, device: str = "cpu") -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / timeit(lambda: a @ b, reps, device=device)


# ---- 1. capture --------------------------------------------------------------------------------
def bench_capture(lm: LoadedModel, ids: np.ndarray) -> Record:
    t_ids = torch.as_tensor(ids, device=lm.device)

    def bare() -> None:
        with torch.inference_mode():
            lm.model(input_ids=t_ids, use_cache=False)

    t_bare, t_hooked = timeit_pair(bare, lambda: capture(lm, ids, np.ones_like(ids), batch_size=len(ids)),
                                   reps=6, device=lm.device)
    tokens = ids.size
    ratio = t_bare / t_hooked
    return Record("capture_tokens_per_s", tokens / t_hooked, "tokens/s", tokens / t_bare, ratio,
                  ">= 0.9 x bare forward", ratio >= 0.9,
                  f"batch {ids.shape}, all L+1 hooks, tensors moved to CPU; medians of 6 of each, alternated",
                  str(lm.device))


# ---- 2. local fits ------------------------------------------------------------------------------
def fit_flops(fn_class: str, k: int, d: int) -> float:
    """FLOPs of one anchor's fit as implemented (dense products and eigen/QR/SVD at textbook cost).

    Convention for the decompositions: a symmetric k x k eigendecomposition with eigenvectors counts
    9 k^3 (Householder tridiagonalisation 4/3 k^3 plus the implicit QR iteration with vector updates,
    the usual operation count of Golub & Van Loan for the full symmetric eigenproblem), an m x m SVD
    with both singular-vector sets 22 m^3 (Golub-Reinsch), a thin QR of a d x m matrix 2 d m^2. These
    are counts of the textbook algorithms, not of what LAPACK's divide-and-conquer drivers execute."""
    if fn_class == "lowrank":  # K = X X^T, P = D D^T; two k x k eigh (~9 k^3); W^T P W; O(kd) vectors
        return 2 * k * k * d * 2 + 2 * 9 * k**3 + 2 * 2 * k**3 + 4 * k * d
    if fn_class == "orthogonal":  # QR d x 2k, X B and Y B, M, SVD m x m (~22 m^3), projections
        m = min(d, 2 * k)
        return 2 * d * m * m + 2 * 2 * k * d * m + 2 * k * m * m + 22 * m**3 + 4 * d * m
    return 6 * k * d  # diagonal classes: a few passes over X and Y


def reference_lowrank_loop(X: np.ndarray, Y: np.ndarray, xa: np.ndarray, rank: int, ridge: float) -> np.ndarray:
    """The plain per-anchor way: numpy lstsq of D on X, SVD of the fit, project (one anchor)."""
    D = Y - X
    lam = ridge * np.mean(np.sum(X * X, axis=1))
    A = np.vstack([X, np.sqrt(lam) * np.eye(X.shape[1])])
    B = np.linalg.lstsq(A, np.vstack([D, np.zeros((X.shape[1], D.shape[1]))]), rcond=None)[0]
    _, _, vt = np.linalg.svd(X @ B, full_matrices=False)
    V = vt[:rank].T
    return xa + xa @ B @ V @ V.T


def bench_fits(x: np.ndarray, y: np.ndarray, groups: np.ndarray, cfg: AnalysisConfig,
               f64: float, f32: float, device: str = "cpu") -> list[Record]:
    """Batched fits on `device` against same-run matmuls (f64, f32) measured on the same device."""
    records = []
    nb = knn(x, groups, cfg.k, cfg.metric, cfg.exclusion)
    params = FitParams(rank=cfg.rank, ridge=cfg.ridge)
    n, d = x.shape
    for fn_class in ("diagonal", "psd_diagonal", "lowrank", "orthogonal"):
        for dtype, peak in ((torch.float64, f64), (torch.float32, f32)):
            if dtype == torch.float32 and fn_class not in ("lowrank", "orthogonal"):
                continue
            # the first anchors only for the slowest class (per-anchor cost does not depend on how many)
            n_fit = min(n, 512) if fn_class == "orthogonal" else n
            t = timeit(lambda: fit_local_batched(fn_class, x, y, nb[:n_fit], params, dtype, cfg.anchor_chunk, device),
                       reps=2, device=device)
            tag = "f64" if dtype == torch.float64 else "f32"
            records.append(Record(f"fit_{fn_class}_{tag}_anchors_per_s", n_fit / t, "anchors/s",
                                  note=f"{n_fit} anchors of N={n}, k={cfg.k}, d={d}, chunk {cfg.anchor_chunk}",
                                  device=device))
            if fn_class in ("lowrank", "orthogonal"):
                flops = n_fit * fit_flops(fn_class, cfg.k, d) / t
                ratio = flops / peak
                records.append(Record(f"fit_{fn_class}_{tag}_flops", flops / 1e9, "GFLOP/s", peak / 1e9, ratio,
                                      f">= 0.3 x {tag} matmul", ratio >= 0.3, "FLOPs counted by fit_flops()", device))
    # speedup over a plain per-anchor loop, on a small N
    n_small = 64
    t_loop = timeit(lambda: [reference_lowrank_loop(x[nb[i]], y[nb[i]], x[i], cfg.rank, cfg.ridge)
                             for i in range(n_small)], reps=1, warmup=0) / n_small
    t_batched = timeit(lambda: fit_local_batched("lowrank", x, y, nb[:n_small], params, device=device),
                       reps=3, device=device) / n_small
    speedup = t_loop / t_batched
    records.append(Record("fit_lowrank_speedup_vs_loop", speedup, "x", t_loop, speedup, ">= 50 x",
                          speedup >= 50, f"per-anchor numpy lstsq+SVD loop (CPU) on {n_small} anchors", device))
    return records


# ---- 3. neighbours ------------------------------------------------------------------------------
def bench_knn(vectors: np.ndarray, k: int, ann_n: int, seed: int = 0, device: str = "cpu") -> list[Record]:
    """Exact search (on the GPU where faiss-gpu sees one) vs a same-size matmul on the same device;
    the clustered approximate search (its products on `device`) vs exact search on the CPU."""
    records = []
    rng = np.random.default_rng(seed)
    n_exact = min(20000, len(vectors))
    x = vectors[:n_exact]
    groups = np.arange(n_exact) // 127
    knn_device = search_device(device, k + exclusion_width(groups, "sequence"))
    t_knn = timeit(lambda: knn(x, groups, k, device=knn_device), reps=2)
    v, _ = prepare(x, "cosine_centered")
    tv = torch.as_tensor(v, device=knn_device)
    t_mm = timeit(lambda: tv @ tv.T, reps=2, device=knn_device)
    ratio = t_knn / t_mm
    records.append(Record("knn_exact_seconds", t_knn, "s", t_mm, ratio, "<= 1.2 x same-size matmul", ratio <= 1.2,
                          f"N={n_exact}, d={x.shape[1]}, k={k}, sequence exclusion", knn_device))
    # approximate index at ann_n: real vectors plus small noise to reach the size
    reps = int(np.ceil(ann_n / len(vectors)))
    big = np.concatenate([vectors + 0.05 * rng.standard_normal(vectors.shape).astype(np.float32) * vectors.std()
                          for _ in range(reps)])[:ann_n]
    big_groups = np.arange(ann_n) // 127
    queries = rng.choice(ann_n, size=min(1000, ann_n), replace=False)
    import faiss

    vb, metric = prepare(big, "cosine_centered")
    start = time.perf_counter()
    flat = faiss.IndexFlat(vb.shape[1], metric)
    flat.add(vb)
    t_add = time.perf_counter() - start
    flat.search(vb[queries[:100]], k + 1)  # warm-up
    start = time.perf_counter()
    _, exact = flat.search(vb[queries], k + 1)
    # only the search scales with the number of queries; the index is filled once
    t_exact_all = t_add + (time.perf_counter() - start) * ann_n / len(queries)
    start = time.perf_counter()
    approx_all = knn(big, big_groups, k, index="clustered", exclusion="self", device=device)
    t_ann = time.perf_counter() - start
    exact_sets = [set(row[row != q][:k]) for row, q in zip(exact, queries)]
    recall = float(np.mean([len(s & set(approx_all[q])) / k for s, q in zip(exact_sets, queries)]))
    speedup = t_exact_all / t_ann
    records.append(Record("knn_ann_recall_at_k", recall, "", None, None, ">= 0.95", recall >= 0.95,
                          f"clustered index, N={ann_n}, 1000 sampled queries against exact search", device))
    records.append(Record("knn_ann_speedup", speedup, "x", t_exact_all, speedup, ">= 5 x exact", speedup >= 5,
                          f"clustered index, N={ann_n}; exact (CPU) extrapolated from 1000 queries; "
                          f"clustering + search of all {ann_n} {t_ann:.1f} s", device))
    return records


# ---- scaling ------------------------------------------------------------------------------------
@dataclass
class ScalingRow:
    stage: str
    n: int
    d: int
    seconds: float
    device: str = "cpu"


def synthetic_layer(n: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens with a decaying spectrum (like hidden states) and an update with a low-rank part:
    the cost of every stage depends on (N, d, k), not on what the vectors mean."""
    rng = np.random.default_rng(seed)
    scales = 1.0 / np.sqrt(1.0 + np.arange(d))
    x = rng.standard_normal((n, d)) * scales
    y = x + 0.3 * (x @ rng.standard_normal((d, 8))) @ rng.standard_normal((8, d)) / d + 0.05 * rng.standard_normal((n, d))
    return x.astype(np.float32), y.astype(np.float32), (np.arange(n) // 127).astype(np.int64)


def bench_scaling(ns: tuple[int, ...], ds: tuple[int, ...], d_at: int, n_at: int, cfg: AnalysisConfig
                  ) -> tuple[list[ScalingRow], list[Record]]:
    """How neighbours, local fits (lowrank, float64) and geometry grow with N (at d = d_at) and
    with d (at N = n_at), after a warm-up at the smallest size; each N point is the best of two runs
    (interference only slows a run down) and the exponent in N the least-squares slope of log time on
    log N; the d points are one run each."""
    from updatelens.geometry import (
        decompose,
        projection_metrics,
        spectrum_from_gram,
        subspace_from_gram,
        token_metrics,
    )

    params = FitParams(rank=cfg.rank, ridge=cfg.ridge)

    def stages(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict[str, float]:
        out = {}
        start = time.perf_counter()
        nb = knn(x, groups, cfg.k, cfg.metric, cfg.exclusion, device=cfg.device)
        out["neighbours (exact)"] = time.perf_counter() - start
        start = time.perf_counter()
        tx = fit_local_batched("lowrank", x, y, nb, params, torch.float64, cfg.anchor_chunk, cfg.device).tx.cpu().numpy()
        out["fit lowrank f64"] = time.perf_counter() - start
        start = time.perf_counter()
        dec = decompose(x, y, tx)
        token_metrics(x, y, tx, dec)
        # as the pipeline's geometry stage (LayerGeometry): subspace and spectra from d x d Grams
        grams = [v.T @ v for v in (dec.delta_full, dec.delta_tok, dec.residual)]
        projection_metrics(dec, subspace_from_gram(grams[1], len(x), cfg.energy_threshold), cfg.subspace_ms)
        for gram in grams:
            spectrum_from_gram(gram, len(x), cfg.energy_threshold)
        out["geometry"] = time.perf_counter() - start
        return out

    def best_of_two(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict[str, float]:
        runs = [stages(x, y, groups) for _ in range(2)]
        return {stage: min(run[stage] for run in runs) for stage in runs[0]}

    warm_up = synthetic_layer(min(ns), d_at)
    stages(*warm_up)
    # every synthetic layer has the same sequence length, so the same search width
    knn_where = search_device(cfg.device, cfg.k + exclusion_width(warm_up[2], cfg.exclusion))
    where = {"neighbours (exact)": knn_where, "fit lowrank f64": cfg.device, "geometry": "cpu"}
    rows = []
    for n in ns:
        rows += [ScalingRow(stage, n, d_at, t, where[stage])
                 for stage, t in best_of_two(*synthetic_layer(n, d_at)).items()]
    for d in ds:
        if d != d_at or n_at not in ns:
            rows += [ScalingRow(stage, n_at, d, t, where[stage])
                     for stage, t in stages(*synthetic_layer(n_at, d)).items()]
    fit_times = {r.n: r.seconds for r in rows if r.stage == "fit lowrank f64" and r.d == d_at}
    sizes = sorted(fit_times)
    exponent = float(np.polyfit(np.log(sizes), np.log([fit_times[n] for n in sizes]), 1)[0])
    record = Record("fit_lowrank_scaling_exponent_in_n", exponent, "", None, None, "<= 1.1 (linear in N)",
                    exponent <= 1.1, f"time ~ N^exponent fitted over N={', '.join(map(str, sizes))} "
                                     f"({fit_times[sizes[0]]:.1f} s to {fit_times[sizes[-1]]:.1f} s), d={d_at}, k={cfg.k}")
    return rows, [record]


def scaling_table(rows: list[ScalingRow]) -> str:
    lines = [f"{'stage':22} {'N':>7} {'d':>5} {'seconds':>9} {'us/token':>9}"]
    for r in sorted(rows, key=lambda r: (r.stage, r.d, r.n)):
        lines.append(f"{r.stage:22} {r.n:7d} {r.d:5d} {r.seconds:9.2f} {1e6 * r.seconds / r.n:9.1f}")
    return "\n".join(lines)


# ---- 4. output perturbation ---------------------------------------------------------------------
def bench_perturbation(lm: LoadedModel, ids: np.ndarray, states: np.ndarray, batch: int) -> Record:
    """All L layers patched once each (resume at block l, fast KL) against L bare forwards of the
    same sequences in the same batches (logits only: the stricter reference). The reference is the
    median of bare forwards spread through the patched passes (one before every sixth of the layers
    and one after), so drift of a shared machine moves both; everything follows a warm-up."""

    def forwards() -> None:
        with torch.inference_mode():
            for start in range(0, len(ids), batch):
                lm.model(input_ids=torch.as_tensor(ids[start : start + batch], device=lm.device), use_cache=False)

    def patched(layer: int) -> None:
        patched_kl(lm, ids, layer, [Variant("patch", "-", states[layer + 1])], orig, batch)

    start = time.perf_counter()
    orig = original_output(lm, ids, batch)
    t_orig = time.perf_counter() - start
    forwards()  # warm-up
    patched(lm.n_layers // 2)  # warm-up
    every = max(1, lm.n_layers // 6)
    bare, t_all = [], 0.0
    for layer in range(lm.n_layers):
        if layer % every == 0:
            bare.append(timeit(forwards, reps=1, warmup=0, device=lm.device))
        t_all += timeit(lambda: patched(layer), reps=1, warmup=0, device=lm.device)
    bare.append(timeit(forwards, reps=1, warmup=0, device=lm.device))
    t_full = statistics.median(bare)
    # the unpatched pass the KL needs is counted: the pipeline makes it once per block of sequences
    # for all the layers of a run, so a run over all L layers pays it once, as here
    ratio = (t_all + t_orig) / (lm.n_layers * t_full)
    head = "fast linear head" if orig.head is not None else "plain KL over full log-probs"
    return Record("perturbation_all_layers_seconds", t_all + t_orig, "s", lm.n_layers * t_full, ratio,
                  "<= 0.6 x L full forwards", ratio <= 0.6,
                  f"one patched variant per layer, {ids.shape}, batch {batch}, {head}, plus the unpatched "
                  f"pass ({t_orig:.1f} s, once for all layers); bare forward {t_full:.2f} s (median of "
                  f"{len(bare)} spread through the patched passes: {min(bare):.2f}-{max(bare):.2f})",
                  str(lm.device))


def write_json(records: list[Record], path: Path, scaling: list[ScalingRow] | None = None) -> None:
    """`records` as the list the issue asks for (each with the device it ran on); the scaling
    points go to `scaling.json` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if scaling is not None:
        rows = [asdict(r) for r in scaling]
        tmp = path.with_name("scaling.json.tmp")
        tmp.write_text(json.dumps(rows, indent=2))
        tmp.rename(path.with_name("scaling.json"))
    payload = [asdict(r) for r in records]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.rename(path)


def marginal(record: Record, within: float = 0.05) -> bool:
    """A met target whose figure is within `within` (relative) of its bound: "<= 3 GiB" compares the
    value, "<= 0.6 x ..." the ratio."""
    parts = record.target.split()
    if not record.met or len(parts) < 2 or parts[0] not in ("<=", ">="):
        return False
    try:
        bound = float(parts[1])
    except ValueError:
        return False
    figure = record.ratio if len(parts) > 2 and parts[2] == "x" and record.ratio is not None else record.value
    return bound != 0 and abs(figure - bound) <= within * abs(bound)


def table(records: list[Record]) -> str:
    lines = [f"{'name':38} {'value':>12} {'unit':10} {'reference':>12} {'ratio':>7}  {'target':28} met"]
    for r in records:
        ref = f"{r.reference:12.4g}" if r.reference is not None else " " * 12
        ratio = f"{r.ratio:7.3f}" if r.ratio is not None else " " * 7
        met = "" if r.met is None else ("marginal" if marginal(r) else "yes" if r.met else "NO")
        lines.append(f"{r.name:38} {r.value:12.4g} {r.unit:10} {ref} {ratio}  {r.target:28} {met}")
    return "\n".join(lines)


# ---- scale: one layer of the whole pipeline against the sample size -------------------------------
@dataclass
class ScalePoint:
    n_tokens: int
    wall_s: float
    peak_rss_gib: float


REFERENCE_TOKENS = 8192  # the scale targets compare against this sample size when it was measured


def scale_records(points: list[ScalePoint], device: str = "cpu") -> list[Record]:
    """Peak memory and time of a one-layer pipeline run against N: memory bounded (<= 4 GiB at the
    largest N, <= 1.25 x the reference: N = 8192, else the smallest) and time linear (exponent of a
    least-squares fit in log-log from the reference up)."""
    points = sorted(points, key=lambda p: p.n_tokens)
    small = next((p for p in points if p.n_tokens == REFERENCE_TOKENS), points[0])
    points = [p for p in points if p.n_tokens >= small.n_tokens]
    large = points[-1]
    records = [Record("scale_peak_rss_gib", large.peak_rss_gib, "GiB", small.peak_rss_gib,
                      large.peak_rss_gib / small.peak_rss_gib, "<= 1.25 x N=8192, <= 4 GiB",
                      large.peak_rss_gib <= 4 and large.peak_rss_gib / small.peak_rss_gib <= 1.25,
                      f"one-layer run at N = {large.n_tokens} vs N = {small.n_tokens} (reference)", device)]
    if len(points) > 1:
        n = np.log([p.n_tokens for p in points])
        t = np.log([p.wall_s for p in points])
        slope = float(np.polyfit(n, t, 1)[0])
        records.append(Record("scale_time_exponent_in_n", slope, "", None, None, "<= 1.15 (linear in N)",
                              slope <= 1.15, "least-squares slope of log wall time on log N over "
                              + ", ".join(f"{p.n_tokens}: {p.wall_s:.0f} s" for p in points), device))
    return records


def write_scale_json(points: list[ScalePoint], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(p) for p in points], indent=2))
    tmp.rename(path)
