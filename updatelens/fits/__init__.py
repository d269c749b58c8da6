"""Tokenwise function classes and the per-layer driver that evaluates them at every anchor."""

from __future__ import annotations

from collections.abc import Callable
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

LocalFitter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FitParams], LocalFit]

LOCAL_FITTERS: dict[str, LocalFitter] = {
    "diagonal": fit_diagonal,
    "psd_diagonal": fit_psd_diagonal,
    "lowrank": fit_lowrank,
    "orthogonal": fit_orthogonal,
}

__all__ = ["LOCAL_FITTERS", "FitParams", "LayerFit", "fit_layer", "fit_local_batched"]


@dataclass
class LayerFit:
    fn_class: str
    tx: np.ndarray  # [N, d] T(x) for every kept token (float64 or float32)
    cond: np.ndarray  # [N] condition number of the solved system (NaN for mlp)
    degenerate: np.ndarray  # [N] bool: non-finite output or cond above max_cond


def _torch_dtype(name: str) -> torch.dtype:
    return torch.float64 if name == "float64" else torch.float32


def fit_local_batched(fn_class: str, x: np.ndarray, y: np.ndarray, neighbours: np.ndarray,
                      params: FitParams, dtype: torch.dtype = torch.float64, chunk: int = 256,
                      device: str = "cpu") -> LocalFit:
    """One fit per anchor, batched in chunks of anchors (no Python loop per anchor)."""
    fitter = LOCAL_FITTERS[fn_class]
    X_all = torch.as_tensor(x, device=device).to(dtype)
    D_all = torch.as_tensor(y, device=device).to(dtype) - X_all  # once: each token is in ~k neighbourhoods
    nb = torch.as_tensor(neighbours, device=device)
    txs, conds = [], []
    # anchor i is token i: neighbours may cover only the first anchors (e.g. a sanity subsample)
    for start in range(0, len(nb), chunk):
        idx = nb[start : start + chunk]
        res = fitter(X_all[idx], D_all[idx], X_all[start : start + len(idx)], params)
        txs.append(res.tx)
        conds.append(res.cond)
    return LocalFit(tx=torch.cat(txs), cond=torch.cat(conds))


def _folds(groups: np.ndarray, n_folds: int) -> np.ndarray:
    return np.asarray(groups) % n_folds


def fit_layer(fn_class: str, x: np.ndarray, y: np.ndarray, groups: np.ndarray,
              neighbours: np.ndarray | None, cfg: AnalysisConfig) -> LayerFit:
    """T(x) at every kept token of one layer for one class, evaluated out of sample."""
    params = FitParams(rank=cfg.rank, ridge=cfg.ridge, orthogonal_scale=cfg.orthogonal_scale)
    dtype = _torch_dtype(cfg.fit_dtype)
    if fn_class in LOCAL_FITTERS:
        assert neighbours is not None, "local classes need neighbours"
        res = fit_local_batched(fn_class, x, y, neighbours, params, dtype, cfg.anchor_chunk, cfg.device)
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
