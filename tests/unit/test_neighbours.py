from __future__ import annotations

import numpy as np
import pytest

from updatelens.errors import ConfigError
from updatelens.neighbours import GPU_MAX_K, candidates, clustered_search, gpu_id, knn, prepare, select_neighbours


def sample(n_seq: int = 30, seq: int = 10, d: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_seq * seq, d)).astype(np.float32), np.repeat(np.arange(n_seq), seq)


def brute_force(x: np.ndarray, groups: np.ndarray, k: int, exclusion: str) -> np.ndarray:
    v = x - x.mean(axis=0)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    sim = v @ v.T
    if exclusion in ("sequence", "self"):
        np.fill_diagonal(sim, -np.inf)
    if exclusion == "sequence":
        sim[groups[:, None] == groups[None, :]] = -np.inf
    return np.argsort(-sim, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("exclusion", ["sequence", "self", "none"])
def test_exact_search_matches_brute_force_cosine_on_centred_vectors(exclusion: str) -> None:
    x, groups = sample()
    got = knn(x, groups, 12, exclusion=exclusion)
    want = brute_force(x, groups, 12, exclusion)
    # same neighbour sets (order can differ only on exact ties, which random data does not have)
    assert all(set(a) == set(b) for a, b in zip(got, want))


def test_sequence_exclusion_never_returns_the_anchors_sequence() -> None:
    x, groups = sample()
    nb = knn(x, groups, 20, exclusion="sequence")
    assert not np.any(groups[nb] == groups[:, None])


def test_none_exclusion_lets_the_anchor_be_its_own_nearest_neighbour() -> None:
    x, groups = sample()
    nb = knn(x, groups, 5, exclusion="none")
    assert np.array_equal(nb[:, 0], np.arange(len(x)))


def test_l2_metric_uses_raw_distances() -> None:
    x, groups = sample()
    nb = knn(x, groups, 3, metric="l2", exclusion="self")
    dist = ((x[:, None] - x[None]) ** 2).sum(-1)
    np.fill_diagonal(dist, np.inf)
    assert np.array_equal(nb[:, 0], dist.argmin(axis=1))


@pytest.mark.parametrize("index", ["clustered", "hnsw", "ivf", "ivf_batch"])
def test_approximate_indexes_have_high_recall_and_respect_exclusion(index: str) -> None:
    """At their default settings (tuned on SmolLM2 states, which have structure) even isotropic
    random vectors, the hardest case for a partition into cells, keep most neighbours."""
    x, groups = sample(n_seq=200, seq=10, d=16)
    exact = knn(x, groups, 10)
    approx = knn(x, groups, 10, index=index)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, approx)])
    assert recall > 0.75
    assert not np.any(groups[approx] == groups[:, None])


@pytest.mark.parametrize("metric", ["cosine_centered", "l2"])
def test_clustered_search_probing_every_cluster_is_exact_search(metric: str) -> None:
    """With every cluster probed each query meets every row: the answer is the exact one."""
    x, _ = sample(n_seq=40, seq=10, d=12)
    v, faiss_metric = prepare(x, metric)
    import faiss

    flat = faiss.IndexFlat(v.shape[1], faiss_metric)
    flat.add(v)
    _, want = flat.search(v, 9)
    got = clustered_search(v, faiss_metric, 9, nlist=6, nprobe=6, block_entries=500)  # several row blocks
    assert all(set(a) == set(b) for a, b in zip(got, want))
    np.testing.assert_array_equal(got[:, 0], np.arange(len(v)))  # each row is its own nearest


def test_clustered_search_marks_missing_candidates_and_knn_falls_back_to_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query whose probed clusters hold fewer rows than asked gets -1s; knn completes those rows exactly."""
    import updatelens.neighbours as neighbours

    completed: list[int] = []
    exact_rows = neighbours.knn_exact_rows

    def recording(v, groups, k, exclusion, faiss_metric, rows):  # type: ignore[no-untyped-def]
        completed.extend(rows.tolist())
        return exact_rows(v, groups, k, exclusion, faiss_metric, rows)

    monkeypatch.setattr(neighbours, "knn_exact_rows", recording)
    rng = np.random.default_rng(3)
    # two far-apart blobs of 20 rows: one probed cluster holds 20 candidates, fewer than 30
    x = np.concatenate([rng.standard_normal((20, 6)) + 40, rng.standard_normal((20, 6)) - 40]).astype(np.float32)
    v, faiss_metric = prepare(x, "l2")
    found = clustered_search(v, faiss_metric, 30, nlist=2, nprobe=1)
    assert (found[:, 20:] == -1).all() and (found[:, :20] >= 0).all()
    groups = np.arange(40)
    got = knn(x, groups, 25, metric="l2", exclusion="self", index="clustered")
    assert len(completed) > 0  # rows whose probed clusters held fewer than 26 candidates
    want = knn(x, groups, 25, metric="l2", exclusion="self")
    assert all(set(a) == set(b) for a, b in zip(got, want))


def test_k_above_candidates_is_a_clear_error() -> None:
    x, groups = sample(n_seq=3, seq=10)
    with pytest.raises(ConfigError, match="candidate neighbours"):
        knn(x, groups, 25, exclusion="sequence")


def test_cuda_device_without_faiss_gpu_searches_on_the_cpu() -> None:
    """faiss-cpu has no GPU: a cuda device must give the CPU search's answer, not an error."""
    import faiss

    x, groups = sample()
    assert gpu_id("cpu", 16) is None and gpu_id("cuda:0", GPU_MAX_K + 1) is None
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        assert gpu_id("cuda:0", 16) is None
    np.testing.assert_array_equal(knn(x, groups, 8, device="cuda"), knn(x, groups, 8))


def test_clustered_search_of_some_queries_answers_as_the_full_search_does() -> None:
    x, _ = sample(n_seq=40, seq=10, d=12)
    v, faiss_metric = prepare(x, "cosine_centered")
    full = clustered_search(v, faiss_metric, 9, nlist=6, nprobe=2)
    queries = np.array([5, 0, 399, 17, 200])
    np.testing.assert_array_equal(clustered_search(v, faiss_metric, 9, nlist=6, nprobe=2, queries=queries),
                                  full[queries])


@pytest.mark.parametrize("kind, param", [("ivf", 1000), ("ivf_batch", 1000), ("hnsw", 400)])
def test_faiss_indexes_at_their_widest_setting_find_the_exact_neighbours(kind: str, param: int) -> None:
    """IVF probing every list (per query and big-batch) and HNSW with a wide beam return the exact
    neighbours after sequence exclusion, through the same selection `knn` uses."""
    x, groups = sample(n_seq=40, seq=10, d=12)
    v, faiss_metric = prepare(x, "cosine_centered")
    search_k = 5 + 10
    found = candidates(v, faiss_metric, search_k, kind, param=param)
    got = select_neighbours(found, v, faiss_metric, groups, 5, "sequence")
    want = knn(x, groups, 5)
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(got, want)])
    assert recall >= (1.0 if kind != "hnsw" else 0.99)


def test_document_exclusion_never_takes_a_neighbour_from_the_anchors_article() -> None:
    from updatelens.config import AnalysisConfig
    from updatelens.steps.layer import Transition
    from updatelens.steps.local_fits import layer_neighbours

    rng = np.random.default_rng(0)
    n_seq, per_seq, d = 6, 20, 8
    seq = np.repeat(np.arange(n_seq), per_seq).astype(np.int32)
    doc = np.repeat([0, 0, 1, 1, 2, 2], per_seq).astype(np.int32)  # two windows per article
    x = rng.standard_normal((n_seq * per_seq, d)).astype(np.float32)
    x[doc == 0] += 5  # an article's tokens are each other's nearest: the fit would borrow its context
    data = Transition(0, x, x, seq, np.tile(np.arange(per_seq), n_seq).astype(np.int32), doc)
    for exclusion, same in (("document", doc), ("sequence", seq)):
        cfg = AnalysisConfig(n_seq=n_seq, seq_len=per_seq + 1, k=10, exclusion=exclusion, windows_per_doc=2)
        neighbours = layer_neighbours(data, cfg)
        assert neighbours is not None and not np.any(same[neighbours] == same[:, None])
    assert np.any(doc[neighbours] == doc[:, None])  # sequence exclusion lets the article in
