"""One ridge-regression map for the whole layer: T(x) = x + x B, the cheapest baseline.

Fitted on the training folds' tokens and evaluated on the held-out fold, like every other class
evaluated out of sample. lambda = ridge * trace(X^T X) / d.
"""

from __future__ import annotations

import torch

from updatelens.fits.base import FitParams, ridge_from_gram_diag


def fit_global_linear(X: torch.Tensor, Y: torch.Tensor, params: FitParams) -> tuple[torch.Tensor, float]:
    """Returns (B [d, d], condition number of the regularised normal matrix)."""
    G = X.T @ X
    d = G.shape[0]
    lam = ridge_from_gram_diag(torch.trace(G), d, params.ridge)
    A = G + lam * torch.eye(d, dtype=G.dtype, device=G.device)
    B = torch.linalg.solve(A, X.T @ (Y - X))
    evals = torch.linalg.eigvalsh(A)
    return B, float(evals[-1] / evals[0].clamp_min(torch.finfo(G.dtype).tiny))


def predict_global_linear(B: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return X + X @ B
