"""A = s Q, Q orthogonal, s >= 0: scaled orthogonal Procrustes, solved in the span of the data.

Only the span of the 2k neighbour vectors (x_j and y_j) is constrained by the data, so we take
an orthonormal basis B of that span (QR of [X; D]^T, d x 2k, the same span as [X; Y]^T), solve
Procrustes there and let Q act as the identity on the complement:
    T(x) = s (B Q_b B^T x + (I - B B^T) x).
Within the span, M = Yb^T Xb has rank <= k, so many Q attain the optimum. The ridge picks the
one closest to the identity: Q_b = U V^T from the SVD of M + lambda I (maximising
tr(Q^T M) + lambda tr(Q)), lambda = ridge * ||X||_F^2 / m, the same scale as the other classes.
Then s = tr(Q_b^T M) / ||X||_F^2 (clamped at 0), or 1 without scaling.
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, LocalFit, ridge_from_gram_diag


def fit_orthogonal(X: torch.Tensor, D: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> LocalFit:
    n, k, d = X.shape
    stacked = torch.cat([X, D], dim=1).transpose(1, 2)  # [n, d, 2k]: span(X, D) = span(X, Y)
    B, _ = torch.linalg.qr(stacked, mode="reduced")  # [n, d, m], m = min(d, 2k); the solution does not depend on the basis
    m = B.shape[2]
    Xb = X @ B  # [n, k, m]
    Yb = Xb + D @ B
    M = Yb.transpose(1, 2) @ Xb  # [n, m, m]
    x_energy = (X * X).sum(dim=(1, 2))
    lam = ridge_from_gram_diag(x_energy, m, params.ridge)  # x_energy = trace(X X^T)
    eye = torch.eye(m, dtype=X.dtype, device=X.device)
    U, S, Vh = torch.linalg.svd(M + lam[:, None, None] * eye)
    Qb = U @ Vh
    if params.orthogonal_scale:
        s = (Qb * M).sum(dim=(1, 2)) / x_energy.clamp_min(torch.finfo(X.dtype).tiny)
        s = s.clamp_min(0.0)
    else:
        s = torch.ones(n, dtype=X.dtype, device=X.device)
    ab = (anchors[:, None, :] @ B).squeeze(1)  # [n, m] = B^T x
    inside = (B @ (Qb @ ab[:, :, None])).squeeze(2)
    outside = anchors - (B @ ab[:, :, None]).squeeze(2)
    tx = s[:, None] * (inside + outside)
    # condition of the regularised problem: how well its top-min(k, m) directions pin Q down
    r = min(k, m)
    cond = S[:, 0] / S[:, r - 1].clamp_min(torch.finfo(X.dtype).tiny)
    return LocalFit(tx=tx, cond=cond)
