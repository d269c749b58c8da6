"""Bootstrap statistics on weights equal the statistics on the explicitly resampled rows."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from updatelens.bootstrap import (
    effective_rank,
    gram_effective_ranks,
    jackknife_counts,
    replicate_counts,
    replicate_grams,
    weighted_mean,
    weighted_median,
    weighted_spearman,
)
from updatelens.geometry import spectrum


def expanded(seq: np.ndarray, counts_row: np.ndarray) -> np.ndarray:
    """Row indices of the resample: each row repeated as often as its sequence was drawn."""
    return np.repeat(np.arange(len(seq)), counts_row[seq].astype(int))


def sample(n_seq: int = 9, per_seq: int = 7, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(n_seq), per_seq)
    a = rng.standard_normal(len(seq))
    b = a + rng.standard_normal(len(seq))
    b[::5] = 0.0  # ties, like KL clamped at 0
    return seq, a, b


def test_replicates_draw_whole_sequences_reproducibly() -> None:
    counts = replicate_counts(12, 50, seed=3)
    assert counts.shape == (50, 12)
    assert np.all(counts.sum(axis=1) == 12)
    np.testing.assert_array_equal(counts, replicate_counts(12, 50, seed=3))
    assert not np.array_equal(counts, replicate_counts(12, 50, seed=4))


def test_weighted_statistics_equal_the_expanded_resample() -> None:
    seq, a, b = sample()
    counts = replicate_counts(9, 40, seed=1)
    w = counts[:, seq]
    med = weighted_median(a, w)
    mean = weighted_mean(a, w)
    rho = weighted_spearman(a, b, w)
    for i, row in enumerate(counts):
        idx = expanded(seq, row)
        assert med[i] == np.median(a[idx])
        np.testing.assert_allclose(mean[i], np.mean(a[idx]), rtol=1e-12)
        np.testing.assert_allclose(rho[i], stats.spearmanr(a[idx], b[idx]).statistic, rtol=1e-10)


def test_weighted_spearman_skips_non_finite_and_constant() -> None:
    seq, a, b = sample()
    a[3] = np.nan
    counts = replicate_counts(9, 5, seed=2)
    w = counts[:, seq]
    ok = np.isfinite(a)
    for i, row in enumerate(counts):
        idx = expanded(seq, row)
        idx = idx[ok[idx]]
        np.testing.assert_allclose(weighted_spearman(a, b, w)[i], stats.spearmanr(a[idx], b[idx]).statistic,
                                   rtol=1e-10)
    assert np.isnan(weighted_spearman(np.ones_like(a), b, w)).all()


def test_replicate_spectra_equal_the_svd_of_the_resample() -> None:
    rng = np.random.default_rng(0)
    seq = np.repeat(np.arange(6), 20)
    v = rng.standard_normal((len(seq), 5)) * np.array([5.0, 2.0, 1.0, 0.5, 0.1])
    counts = replicate_counts(6, 4, seed=0)
    grams = replicate_grams(v, seq, counts, block=4)
    ranks = gram_effective_ranks(grams)
    for i, row in enumerate(counts):
        idx = expanded(seq, row)
        np.testing.assert_allclose(grams[i], v[idx].T @ v[idx], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(ranks[i], spectrum(v[idx]).effective_rank, rtol=1e-9)
    assert effective_rank(np.zeros((1, 3)))[0] == 0.0


@pytest.mark.parametrize("n_resamples", [3, 9])  # fewer resamples than sequences (per resample), more (per sequence)
def test_resampled_grams_give_the_effective_rank_of_each_resample_in_either_form(n_resamples: int) -> None:
    from updatelens.bootstrap import ResampledGrams

    rng = np.random.default_rng(1)
    seq = np.repeat(np.arange(6), 15)
    # a shared mean update (the rows' mean fills the first singular value unless centred)
    v = rng.standard_normal((len(seq), 5)) * np.array([5.0, 2.0, 1.0, 0.5, 0.1]) + np.array([0.0, 0.0, 0.0, 0.0, 8.0])
    counts = replicate_counts(6, n_resamples, seed=2)
    grams = ResampledGrams(counts, 5)
    assert grams.per_sequence == (n_resamples > 6) and len(grams.grams) == min(6, n_resamples)
    for block in (slice(0, 45), slice(45, 90)):  # two blocks of whole sequences
        grams.add(v[block], seq[block])
    ranks, centred = grams.effective_ranks(chunk=2), grams.effective_ranks(chunk=2, centred=True)
    for i, row in enumerate(counts):
        idx = expanded(seq, row)
        np.testing.assert_allclose(ranks[i], spectrum(v[idx]).effective_rank, rtol=1e-5)
        np.testing.assert_allclose(centred[i], spectrum(v[idx] - v[idx].mean(axis=0)).effective_rank, rtol=1e-4)
        assert abs(centred[i] - ranks[i]) > 0.3  # the mean matters here


def test_the_ranks_of_several_statistics_solved_together_are_each_ones_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from updatelens.bootstrap import ResampledGrams, effective_ranks_of

    rng = np.random.default_rng(3)
    seq = np.repeat(np.arange(6), 15)
    counts = replicate_counts(6, 9, seed=4)
    stats_ = []
    for scale in (1.0, 0.1, 3.0):
        grams = ResampledGrams(counts, 5)
        grams.add(rng.standard_normal((len(seq), 5)) * scale * np.array([5.0, 2.0, 1.0, 0.5, 0.1]), seq)
        stats_.append(grams)
    together = effective_ranks_of(stats_, chunk=2, workers=2)  # their chunks interleave over two threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one statistic at a time, in this thread
    for grams, ranks in zip(stats_, together):
        assert ranks.shape == (9,)
        np.testing.assert_allclose(ranks, grams.effective_ranks(chunk=4), rtol=1e-6)
    assert all(len(r) == 0 for r in effective_ranks_of([ResampledGrams(counts[:0], 5)]))


def test_a_resample_draws_documents_whole() -> None:
    from updatelens.bootstrap import sequence_counts

    docs = np.array([4, 4, 4, 9, 9, 12])
    counts = sequence_counts(docs, 300, seed=1)
    assert counts.shape == (300, 6)
    assert np.all(counts[:, 0] == counts[:, 1]) and np.all(counts[:, 1] == counts[:, 2])  # one article, one draw
    assert np.all(counts[:, 3] == counts[:, 4])
    per_doc = counts[:, [0, 3, 5]]
    assert np.all(per_doc.sum(axis=1) == 3)  # three documents drawn with replacement
    np.testing.assert_array_equal(sequence_counts(np.arange(6), 50, 3), replicate_counts(6, 50, 3))  # sequences as units


def test_a_jackknife_deals_the_documents_into_groups_each_left_out_once() -> None:
    docs = np.repeat(np.arange(10), [1, 2, 1, 3, 1, 1, 2, 1, 1, 1])  # 10 documents, 14 sequences
    jack = jackknife_counts(docs, 4, seed=0)
    assert jack.shape == (4, 14) and set(np.unique(jack)) == {0.0, 1.0}
    out = 1 - jack  # which sequences each group leaves out
    assert (out.sum(axis=0) == 1).all()  # every sequence in exactly one group
    for row in out:  # a group holds whole documents
        left = set(docs[row == 1])
        assert all(row[docs == d].all() for d in left)
    sizes = sorted(len(set(docs[row == 1])) for row in out)
    assert sizes == [2, 2, 3, 3]  # 10 documents dealt into 4 near-equal groups
    np.testing.assert_array_equal(jack, jackknife_counts(docs, 4, seed=0))  # reproducible
    assert jackknife_counts(docs, 50, 0).shape == (10, 14)  # more groups than documents: leave one out
    assert jackknife_counts(np.zeros(3), 20, 0).shape == (0, 3)  # one document: no jackknife
