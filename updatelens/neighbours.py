"""k nearest tokens in layer-l space, with faiss, excluding the anchor (and by default its sequence)."""

from __future__ import annotations

import contextlib
import io
import math

import faiss
import numpy as np
import torch

from updatelens.errors import ConfigError


def prepare(x: np.ndarray, metric: str) -> tuple[np.ndarray, int]:
    """Vectors and faiss metric for a metric name. Cosine metrics use inner product on unit rows."""
    v = np.ascontiguousarray(x, dtype=np.float32)
    if metric == "l2":
        return v, faiss.METRIC_L2
    if metric == "cosine_centered":
        v = v - v.mean(axis=0, keepdims=True)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    v = v / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(v, dtype=np.float32), faiss.METRIC_INNER_PRODUCT


# faiss's GPU search returns at most this many neighbours per query (flat and IVF indexes)
GPU_MAX_K = 2048


def gpu_id(device: str, search_k: int) -> int | None:
    """The GPU to search on: for a cuda device when faiss was built with GPU support (faiss-gpu)
    and sees a GPU, and k fits the GPU kernels; None = search on the CPU (faiss-cpu, or no GPU)."""
    if not device.startswith("cuda") or search_k > GPU_MAX_K:
        return None
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def search_device(device: str, search_k: int) -> str:
    """Where `knn` searches for a configured device: "cuda:i" or "cpu" (see `gpu_id`)."""
    gpu = gpu_id(device, search_k)
    return "cpu" if gpu is None else f"cuda:{gpu}"


def build_index(v: np.ndarray, faiss_metric: int, kind: str, seed: int = 0, gpu: int | None = None) -> faiss.Index:
    """A filled faiss index over v: "exact" (flat), "hnsw" (M = 32) or "ivf" (IVFFlat, 4 sqrt(n) lists);
    the search-time parameter (efSearch, nprobe) is set by `faiss_candidates`."""
    n, d = v.shape
    if kind == "exact":
        index: faiss.Index = faiss.IndexFlat(d, faiss_metric)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss_metric)
        index.hnsw.efConstruction = 80
    elif kind in ("ivf", "ivf_batch"):
        nlist = max(1, int(4 * np.sqrt(n)))
        quantizer = faiss.IndexFlat(d, faiss_metric)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss_metric)
        index.cp.seed = seed
        index.train(v)
    else:
        raise ConfigError(f"unknown index {kind!r}")
    if gpu is not None and kind in ("exact", "ivf"):  # faiss has no GPU HNSW
        index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), gpu, index)
    index.add(v)
    return index


# search-time setting of each approximate index (nprobe; efSearch for hnsw): the smallest reaching
# recall@64 >= 0.95 under sequence exclusion on SmolLM2's layer 8 (`python -m bench --only knn`, which
# judges them on layer 15); the clustered index at 32,768 and 130,048 tokens, the larger of the two
DEFAULT_SEARCH_PARAM = {"clustered": 4, "ivf": 16, "ivf_batch": 16, "hnsw": 192}


def faiss_candidates(index: faiss.Index, kind: str, v: np.ndarray, queries: np.ndarray, search_k: int,
                     param: int) -> np.ndarray:
    """search_k candidates [len(queries), search_k] of each query row of v in a filled faiss index.
    param is nprobe for "ivf" (set through faiss.ParameterSpace) and for "ivf_batch" (the same index
    searched with faiss.contrib's big_batch_search, which groups the queries by inverted list), efSearch
    for "hnsw"; unused for "exact"."""
    space = faiss.GpuParameterSpace() if "Gpu" in type(index).__name__ else faiss.ParameterSpace()
    if kind in ("ivf", "ivf_batch"):
        space.set_index_parameter(index, "nprobe", int(param))
    elif kind == "hnsw":
        space.set_index_parameter(index, "efSearch", max(int(param), search_k))
    if kind == "ivf_batch":
        from faiss.contrib.big_batch_search import big_batch_search

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per inverted list
            _, found = big_batch_search(index, v[queries], search_k)
        return found
    _, found = index.search(v[queries], search_k)
    return found


def clustered_search(v: np.ndarray, faiss_metric: int, search_k: int, seed: int = 0, device: str = "cpu",
                     nlist: int | None = None, nprobe: int = 5, block_entries: int = 1 << 25,
                     queries: np.ndarray | None = None) -> np.ndarray:
    """Approximate search_k nearest rows of v for each query row (default: every row), [n_queries,
    search_k], nearest first, -1 where a query's clusters hold fewer candidates.

    k-means (faiss) splits the rows into nlist clusters (default 2.3 sqrt(n)) and each query probes its
    nprobe nearest centroids, as in an IVF index. Queries are then grouped by their nearest cluster and
    each group is searched exactly against the members of every cluster its queries probe, as one matrix
    product and top-k on `device` (rows sorted by cluster, so candidates are contiguous runs rather
    than rows gathered one by one). Faiss's CPU IVF scans the lists query by query (memory-bound);
    batching a cluster's queries keeps the search BLAS-bound. How it compares with faiss's IVF (per query
    and big-batch) and HNSW at equal recall: `python -m bench --only knn` (bench record knn.json).
    """
    n, d = v.shape
    nlist = max(1, min(n, nlist or round(2.3 * math.sqrt(n))))
    nprobe = min(nprobe, nlist)
    spherical = faiss_metric == faiss.METRIC_INNER_PRODUCT
    kmeans = faiss.Kmeans(d, nlist, niter=10, seed=seed, spherical=spherical, min_points_per_centroid=1,
                          max_points_per_centroid=64)
    kmeans.train(v)
    centroids = faiss.IndexFlat(d, faiss_metric)
    assert kmeans.centroids is not None  # set by train
    centroids.add(kmeans.centroids)
    _, probes = centroids.search(v, nprobe)  # [n, nprobe], nearest first
    order = np.argsort(probes[:, 0], kind="stable")  # rows sorted by cluster: each cluster a contiguous run
    bounds = np.searchsorted(probes[order, 0], np.arange(nlist + 1))
    sorted_v = torch.as_tensor(v[order], device=device)
    # a cluster's queries are searched against the union of the clusters its rows probe, so a subset of
    # queries gets exactly the answers the full search gives them
    q_rows = np.arange(n) if queries is None else np.asarray(queries)
    q_order = order if queries is None else q_rows[np.argsort(probes[q_rows, 0], kind="stable")]
    q_bounds = bounds if queries is None else np.searchsorted(probes[q_order, 0], np.arange(nlist + 1))
    q_v = sorted_v if queries is None else torch.as_tensor(v[q_order], device=device)
    q_pos = np.empty(n, dtype=np.int64)  # output row of each query
    q_pos[q_rows] = np.arange(len(q_rows))
    # L2: rank by 2 q.c - |c|^2 (|q|^2 is the same for all of a query's candidates)
    sq_norms = None if spherical else (sorted_v * sorted_v).sum(dim=1)
    found = np.full((len(q_rows), search_k), -1, dtype=np.int64)
    for c in range(nlist):
        lo, hi = q_bounds[c], q_bounds[c + 1]
        if lo == hi:
            continue
        runs = [(bounds[j], bounds[j + 1]) for j in np.unique(probes[order[bounds[c]:bounds[c + 1]]])]
        cand = np.concatenate([np.arange(a, b) for a, b in runs])  # positions in sorted order
        base = torch.cat([sorted_v[a:b] for a, b in runs])  # contiguous copies, no row gather
        base_sq = None if sq_norms is None else torch.cat([sq_norms[a:b] for a, b in runs])[None, :]
        width = min(search_k, len(cand))
        step = max(1, block_entries // max(1, len(cand)))
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            scores = q_v[start:stop] @ base.T
            if base_sq is not None:
                scores = 2 * scores - base_sq
            top = torch.topk(scores, width, dim=1).indices.cpu().numpy()
            found[q_pos[q_order[start:stop]], :width] = order[cand[top]]
    return found


GROUP_EXCLUSIONS = ("document", "sequence")  # drop the anchor's whole group (the groups the caller passes)


def exclusion_width(groups: np.ndarray, exclusion: str) -> int:
    if exclusion in GROUP_EXCLUSIONS:
        return int(np.bincount(groups).max())
    return 1 if exclusion == "self" else 0


def resolve_index(index: str, n: int, ann_threshold: int) -> str:
    """The index `knn` uses for n points: "auto" is exact up to ann_threshold points, else clustered."""
    if index != "auto":
        return index
    return "exact" if n <= ann_threshold else "clustered"


def knn(x: np.ndarray, groups: np.ndarray, k: int, metric: str = "cosine_centered",
        exclusion: str = "sequence", index: str = "exact", seed: int = 0, device: str = "cpu",
        ann_threshold: int = 32768) -> np.ndarray:
    """Indices [N, k] of each token's k nearest neighbours, nearest first.

    exclusion: "document" or "sequence" drops every token of the anchor's own group (`groups`: its
    document, or its sequence, as the caller passes them), "self" only
    the anchor (the fit is evaluated at the anchor out of sample), "none" nothing: the anchor is
    then usually its own nearest neighbour and the fit sees it in sample. index: "exact" (faiss
    flat), "auto" (exact up to ann_threshold points, clustered above), or approximate: "clustered"
    (see `clustered_search`; the fastest at recall >= 0.95 in `bench --only knn`), "ivf" (faiss
    IVFFlat), "ivf_batch" (the same searched with faiss.contrib's big_batch_search), "hnsw". device
    "cuda[:i]" searches on that GPU: the clustered products with torch, exact and IVF where
    faiss-gpu is installed; else on the CPU.
    """
    n = len(x)
    index = resolve_index(index, n, ann_threshold)
    groups = np.asarray(groups)
    extra = exclusion_width(groups, exclusion)
    available = n - extra
    if k > available:
        raise ConfigError(f"k={k} exceeds the {available} candidate neighbours left after "
                          f"exclusion={exclusion!r}; lower k")
    v, faiss_metric = prepare(x, metric)
    search_k = min(n, k + extra)
    found = candidates(v, faiss_metric, search_k, index, seed=seed, device=device)
    return select_neighbours(found, v, faiss_metric, groups, k, exclusion)


def candidates(v: np.ndarray, faiss_metric: int, search_k: int, index: str, param: int | None = None,
               seed: int = 0, device: str = "cpu", queries: np.ndarray | None = None) -> np.ndarray:
    """search_k candidate neighbours [n_queries, search_k] of each query row of prepared vectors v
    (default: every row), nearest first, -1 where an approximate index found fewer. param: the index's
    search-time setting (see DEFAULT_SEARCH_PARAM)."""
    rows = np.arange(len(v)) if queries is None else np.asarray(queries)
    if index == "clustered":
        return clustered_search(v, faiss_metric, search_k, seed, device,
                                nprobe=param or DEFAULT_SEARCH_PARAM["clustered"], queries=queries)
    faiss_index = build_index(v, faiss_metric, index, seed, gpu_id(device, search_k))
    return faiss_candidates(faiss_index, index, v, rows, search_k, param or DEFAULT_SEARCH_PARAM.get(index, 0))


def select_neighbours(found: np.ndarray, v: np.ndarray, faiss_metric: int, groups: np.ndarray, k: int,
                      exclusion: str, queries: np.ndarray | None = None) -> np.ndarray:
    """The k nearest candidates of each query that the exclusion allows ([n_queries, k], int64); a query
    whose candidates run short (an approximate index) is searched again exactly."""
    rows = (np.arange(len(found)) if queries is None else np.asarray(queries))[:, None]
    drop = found < 0
    if exclusion in (*GROUP_EXCLUSIONS, "self"):
        drop |= found == rows
    if exclusion in GROUP_EXCLUSIONS:
        drop |= groups[np.clip(found, 0, None)] == groups[rows]
    order = np.argsort(drop, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(found, order, axis=1)
    short = np.take_along_axis(drop, order, axis=1).any(axis=1)
    if short.any():
        chosen[short] = knn_exact_rows(v, groups, k, exclusion, faiss_metric, rows[short, 0])
    return chosen.astype(np.int64)


def knn_exact_rows(v: np.ndarray, groups: np.ndarray, k: int, exclusion: str, faiss_metric: int,
                   rows: np.ndarray) -> np.ndarray:
    """Exact k nearest allowed neighbours of the given rows (the fallback of approximate searches)."""
    index = faiss.IndexFlat(v.shape[1], faiss_metric)
    index.add(v)
    _, found = index.search(v[rows], min(len(v), k + exclusion_width(groups, exclusion)))
    return select_neighbours(found, v, faiss_metric, groups, k, exclusion, queries=rows)
