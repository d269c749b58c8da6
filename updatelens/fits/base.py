"""The shared interface of the tokenwise function classes.

A *local* class fits one map per anchor on its k neighbours' pairs, batched over anchors:
    fit(X [n, k, d], D [n, k, d], anchors [n, d], params) -> LocalFit
with D = Y - X the neighbours' updates (the driver computes Y - X once per layer and gathers it:
each token sits in about k neighbourhoods), and is evaluated at the anchor, which is not among
its neighbours (out of sample).
A *per-layer* class fits one map per layer on training sequences and predicts held-out ones.
Every map is linear-through-the-origin or x + g(x): no intercept, so T is truly tokenwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FitParams:
    rank: int = 8
    ridge: float = 1e-3  # times the mean eigenvalue of the fit's normal matrix
    orthogonal_scale: bool = True


@dataclass
class LocalFit:
    tx: torch.Tensor  # [n, d] T(anchor)
    cond: torch.Tensor  # [n] condition number of the regularised system that was solved


def ridge_from_gram_diag(gram_diag_sum: torch.Tensor, dim: int, ridge: float) -> torch.Tensor:
    """lambda = ridge * trace(G) / dim, the mean eigenvalue of a normal matrix G."""
    return ridge * gram_diag_sum / dim
