"""A = s Q, Q orthogonal, s >= 0: scaled orthogonal Procrustes, solved in the span of the data.

Only the span of the 2k neighbour vectors (x_j and y_j) is constrained by the data, so we take
an orthonormal basis B of that span (QR of [X; Y]^T, d x 2k), solve Procrustes there
(Q_b = U V^T from the SVD of M = Yb^T Xb), and let Q act as the identity on the complement:
    T(x) = s (B Q_b B^T x + (I - B B^T) x),   s = trace(S) / ||X||_F^2 (or 1).
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, LocalFit


def fit_orthogonal(X: torch.Tensor, Y: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> LocalFit:
    n, k, d = X.shape
    stacked = torch.cat([X, Y], dim=1).transpose(1, 2)  # [n, d, 2k]
    B, _ = torch.linalg.qr(stacked, mode="reduced")  # [n, d, min(d, 2k)]
    Xb = X @ B  # [n, k, m]
    Yb = Y @ B
    M = Yb.transpose(1, 2) @ Xb  # [n, m, m]
    U, S, Vh = torch.linalg.svd(M)
    Qb = U @ Vh
    if params.orthogonal_scale:
        s = S.sum(dim=1) / (X * X).sum(dim=(1, 2)).clamp_min(torch.finfo(X.dtype).tiny)
    else:
        s = torch.ones(n, dtype=X.dtype, device=X.device)
    ab = (anchors[:, None, :] @ B).squeeze(1)  # [n, m] = B^T x
    inside = (B @ (Qb @ ab[:, :, None])).squeeze(2)
    outside = anchors - (B @ ab[:, :, None]).squeeze(2)
    tx = s[:, None] * (inside + outside)
    gram = torch.linalg.eigvalsh(X @ X.transpose(1, 2))
    cond = gram[:, -1].clamp_min(0) / gram[:, 0].clamp_min(torch.finfo(X.dtype).tiny)
    return LocalFit(tx=tx, cond=cond)
