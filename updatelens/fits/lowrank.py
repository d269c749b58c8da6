"""A = I + U V^T of rank r: reduced-rank ridge regression of D = Y - X on X, in kernel form.

With k < d the k x k kernel K = X X^T = W diag(e) W^T is the efficient object. In its eigenbasis,
with lambda the ridge and P = D D^T (k x k):
    alpha = (K + lambda I)^-1 D = W diag(1 / (e + lambda)) W^T D        (ridge solution B = X^T alpha)
    F     = K alpha             = W diag(s) W^T D,   s = e / (e + lambda)  (fitted neighbour updates)
    F F^T = W diag(s) (W^T P W) diag(s) W^T = W H W^T, so the top-r eigenvectors of H (k x k)
            give F's top-r right singular vectors V_r = F^T W U_r S_r^-1, and for an anchor x
    T(x) - x = (x B) V_r V_r^T, worked out with k-vectors: x B = (W^T X x / (e + lambda))^T W^T D,
            x B F^T W = s * (W^T P W)(W^T X x / (e + lambda)), and the result is a k-vector times D.
Two k x k x d products (K and P) and two k x k eigenproblems per anchor; the rest is O(k^2 + k d)
(W^T D, a k x d product, is never formed). lambda = ridge * trace(K) / k = ridge * mean ||x_j||^2
(the default scale of docs/method.md).
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, LocalFit, ridge_from_gram_diag


def fit_lowrank(X: torch.Tensor, D: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> LocalFit:
    K = X @ X.transpose(1, 2)  # [n, k, k]
    P = D @ D.transpose(1, 2)  # [n, k, k]
    k = K.shape[1]
    tiny = torch.finfo(K.dtype).tiny
    lam = ridge_from_gram_diag(K.diagonal(dim1=1, dim2=2).sum(dim=1), k, params.ridge)  # [n]
    evals, evecs = torch.linalg.eigh(K)  # ascending
    evals = evals.clamp_min(0.0)
    inv = 1.0 / (evals + lam[:, None]).clamp_min(tiny)  # [n, k]
    s = evals * inv  # [n, k]
    Pw = evecs.transpose(1, 2) @ P @ evecs  # [n, k, k] = C C^T with C = W^T D
    H = s[:, :, None] * Pw * s[:, None, :]  # [n, k, k]: F F^T in the eigenbasis
    s2, U = torch.linalg.eigh(H)
    r = min(params.rank, k)
    s2_top, U_top = s2[:, -r:], U[:, :, -r:]  # [n, r], [n, k, r]
    floor = s2[:, -1:].clamp_min(0.0) * (torch.finfo(K.dtype).eps * 10)
    inv_s2 = torch.where(s2_top > floor, 1.0 / s2_top.clamp_min(tiny), torch.zeros_like(s2_top))
    kappa = (evecs.transpose(1, 2) @ (X @ anchors[:, :, None])).squeeze(2)  # [n, k] = W^T X x
    fp = s * (Pw @ (kappa * inv)[:, :, None]).squeeze(2)  # [n, k] = W^T F (x B)^T
    proj = (U_top @ (inv_s2[:, :, None] * (U_top.transpose(1, 2) @ fp[:, :, None]))).squeeze(2)
    coef = (evecs @ (s * proj)[:, :, None]).squeeze(2)  # [n, k]: delta = coef^T D
    delta = (coef[:, None, :] @ D).squeeze(1)  # [n, d] = x B V_r V_r^T
    cond = (evals[:, -1] + lam) / (evals[:, 0] + lam)
    return LocalFit(tx=anchors + delta, cond=cond)
