"""Which positive controls a layer gets, and the linear control's one map per layer.

Kept apart from the controls stage (`updatelens.steps.controls`) because the activations stage fits
the map: it imports only numpy, so a change to the fits or the geometry does not make the captured
activations stale (the stages' code versions follow their imports, `updatelens.versions`).
"""

from __future__ import annotations

import numpy as np


def made_controls(asked: tuple[str, ...], has_self_first: bool) -> list[str]:
    """The controls made for `asked` (in order): self_first where the architecture has it, the linear
    control in its place where it has not (Mamba, an unknown architecture)."""
    out: list[str] = []
    for control in asked:
        if control == "self_first" and not has_self_first:
            control = "linear"
        if control not in out:
            out.append(control)
    return out


def ridge_map(gram: np.ndarray, cross: np.ndarray, ridge: float) -> np.ndarray:
    """B [d, d] of the ridge regression of y - x on x from the normal equations (gram = X^T X, cross =
    X^T (Y - X), float64): the ridge is `ridge` times the mean eigenvalue of X^T X, as the fits' ridge."""
    d = gram.shape[0]
    lam = ridge * float(np.trace(gram)) / d
    return np.linalg.solve(gram + lam * np.eye(d), cross)


class HeldOutMaps:
    """The linear control's map per layer, accumulated batch by batch over the kept tokens of the
    held-out windows (memory: two d x d float64 matrices per layer, whatever their number)."""

    def __init__(self, layers: list[int], d: int) -> None:
        self.gram = {layer: np.zeros((d, d)) for layer in layers}
        self.cross = {layer: np.zeros((d, d)) for layer in layers}
        self.rows = 0

    def add(self, layer: int, x: np.ndarray, y: np.ndarray) -> None:
        x64 = np.asarray(x, np.float64)
        self.gram[layer] += x64.T @ x64
        self.cross[layer] += x64.T @ (np.asarray(y, np.float64) - x64)

    def maps(self, ridge: float) -> dict[int, np.ndarray]:
        if not self.rows:
            raise ValueError("the linear control's map needs held-out tokens; none were captured")
        return {layer: ridge_map(self.gram[layer], self.cross[layer], ridge) for layer in self.gram}


def linear_outputs(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x + xB for states x [..., d] (float32 out, float64 product): the linear control's target."""
    x64 = np.asarray(x, np.float64)
    return (x64 + x64 @ b).astype(np.float32)
