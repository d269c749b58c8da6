"""Tokenwise function classes and the per-layer driver that evaluates them at every anchor."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from updatelens.config import AnalysisConfig
from updatelens.fits.base import FitParams, LocalFit
from updatelens.fits.diagonal import fit_diagonal, fit_psd_diagonal
from updatelens.fits.global_linear import fit_global_linear, predict_global_linear
from updatelens.fits.lowrank import fit_lowrank
from updatelens.fits.mlp import fit_mlp
from updatelens.fits.orthogonal import fit_orthogonal
from updatelens.progress import progress
from updatelens.threads import per_core_map

LocalFitter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FitParams], LocalFit]

LOCAL_FITTERS: dict[str, LocalFitter] = {
    "diagonal": fit_diagonal,
    "psd_diagonal": fit_psd_diagonal,
    "lowrank": fit_lowrank,
    "orthogonal": fit_orthogonal,
}

# Classes whose per-anchor work is dominated by small LAPACK calls (k x k eigh, QR, SVD): on the CPU
# their chunks run on one worker thread per core, each single-threaded (updatelens.threads). The
# memory-bound diagonal classes lose with threads.
THREADED_CLASSES = frozenset({"lowrank", "orthogonal"})

__all__ = ["LOCAL_FITTERS", "THREADED_CLASSES", "FitParams", "LayerFit", "fit_layer", "fit_local_batched",
           "refit_anchors", "torch_dtype"]


@dataclass
class LayerFit:
    fn_class: str
    tx: np.ndarray  # [N, d] T(x) for every kept token (float64 or float32)
    cond: np.ndarray  # [N] condition number of the solved system (NaN for mlp)
    degenerate: np.ndarray  # [N] bool: non-finite output or cond above max_cond


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `fit_dtype` setting."""
    return torch.float64 if name == "float64" else torch.float32


def default_workers(fn_class: str, device: str) -> int:
    """Worker threads `fit_local_batched` uses when not told: torch's thread count for the
    LAPACK-bound classes on the CPU, otherwise 1 (one stream of batched calls)."""
    if fn_class in THREADED_CLASSES and torch.device(device).type == "cpu":
        return torch.get_num_threads()
    return 1


def fit_local_batched(fn_class: str, x: np.ndarray, y: np.ndarray, neighbours: np.ndarray,
                      params: FitParams, dtype: torch.dtype = torch.float64, chunk: int = 256,
                      device: str = "cpu", workers: int | None = None, label: str | None = None) -> LocalFit:
    """One fit per anchor, batched in chunks of anchors (no Python loop per anchor). With a `label`,
    the chunks done show as progress (updatelens.progress) under that name.

    With workers > 1 the chunks run on that many threads, torch single-threaded meanwhile (see
    THREADED_CLASSES); the result is the same chunk by chunk (to BLAS rounding) and in order."""
    fitter = LOCAL_FITTERS[fn_class]
    # x and y stay in their stored precision (float32: half the memory of a float64 copy of each);
    # a chunk's neighbours are gathered, then cast, and D = Y - X formed in the fit's dtype: the
    # same values as casting whole arrays first, without holding two [N, d] float64 copies
    X_all = torch.as_tensor(x, device=device)
    Y_all = torch.as_tensor(y, device=device)
    nb = torch.as_tensor(neighbours, device=device)

    def one(start: int) -> LocalFit:
        # anchor i is token i: neighbours may cover only the first anchors (e.g. a sanity subsample)
        # index_select: the same gather as X_all[idx], measured 1% (float64) to 6% (float32) faster
        # over a whole threaded lowrank fit
        idx = nb[start : start + chunk]
        flat = idx.reshape(-1)
        X = X_all.index_select(0, flat).view(*idx.shape, -1).to(dtype)
        D = Y_all.index_select(0, flat).view(*idx.shape, -1).to(dtype) - X
        return fitter(X, D, X_all[start : start + len(idx)].to(dtype), params)

    # each chunk's result goes straight into its rows of the output (no list of chunks and a cat:
    # that held two copies of [N, d] at once)
    tx = torch.empty((len(nb), X_all.shape[1]), dtype=dtype, device=device)
    cond = torch.empty(len(nb), dtype=dtype, device=device)

    starts = range(0, len(nb), chunk)
    n_workers = min(default_workers(fn_class, device) if workers is None else workers, len(starts))
    with progress(label, len(nb), "anchor") if label else nullcontext() as bar:

        def into(start: int) -> None:
            result = one(start)
            tx[start : start + len(result.tx)] = result.tx
            cond[start : start + len(result.cond)] = result.cond
            if bar is not None:
                bar.update(len(result.tx))

        per_core_map(into, starts, n_workers)
    return LocalFit(tx=tx, cond=cond)


def refit_anchors(fn_class: str, x: np.ndarray, y: np.ndarray, neighbours: np.ndarray, anchors: np.ndarray,
                  params: FitParams, dtype: torch.dtype = torch.float64) -> np.ndarray:
    """T(x) at the given anchor rows [m, d] from their neighbour rows [m, k], in one call of the class's
    fitter: the plain path (no chunks, threads or preallocated output) that audits what a stage stored."""
    X_all = torch.as_tensor(x)
    nb = torch.as_tensor(neighbours, dtype=torch.int64)
    X = X_all[nb].to(dtype)
    D = torch.as_tensor(y)[nb].to(dtype) - X
    anchor_rows = X_all[torch.as_tensor(anchors, dtype=torch.int64)].to(dtype)
    return LOCAL_FITTERS[fn_class](X, D, anchor_rows, params).tx.numpy()


def _folds(groups: np.ndarray, n_folds: int) -> np.ndarray:
    return np.asarray(groups) % n_folds


def fit_layer(fn_class: str, x: np.ndarray, y: np.ndarray, groups: np.ndarray,
              neighbours: np.ndarray | None, cfg: AnalysisConfig, label: str | None = None) -> LayerFit:
    """T(x) at every kept token of one layer for one class, evaluated out of sample. `label`
    (e.g. "smollm2-135m layer 15: ") names the local fits' progress."""
    params = FitParams(rank=cfg.rank, ridge=cfg.ridge, orthogonal_scale=cfg.orthogonal_scale)
    dtype = torch_dtype(cfg.fit_dtype)
    if fn_class in LOCAL_FITTERS:
        assert neighbours is not None, "local classes need neighbours"
        res = fit_local_batched(fn_class, x, y, neighbours, params, dtype, cfg.anchor_chunk, cfg.device,
                                label=f"{label}fit {fn_class}" if label is not None else None)
        tx = res.tx.cpu().numpy()
        cond = res.cond.cpu().numpy()
    else:
        tx = np.empty(x.shape, dtype=np.float64 if dtype == torch.float64 else np.float32)
        cond = np.full(len(x), np.nan)
        fold = _folds(groups, cfg.folds)
        X = torch.as_tensor(x, device=cfg.device).to(dtype)
        Y = torch.as_tensor(y, device=cfg.device).to(dtype)
        for f in range(cfg.folds):
            test = torch.as_tensor(fold == f, device=cfg.device)
            train = ~test
            if fn_class == "global_linear":
                B, c = fit_global_linear(X[train], Y[train], params)
                tx[test.cpu().numpy()] = predict_global_linear(B, X[test]).cpu().numpy()
                cond[test.cpu().numpy()] = c
            elif fn_class == "mlp":
                net = fit_mlp(X[train], Y[train], cfg.mlp_hidden, cfg.mlp_steps, cfg.mlp_lr, cfg.seed + f)
                tx[test.cpu().numpy()] = net(X[test]).cpu().numpy()
            else:
                raise ValueError(f"unknown function class {fn_class!r}")
    finite = np.isfinite(tx).all(axis=1)
    degenerate = ~finite | (np.nan_to_num(cond, nan=0.0) > cfg.max_cond)
    return LayerFit(fn_class=fn_class, tx=tx, cond=cond, degenerate=degenerate)
