"""A = diag(a): one coefficient per coordinate, closed form; psd_diagonal clamps a >= 0.

Ridge shrinks a towards 1 (the identity map), the natural prior for a residual-stream update:
    a_i = 1 + sum_j x_ji (y_ji - x_ji) / (sum_j x_ji^2 + lambda).
Each coordinate is a one-dimensional convex problem, so clamping at 0 is the exact constrained
optimum for psd_diagonal.
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, LocalFit, ridge_from_gram_diag


def fit_diagonal(X: torch.Tensor, D: torch.Tensor, anchors: torch.Tensor, params: FitParams,
                 psd: bool = False) -> LocalFit:
    sxx = (X * X).sum(dim=1)  # [n, d]
    sxd = (X * D).sum(dim=1)
    lam = ridge_from_gram_diag(sxx.sum(dim=1, keepdim=True), X.shape[2], params.ridge)
    denom = sxx + lam
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    a = 1.0 + torch.where(denom > 0, sxd / safe, torch.zeros_like(sxd))
    if psd:
        a = a.clamp_min(0.0)
    cond = denom.max(dim=1).values / denom.min(dim=1).values
    return LocalFit(tx=a * anchors, cond=cond)


def fit_psd_diagonal(X: torch.Tensor, D: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> LocalFit:
    return fit_diagonal(X, D, anchors, params, psd=True)
