"""Decomposition h_{l+1} = T(h_l) + r and its geometry, per token and per layer.

    Δ_full = y - x,  Δ_tok = T(x) - x,  r = y - T(x)   (so Δ_full = Δ_tok + r)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPS = 1e-30


def _norm(v: np.ndarray) -> np.ndarray:
    return np.linalg.norm(v, axis=1)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine; 0 where either vector is zero."""
    na, nb = _norm(a), _norm(b)
    dot = np.einsum("ij,ij->i", a, b)
    out = np.where((na > 0) & (nb > 0), dot / np.maximum(na * nb, EPS), 0.0)
    return np.clip(out, -1.0, 1.0)


def angle_deg(cos: np.ndarray) -> np.ndarray:
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


@dataclass
class Decomposition:
    delta_full: np.ndarray
    delta_tok: np.ndarray
    residual: np.ndarray


def decompose(x: np.ndarray, y: np.ndarray, tx: np.ndarray) -> Decomposition:
    x64, y64, t64 = (np.asarray(a, dtype=np.float64) for a in (x, y, tx))
    return Decomposition(delta_full=y64 - x64, delta_tok=t64 - x64, residual=y64 - t64)


def token_metrics(x: np.ndarray, y: np.ndarray, tx: np.ndarray, dec: Decomposition | None = None) -> dict[str, np.ndarray]:
    """Norms, relative error, the three cosines (update form), the map form, and angles.
    Pass `dec` when the caller already decomposed (x, y, tx), so it is not computed twice."""
    dec = dec if dec is not None else decompose(x, y, tx)
    n_full, n_tok, n_res = _norm(dec.delta_full), _norm(dec.delta_tok), _norm(dec.residual)
    cos_full_tok = cosine(dec.delta_full, dec.delta_tok)
    cos_full_res = cosine(dec.delta_full, dec.residual)
    cos_tok_res = cosine(dec.delta_tok, dec.residual)
    return {
        "norm_full": n_full,
        "norm_tok": n_tok,
        "norm_res": n_res,
        "rel_err": np.where(n_full > 0, n_res / np.maximum(n_full, EPS), np.where(n_res > 0, np.inf, 0.0)),
        "cos_full_tok": cos_full_tok,
        "cos_full_res": cos_full_res,
        "cos_tok_res": cos_tok_res,
        "cos_full_tok_map": cosine(np.asarray(y, np.float64), np.asarray(tx, np.float64)),
        "angle_full_tok": angle_deg(cos_full_tok),
        "angle_full_res": angle_deg(cos_full_res),
        "angle_tok_res": angle_deg(cos_tok_res),
    }


def update_shape(gram: np.ndarray, n: int) -> np.ndarray:
    """A square root S of the second moment Σ = gram / n of a layer's updates (Σ = S Sᵀ, from its
    eigendecomposition; negative rounding clipped): S z, z isotropic, is a draw of N(0, Σ)."""
    values, vectors = np.linalg.eigh(np.asarray(gram, np.float64) / max(n, 1))
    return vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]


def shaped_directions(isotropic: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Unit vectors in the directions of N(0, S Sᵀ) draws, from isotropic ones [N, d] (the direction of
    S g is that of S (g / ||g||)): random directions in the shape of the layer's updates, so the null's
    residual stays in the directions the stream uses (docs/method.md, "Nulls")."""
    v = np.asarray(isotropic, np.float64) @ shape.T
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), EPS)


def null_residual(dec: Decomposition, directions: np.ndarray) -> Decomposition:
    """The decomposition the same tokens would have if each residual kept its length but pointed in a
    random direction (`directions`: unit vectors [N, d], drawn in the layer's shape: `shaped_directions`):
    the null against which the findings' geometry is judged (docs/method.md, "Nulls"). Δ_tok is
    unchanged; r0 = ||r|| u, Δ_full0 = Δ_tok + r0."""
    r0 = np.linalg.norm(dec.residual, axis=1, keepdims=True) * np.asarray(directions, np.float64)
    return Decomposition(delta_full=dec.delta_tok + r0, delta_tok=dec.delta_tok, residual=r0)


def null_metrics(dec: Decomposition, null: Decomposition, x: np.ndarray, sub: Subspace | None,
                 m: int) -> dict[str, np.ndarray]:
    """Per token, the findings' geometric measures where the claimed structure is absent: on the
    random-direction residual of the same length (`null`, made by `null_residual`), the cosine of the full and
    tokenwise updates, the residual's angles against Δ_full and Δ_tok, and its projection energy on
    the top-m tokenwise directions (`sub`, when given); for the map form, the identity map (no
    tokenwise update: cos(y, x)), since the residual stream alone already aligns y with x."""
    x64 = np.asarray(x, np.float64)
    out = {
        "cos_full_tok_null": cosine(null.delta_full, null.delta_tok),
        "cos_full_tok_map_null": cosine(x64 + dec.delta_full, x64),
        "angle_full_res_null": angle_deg(cosine(null.delta_full, null.residual)),
        "angle_tok_res_null": angle_deg(cosine(null.delta_tok, null.residual)),
    }
    if sub is not None:
        out[f"proj_null_m{m}"] = projection_energy(null.residual, sub.basis, min(m, sub.basis.shape[1]))
    return out


def unrelated_alignment(dec: Decomposition, x: np.ndarray, partners: np.ndarray) -> dict[str, np.ndarray]:
    """Finding 1's null where the tokenwise part is exact (the exact split: no estimator to refit): each
    token's full update against the tokenwise update of a token of another document (`partners`, rows
    of the same block), in update and map form: cos(Δ_full_i, Δ_tok_j) and cos(y_i, x_i + Δ_tok_j)."""
    x64 = np.asarray(x, np.float64)
    other = dec.delta_tok[partners]
    return {"cos_full_tok_null": cosine(dec.delta_full, other),
            "cos_full_tok_map_null": cosine(x64 + dec.delta_full, x64 + other)}


# The estimator against the exact split, per token (where the self-and-first output y_ctl was captured)
CONTEXT_COLUMNS = ("cos_res_ctx", "res_share_ctx", "cos_tok_ctl")


def context_alignment(dec: Decomposition, x: np.ndarray, y_ctl: np.ndarray) -> dict[str, np.ndarray]:
    """The fit's split against the exact one (y = y_ctl + a, Δ_ctl = y_ctl - x): cos(r, a), is the
    residual the context part?; cos(r, a)^2, the share of ||r||^2 that lies along a; cos(Δ_tok, Δ_ctl),
    is the fitted tokenwise update the token's own?"""
    x64, c64 = np.asarray(x, np.float64), np.asarray(y_ctl, np.float64)
    context = x64 + dec.delta_full - c64
    cos_res_ctx = cosine(dec.residual, context)
    return {"cos_res_ctx": cos_res_ctx, "res_share_ctx": cos_res_ctx ** 2,
            "cos_tok_ctl": cosine(dec.delta_tok, c64 - x64)}


@dataclass
class Subspace:
    basis: np.ndarray  # [d, d] right singular vectors of the stacked Δ_tok, columns by energy
    singular_values: np.ndarray
    m_energy: int  # smallest m holding `threshold` of Δ_tok's energy


def energy_m(singular_values: np.ndarray, threshold: float) -> int:
    energy = singular_values**2
    total = energy.sum()
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(energy) / total, threshold - 1e-12) + 1)


def dominant_subspace(delta_tok: np.ndarray, threshold: float = 0.9) -> Subspace:
    """Uncentred SVD of the layer's stacked tokenwise updates."""
    _, s, vt = np.linalg.svd(np.asarray(delta_tok, np.float64), full_matrices=False)
    return Subspace(basis=vt.T, singular_values=s, m_energy=energy_m(s, threshold))


def projection_energy(v: np.ndarray, basis: np.ndarray, m: int) -> np.ndarray:
    """||P_m v||^2 / ||v||^2 per row (0 for a zero vector)."""
    coords = v @ basis[:, :m]
    num = (coords**2).sum(axis=1)
    den = (v**2).sum(axis=1)
    return np.where(den > 0, num / np.maximum(den, EPS), 0.0)


def projection_metrics(dec: Decomposition, sub: Subspace, ms: tuple[int, ...]) -> dict[str, np.ndarray]:
    d = sub.basis.shape[1]
    out: dict[str, np.ndarray] = {}
    for label, m in [*((f"m{m}", m) for m in ms), ("m90", sub.m_energy)]:
        m_eff = min(m, d)
        for name, v in (("full", dec.delta_full), ("tok", dec.delta_tok), ("res", dec.residual)):
            out[f"proj_{name}_{label}"] = projection_energy(v, sub.basis, m_eff)
    return out


@dataclass
class Spectrum:
    singular_values: np.ndarray
    cum_energy: np.ndarray
    effective_rank: float  # exp(entropy of the normalised energy): the participation of directions
    m_energy: int


def spectrum(v: np.ndarray, threshold: float = 0.9) -> Spectrum:
    return _spectrum_of(np.linalg.svd(np.asarray(v, np.float64), compute_uv=False), threshold)


def _spectrum_of(s: np.ndarray, threshold: float) -> Spectrum:
    energy = s**2
    total = energy.sum()
    if total > 0:
        p = energy / total
        nz = p[p > 0]
        eff = float(np.exp(-(nz * np.log(nz)).sum()))
        cum = np.cumsum(p)
    else:
        eff, cum = 0.0, np.zeros_like(s)
    return Spectrum(singular_values=s, cum_energy=cum, effective_rank=eff, m_energy=energy_m(s, threshold))


def _gram_eigen(gram: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Singular values (descending) and right singular vectors of a matrix from its Gram matrix
    V^T V [d, d]: at most min(n_rows, d) of them, as the SVD of the stacked rows gives."""
    eigenvalues, vectors = np.linalg.eigh(gram)
    keep = min(n_rows, gram.shape[0])
    order = np.argsort(eigenvalues)[::-1][:keep]
    return np.sqrt(np.clip(eigenvalues[order], 0.0, None)), vectors[:, order]


def subspace_from_gram(gram: np.ndarray, n_rows: int, threshold: float = 0.9) -> Subspace:
    """`dominant_subspace` of the stacked rows, from their d x d Gram matrix accumulated block by block
    (memory d x d whatever the number of rows; energies agree with the SVD to float rounding)."""
    s, vectors = _gram_eigen(gram, n_rows)
    return Subspace(basis=vectors, singular_values=s, m_energy=energy_m(s, threshold))


def spectrum_from_gram(gram: np.ndarray, n_rows: int, threshold: float = 0.9) -> Spectrum:
    """`spectrum` of the stacked rows from their Gram matrix."""
    s, _ = _gram_eigen(gram, n_rows)
    return _spectrum_of(s, threshold)
