"""Bootstrap over sequences: every per-layer statistic a finding is built from, recomputed on resamples.

A resample draws the sample's n_seq sequences with replacement (whole sequences: tokens of one
sequence are not independent). Replicate b gives sequence s the multiplicity counts[b, s], the
same for every layer, class and stage of the sample (the draw depends only on the seed and n_seq),
so a finding aggregated over layers can be recomputed replicate by replicate and its interval read
from the replicates' spread (percentile interval).

A statistic on a resample equals the statistic on the weighted original rows (a row repeated c
times is weight c), so nothing is copied: medians come from cumulative weights in sorted order,
Spearman from the weighted ranks of the expanded sample (ties shared, as scipy's average ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import numpy as np
import torch

from updatelens.findings import ANGLE_GT, GEOMETRY_STATISTIC_DEFS
from updatelens.threads import per_core_map


def replicate_counts(n_seq: int, n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples, n_seq] multiplicities of each sequence in each resample (each row sums to n_seq)."""
    rng = np.random.default_rng([seed, 0xB007])
    return rng.multinomial(n_seq, np.full(n_seq, 1.0 / n_seq), size=n_resamples).astype(np.float64)


def sequence_counts(units_of_seq: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples, n_seq] multiplicities of each sequence when a resample draws the independent units
    (the documents the windows were cut from) with replacement: a sequence counts as often as its unit
    was drawn. With every sequence its own unit this is `replicate_counts(n_seq, ...)`."""
    _, unit = np.unique(np.asarray(units_of_seq), return_inverse=True)
    return replicate_counts(int(unit.max()) + 1, n_resamples, seed)[:, unit]


def jackknife_counts(units_of_seq: np.ndarray, groups: int, seed: int) -> np.ndarray:
    """[G, n_seq] weights of a delete-a-group jackknife over the independent units (documents): the units
    are shuffled by the seed and dealt into G = min(groups, units) groups of near-equal size, and
    replicate g weighs every sequence 1 but those of group g, 0. With as many groups as units this is
    the leave-one-document-out jackknife. Its interval (`jackknife_half_width` in storage.catalog) is
    point +- t * sqrt((G - 1) / G * sum_g (theta_g - mean)^2)."""
    _, unit = np.unique(np.asarray(units_of_seq), return_inverse=True)
    n_units = int(unit.max()) + 1 if len(unit) else 0
    g = min(groups, n_units)
    if g < 2:
        return np.zeros((0, len(unit)))
    order = np.random.default_rng([seed, 0x7AC4]).permutation(n_units)
    group_of_unit = np.empty(n_units, np.int64)
    group_of_unit[order] = np.arange(n_units) % g
    return (group_of_unit[unit][None, :] != np.arange(g)[:, None]).astype(np.float64)


def row_weights(counts: np.ndarray, seq: np.ndarray, block: int = 32) -> Iterator[tuple[int, np.ndarray]]:
    """(first replicate, weights [b, n_rows]) for blocks of replicates: row i weighs counts[., seq[i]]."""
    for start in range(0, len(counts), block):
        yield start, counts[start : start + block][:, seq]


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Median of each weighted sample [b] (weights [b, n], integer multiplicities): the median of the
    expanded sample, interpolated between the two middle elements when their number is even."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    cum = np.cumsum(weights[:, order], axis=1)
    total = cum[:, -1]
    lo = np.array([np.searchsorted(c, (t - 1) / 2 + 0.5) for c, t in zip(cum, total)])
    hi = np.array([np.searchsorted(c, t / 2 + 0.5) for c, t in zip(cum, total)])
    even = (total % 2) == 0
    return np.where(even, (v[np.minimum(lo, len(v) - 1)] + v[np.minimum(hi, len(v) - 1)]) / 2,
                    v[np.minimum(hi, len(v) - 1)])


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return (weights @ values) / weights.sum(axis=1)


def paired_ratio(kl_patch: np.ndarray, kl_random: np.ndarray) -> np.ndarray:
    """Per token, KL(remove r) / KL(random perturbation of the same norm) at the same position: NaN where
    the random perturbation moved nothing (its KL is 0 after the clamp) or either is not finite."""
    ok = np.isfinite(kl_patch) & np.isfinite(kl_random) & (kl_random > 0)
    return np.divide(kl_patch, kl_random, out=np.full(len(kl_patch), np.nan), where=ok)


def median_ratio(ratio: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The median over tokens of `paired_ratio` on each weighted sample [b] (weights [b, n]), over its
    finite entries (NaN when none): the per-layer statistic `kl_ratio_random`. The point estimate is
    this with every weight 1."""
    ok = np.isfinite(ratio)
    if not ok.any():
        return np.full(len(weights), np.nan)
    return weighted_median(ratio[ok], weights[:, ok])


def _weighted_ranks(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Average ranks (1-based) of each row in each weighted sample, ties shared: [b, n]."""
    uniq, inverse = np.unique(values, return_inverse=True)
    group = np.zeros((len(weights), len(uniq)))
    for i, w in enumerate(weights):
        group[i] = np.bincount(inverse, weights=w, minlength=len(uniq))
    before = np.cumsum(group, axis=1) - group
    return (before + (group + 1) / 2)[:, inverse]


def weighted_spearman(a: np.ndarray, b: np.ndarray, weights: np.ndarray, min_n: int = 3) -> np.ndarray:
    """Spearman's rho of (a, b) on each weighted sample [b], over the rows where both are finite;
    NaN where fewer than min_n rows remain or one side is constant (as `perturbation.spearman`)."""
    ok = np.isfinite(a) & np.isfinite(b)
    a, b, w = a[ok], b[ok], weights[:, ok]
    out = np.full(len(weights), np.nan)
    if len(a) == 0:
        return out
    ra, rb = _weighted_ranks(a, w), _weighted_ranks(b, w)
    total = w.sum(axis=1, keepdims=True)
    ma = (w * ra).sum(axis=1, keepdims=True) / total
    mb = (w * rb).sum(axis=1, keepdims=True) / total
    cov = (w * (ra - ma) * (rb - mb)).sum(axis=1)
    var = np.sqrt((w * (ra - ma) ** 2).sum(axis=1) * (w * (rb - mb) ** 2).sum(axis=1))
    valid = (total[:, 0] >= min_n) & (var > 0)
    out[valid] = cov[valid] / var[valid]
    return out


def effective_rank(eigenvalues: np.ndarray) -> np.ndarray:
    """exp(entropy of the normalised energies) per row of eigenvalues [b, d] (as geometry.spectrum)."""
    energy = np.clip(eigenvalues, 0.0, None)
    total = energy.sum(axis=1, keepdims=True)
    p = np.divide(energy, total, out=np.zeros_like(energy), where=total > 0)
    logs = np.log(p, out=np.zeros_like(p), where=p > 0)
    return np.where(total[:, 0] > 0, np.exp(-(p * logs).sum(axis=1)), 0.0)


def replicate_grams(v: np.ndarray, seq: np.ndarray, counts: np.ndarray, block: int = 16) -> np.ndarray:
    """sum over rows of w_i v_i v_i^T for each replicate [b, d, d], from per-sequence Gram matrices
    accumulated a block of sequences at a time (memory: b + block matrices of d x d)."""
    d = v.shape[1]
    out = np.zeros((len(counts), d, d))
    order = np.argsort(seq, kind="stable")
    v, seq = v[order], seq[order]
    seqs, starts = np.unique(seq, return_index=True)
    bounds = np.append(starts, len(seq))
    for i in range(0, len(seqs), block):
        chunk = range(i, min(i + block, len(seqs)))
        grams = np.stack([v[bounds[j] : bounds[j + 1]].T @ v[bounds[j] : bounds[j + 1]] for j in chunk])
        out += (counts[:, seqs[list(chunk)]] @ grams.reshape(len(grams), d * d)).reshape(-1, d, d)
    return out


def geometry_replicates(seq: np.ndarray, metrics: dict[str, np.ndarray], counts: np.ndarray,
                        statistics: tuple[tuple[str, str, str], ...] = GEOMETRY_STATISTIC_DEFS) -> dict[str, np.ndarray]:
    """Per-layer statistics declared as (statistic, per-token column, aggregate) on every resample:
    {statistic: [n_resamples]}; a statistic whose column `metrics` lacks is NaN. By default the findings'
    geometry statistics (GEOMETRY_STATISTIC_DEFS); the exact split's are SPLIT_STATISTICS."""
    out: dict[str, list[np.ndarray]] = {name: [] for name, _, _ in statistics}
    for _, w in row_weights(counts, seq):
        for name, column, how in statistics:
            if column not in metrics:
                out[name].append(np.full(len(w), np.nan))
            elif how == "median":
                out[name].append(weighted_median(metrics[column], w))
            elif how == "share_gt60":
                out[name].append(weighted_mean((metrics[column] > ANGLE_GT).astype(np.float64), w))
            elif how == "mean":
                out[name].append(weighted_mean(metrics[column], w))
            else:
                raise ValueError(f"unknown aggregate {how!r} for {name!r}: median, share_gt60 or mean")
    return {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in out.items()}


class ResampledGrams:
    """The Gram matrix sum_i w_i v_i v_i^T of a statistic's rows on each replicate (`counts` [b, n_seq]:
    bootstrap multiplicities or jackknife weights),
    accumulated block by block in whichever of two forms holds fewer d x d matrices: one per resample
    (b of them) or one per sequence (n_seq of them; each resample's Gram is then the counts-weighted
    sum, formed a few at a time in `effective_ranks`). The default job (16 documents: a leave-one-out
    jackknife of 16 replicates, `jackknife_groups`) keeps 16 per statistic, the study preset (1,024
    sequences, 50 groups) 50. Stored in float32
    (their eigenvalues feed an entropy, not a solve); products in float64. Beside them, in the same form,
    the rows' sums and counts (float64), from which each replicate's centred Gram matrix follows:
    sum_i w_i v_i v_i^T - s s^T / n, s = sum_i w_i v_i, n = sum_i w_i (`centred` ranks)."""

    def __init__(self, counts: np.ndarray, d: int) -> None:
        self.counts = counts
        self.per_sequence = counts.shape[1] < counts.shape[0]
        n = counts.shape[1] if self.per_sequence else counts.shape[0]
        self.grams = np.zeros((n, d, d), np.float32)
        self.sums = np.zeros((n, d))
        self.rows = np.zeros(n)

    def add(self, v: np.ndarray, seq: np.ndarray) -> None:
        """Rows `v` [n_rows, d] of sequences `seq` (whole sequences of a block)."""
        if not len(self.counts):
            return
        if not self.per_sequence:
            self.grams += replicate_grams(v, seq, self.counts).astype(np.float32)
            seqs, inverse = np.unique(seq, return_inverse=True)
            per_seq = np.zeros((len(seqs), v.shape[1]))
            np.add.at(per_seq, inverse, np.asarray(v, np.float64))
            self.sums += self.counts[:, seqs] @ per_seq
            self.rows += self.counts[:, seqs] @ np.bincount(inverse).astype(np.float64)
            return
        order = np.argsort(seq, kind="stable")
        v, seq = v[order], seq[order]
        seqs, starts = np.unique(seq, return_index=True)
        for s, lo, hi in zip(seqs, starts, np.append(starts[1:], len(seq))):
            self.grams[s] += (v[lo:hi].T @ v[lo:hi]).astype(np.float32)
            self.sums[s] += np.asarray(v[lo:hi], np.float64).sum(axis=0)
            self.rows[s] += hi - lo

    def rank_chunks(self, chunk: int = 4, centred: bool = False) -> list[Callable[[], np.ndarray]]:
        """The effective ranks as work items: each forms `chunk` resamples' Gram matrices (centred on
        the resample's weighted mean row with `centred`) and returns their ranks (in resample order;
        `effective_ranks` runs them)."""
        b, d = len(self.counts), self.grams.shape[1]
        flat = self.grams.reshape(len(self.grams), d * d)

        def ranks(lo: int) -> np.ndarray:
            hi = min(b, lo + chunk)
            if self.per_sequence:
                weights = self.counts[lo:hi]
                grams = (weights.astype(np.float32) @ flat).reshape(-1, d, d)
                sums, rows = weights @ self.sums, weights @ self.rows
            else:
                grams, sums, rows = self.grams[lo:hi], self.sums[lo:hi], self.rows[lo:hi]
            if centred:
                means = np.divide(sums, rows[:, None], out=np.zeros_like(sums), where=rows[:, None] > 0)
                grams = grams - (sums[:, :, None] * means[:, None, :]).astype(np.float32)
            return gram_effective_ranks(grams)

        return [partial(ranks, lo) for lo in range(0, b, chunk)]

    def effective_ranks(self, chunk: int = 4, centred: bool = False) -> np.ndarray:
        """The effective rank (as `geometry.spectrum`, of the centred rows with `centred`) on every
        resample [b], a chunk of resamples per core at a time (`per_core_map`)."""
        return effective_ranks_of([self], chunk, centred=centred)[0]


def effective_ranks_of(resampled: Sequence[ResampledGrams], chunk: int = 4,
                       workers: int | None = None, centred: bool = False) -> list[np.ndarray]:
    """`effective_ranks` of several statistics, their chunks spread over the cores together (`workers`
    threads; default: one per core, see `per_core_map`)."""
    tasks = [r.rank_chunks(chunk, centred) for r in resampled]
    done = iter(per_core_map(lambda task: task(), [t for ts in tasks for t in ts], workers))
    return [np.concatenate([next(done) for _ in ts]) if ts else np.zeros(0) for ts in tasks]


def gram_effective_ranks(grams: np.ndarray) -> np.ndarray:
    """Effective rank (as `geometry.spectrum`) of the rows behind each Gram matrix [b, d, d]: with
    `replicate_grams`, the effective rank on every resample. The eigenvalues are solved in the Gram
    matrices' own precision (float32, as `ResampledGrams` keeps them; a rank differs from float64's by
    about 1e-7, relative) and the entropy is taken in float64."""
    if len(grams) == 0:
        return np.zeros(0)
    return effective_rank(torch.linalg.eigvalsh(torch.as_tensor(grams)).double().numpy())
