"""A = I + U V^T of rank r: reduced-rank ridge regression of D = Y - X on X, in kernel form.

With k < d the k x k kernel K = X X^T is the efficient object:
    alpha = (K + lambda I)^-1 D            (ridge solution B = X^T alpha, the min-norm one)
    F     = K alpha                        (fitted updates of the neighbours, k x d)
    the rank-r projection keeps F's top-r right singular vectors V_r, obtained from the k x k
    eigenproblem of F F^T = W S^2 W^T as V_r = F^T W_r S_r^-1, so
    T(x) - x = (x B) V_r V_r^T = (x X^T alpha) F^T W_r S_r^-2 W_r^T F.
lambda = ridge * trace(K) / k = ridge * mean ||x_j||^2 (METHOD.md's default scale).
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, LocalFit


def fit_lowrank(X: torch.Tensor, Y: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> LocalFit:
    D = Y - X
    K = X @ X.transpose(1, 2)  # [n, k, k]
    k = K.shape[1]
    lam = params.ridge * K.diagonal(dim1=1, dim2=2).sum(dim=1) / k  # [n]
    evals, evecs = torch.linalg.eigh(K)  # ascending
    evals = evals.clamp_min(0.0)
    inv = 1.0 / (evals + lam[:, None]).clamp_min(torch.finfo(K.dtype).tiny)
    # alpha = W diag(inv) W^T D
    alpha = evecs @ (inv[:, :, None] * (evecs.transpose(1, 2) @ D))  # [n, k, d]
    F = K @ alpha  # [n, k, d]
    G = F @ F.transpose(1, 2)  # [n, k, k]
    s2, W = torch.linalg.eigh(G)
    r = min(params.rank, k)
    s2_top, W_top = s2[:, -r:], W[:, :, -r:]  # [n, r], [n, k, r]
    floor = s2[:, -1:].clamp_min(0.0) * (torch.finfo(K.dtype).eps * 10)
    inv_s2 = torch.where(s2_top > floor, 1.0 / s2_top.clamp_min(torch.finfo(K.dtype).tiny),
                         torch.zeros_like(s2_top))
    kappa = (X @ anchors[:, :, None]).squeeze(2)  # [n, k] = x X^T
    p = (kappa[:, None, :] @ alpha).squeeze(1)  # [n, d] = x B (full-rank ridge prediction)
    w = (F @ p[:, :, None]).squeeze(2)  # [n, k] = F p
    w = (W_top @ (inv_s2[:, :, None] * (W_top.transpose(1, 2) @ w[:, :, None]))).squeeze(2)
    delta = (w[:, None, :] @ F).squeeze(1)  # [n, d] = p V_r V_r^T
    cond = (evals[:, -1] + lam) / (evals[:, 0] + lam)
    return LocalFit(tx=anchors + delta, cond=cond)
