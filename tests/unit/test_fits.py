"""Known-answer tests of every function class, and the fast batched paths against a per-anchor
reference written the plain way (numpy lstsq / SVD per anchor)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from updatelens.config import AnalysisConfig
from updatelens.fits import FitParams, fit_layer, fit_local_batched
from updatelens.geometry import cosine, token_metrics
from updatelens.neighbours import knn

D = 16
N_SEQ, SEQ = 40, 12  # 480 tokens
# Ridge biases coefficients by about `ridge` relative; 1e-9 keeps that far below the 1e-3 bound.
TIGHT = dict(ridge=1e-9, k=64, rank=3)


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_SEQ * SEQ, D)) + 0.5
    groups = np.repeat(np.arange(N_SEQ), SEQ)
    return x, groups


def random_orthogonal(rng: np.random.Generator, d: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def run_class(fn_class: str, x: np.ndarray, y: np.ndarray, groups: np.ndarray, **over: object) -> np.ndarray:
    cfg = AnalysisConfig(classes=(fn_class,), **{**TIGHT, **over})  # type: ignore[arg-type]
    nb = knn(x, groups, cfg.k, cfg.metric, cfg.exclusion) if fn_class not in ("global_linear", "mlp") else None
    fit = fit_layer(fn_class, x, y, groups, nb, cfg)
    return token_metrics(x, y, fit.tx)["rel_err"]


MAPS = {
    "diagonal": lambda rng, x: x * rng.uniform(0.3, 1.8, D),
    "psd_diagonal": lambda rng, x: x * rng.uniform(0.0, 2.0, D),
    "lowrank": lambda rng, x: x + x @ rng.standard_normal((D, 3)) @ rng.standard_normal((3, D)) / 4,
    "orthogonal": lambda rng, x: 1.3 * x @ random_orthogonal(rng, D).T,
    "global_linear": lambda rng, x: x @ (np.eye(D) + 0.3 * rng.standard_normal((D, D))),
}


@pytest.mark.parametrize("fn_class", sorted(MAPS))
def test_matching_class_recovers_its_own_map(fn_class: str) -> None:
    x, groups = data()
    y = MAPS[fn_class](np.random.default_rng(1), x)
    err = run_class(fn_class, x, y, groups)
    assert np.max(err) < 1e-3, f"{fn_class}: max relative error {np.max(err):.2e}"


def test_psd_diagonal_clamps_negative_coefficients() -> None:
    x, groups = data()
    a = np.linspace(-0.5, 1.5, D)  # the first coordinates are negative
    y = x * a
    assert np.max(run_class("diagonal", x, y, groups)) < 1e-3
    assert np.median(run_class("psd_diagonal", x, y, groups)) > 0.05  # cannot follow a < 0


def test_diagonal_cannot_fit_a_rotation_but_orthogonal_can() -> None:
    x, groups = data()
    y = MAPS["orthogonal"](np.random.default_rng(2), x)
    assert np.median(run_class("diagonal", x, y, groups)) > 0.3
    assert np.max(run_class("orthogonal", x, y, groups)) < 1e-3


@pytest.mark.parametrize("fn_class", ["diagonal", "lowrank"])
def test_slowly_varying_map_error_scales_with_its_variation(fn_class: str) -> None:
    """A(x) = diag(1 + 0.5 sin(eps * w.x)). A local fit sees A vary by ~eps * |w| * radius over
    the neighbourhood, so the error shrinks with eps; at eps = 1e-3 the map is constant to 1e-3
    over the data (|w.x| <~ 10), and the error must be below 1e-3 times that scale."""
    x, groups = data()
    w = np.random.default_rng(3).standard_normal(D) / np.sqrt(D)
    a = np.random.default_rng(4).uniform(0.5, 1.5, D)
    errs = []
    for eps in (1e-3, 1e-1, 1.0):
        scale = 1 + 0.5 * np.sin(eps * x @ w)[:, None]
        y = x * a * scale if fn_class == "diagonal" else x + (x @ np.diag(a - 1)) * scale
        errs.append(float(np.median(run_class(fn_class, x, y, groups, rank=D - 1))))
    assert errs[0] < 1e-2
    assert errs[0] < errs[1] < errs[2]


def test_planted_cross_token_component_ends_up_in_the_residual() -> None:
    """y_t = A x_t + c x_{t-1}: the previous token's vector is not a function of x_t, so the
    tokenwise part must recover A x_t and the residual must carry c x_{t-1}."""
    rng = np.random.default_rng(5)
    x, groups = data(6)
    a = rng.uniform(0.5, 1.5, D)
    prev = np.roll(x, 1, axis=0)
    prev[np.arange(len(x)) % SEQ == 0] = 0.0  # no previous token at position 0
    planted = 0.4 * prev
    y = x * a + planted
    cfg = AnalysisConfig(classes=("diagonal",), k=128, ridge=1e-3)
    nb = knn(x, groups, cfg.k, cfg.metric, cfg.exclusion)
    fit = fit_layer("diagonal", x, y, groups, nb, cfg)
    r = y - fit.tx
    tok = fit.tx - x
    has_prev = np.arange(len(x)) % SEQ != 0
    assert np.median(cosine(r[has_prev], planted[has_prev])) > 0.9
    # the tokenwise part follows the true tokenwise update and carries little of the planted term
    # (what it does carry is the estimation noise of a from k = 128 neighbours)
    assert np.median(cosine(tok, x * (a - 1))) > 0.9
    assert np.median(np.abs(cosine(tok[has_prev], planted[has_prev]))) < 0.3


def test_mlp_learns_a_nonlinear_tokenwise_map_better_than_linear() -> None:
    """y = x + sin(2x) elementwise: no linear map follows it (measured: global_linear's median
    error 0.91, the MLP's 0.59 with 600 Adam steps on 1000 training tokens)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2000, D))
    groups = np.repeat(np.arange(100), 20)
    y = x + np.sin(2 * x)
    err_mlp = run_class("mlp", x, y, groups, mlp_steps=600, mlp_hidden=128, mlp_lr=3e-3)
    err_lin = run_class("global_linear", x, y, groups)
    assert np.median(err_mlp) < 0.75 * np.median(err_lin)


# ---- fast paths against plain per-anchor references ----------------------------------------
def reference_lowrank(X: np.ndarray, Y: np.ndarray, xa: np.ndarray, rank: int, ridge: float) -> np.ndarray:
    """Primal reduced-rank ridge: B = (X^T X + lam I)^-1 X^T D, keep F's top-r right singular vectors."""
    D_ = Y - X
    lam = ridge * np.mean(np.sum(X * X, axis=1))
    B = np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ D_)
    _, _, vt = np.linalg.svd(X @ B, full_matrices=False)
    V = vt[:rank].T
    return xa + xa @ B @ V @ V.T


def reference_orthogonal(X: np.ndarray, Y: np.ndarray, xa: np.ndarray, ridge: float) -> np.ndarray:
    """Full-space Procrustes (valid when 2k >= d spans everything), pulled to the identity by
    the ridge: Q = U V^T of M + lam I, then the optimal scale for that Q."""
    M = Y.T @ X
    lam = ridge * np.sum(X * X) / X.shape[1]
    u, _, vt = np.linalg.svd(M + lam * np.eye(X.shape[1]))
    q = u @ vt
    scale = max(np.sum(q * M) / np.sum(X * X), 0.0)
    return scale * q @ xa


def reference_diagonal(X: np.ndarray, Y: np.ndarray, xa: np.ndarray, ridge: float) -> np.ndarray:
    sxx = np.sum(X * X, axis=0)
    lam = ridge * sxx.sum() / X.shape[1]
    a = 1 + np.sum(X * (Y - X), axis=0) / (sxx + lam)
    return a * xa


@pytest.mark.parametrize("fn_class", ["diagonal", "lowrank", "orthogonal"])
def test_batched_fit_equals_per_anchor_reference(fn_class: str) -> None:
    rng = np.random.default_rng(9)
    x, groups = data(10)
    y = x + np.tanh(x @ rng.standard_normal((D, D)) / 4)  # some nonlinear map: no exact fit
    k, rank, ridge = 40, 3, 1e-2
    nb = knn(x, groups, k)
    fast = fit_local_batched(fn_class, x, y, nb, FitParams(rank=rank, ridge=ridge), torch.float64, chunk=37).tx.numpy()
    for i in range(0, len(x), 23):
        X, Y = x[nb[i]], y[nb[i]]
        if fn_class == "lowrank":
            ref = reference_lowrank(X, Y, x[i], rank, ridge)
        elif fn_class == "orthogonal":
            ref = reference_orthogonal(X, Y, x[i], ridge)
        else:
            ref = reference_diagonal(X, Y, x[i], ridge)
        np.testing.assert_allclose(fast[i], ref, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("fn_class", ["lowrank", "orthogonal"])
def test_threaded_chunks_equal_one_stream(fn_class: str) -> None:
    """Chunks on three worker threads (torch single-threaded meanwhile) give the serial result, in
    anchor order, and torch's thread count is back afterwards."""
    rng = np.random.default_rng(12)
    x, groups = data(12)
    y = x + np.tanh(x @ rng.standard_normal((D, D)) / 4)
    nb = knn(x, groups, 24)
    params = FitParams(rank=3, ridge=1e-2)
    threads = torch.get_num_threads()
    serial = fit_local_batched(fn_class, x, y, nb, params, torch.float64, chunk=29, workers=1)
    threaded = fit_local_batched(fn_class, x, y, nb, params, torch.float64, chunk=29, workers=3)
    assert torch.get_num_threads() == threads
    np.testing.assert_allclose(threaded.tx.numpy(), serial.tx.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(threaded.cond.numpy(), serial.cond.numpy(), rtol=1e-8)


def test_threaded_chunks_restore_torch_threads_when_a_fit_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import updatelens.fits as fits

    calls: list[int] = []

    def failing(X: torch.Tensor, D_: torch.Tensor, anchors: torch.Tensor, params: FitParams) -> object:
        assert torch.get_num_threads() == 1  # the workers run torch single-threaded
        calls.append(len(anchors))
        if len(calls) == 1:
            raise RuntimeError("fit failed")
        time.sleep(0.05)
        return fits.fit_diagonal(X, D_, anchors, params)

    monkeypatch.setitem(fits.LOCAL_FITTERS, "lowrank", failing)
    x, groups = data(13)  # 480 anchors: 48 chunks of 10
    nb = knn(x, groups, 8)
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="fit failed"):
        fit_local_batched("lowrank", x, x, nb, FitParams(rank=2, ridge=1e-2), chunk=10, workers=2)
    assert torch.get_num_threads() == threads
    assert len(calls) < 10  # the chunks not yet started when the first failed were cancelled


def test_default_workers_thread_only_the_lapack_bound_classes_on_the_cpu() -> None:
    from updatelens.fits import default_workers

    assert default_workers("lowrank", "cpu") == torch.get_num_threads()
    assert default_workers("orthogonal", "cpu") == torch.get_num_threads()
    assert default_workers("diagonal", "cpu") == 1
    assert default_workers("lowrank", "cuda") == 1


def test_orthogonal_span_solution_is_identity_outside_the_data_span() -> None:
    """With d > 2k, the map is only determined on span(X, Y); outside it Q is the identity."""
    rng = np.random.default_rng(11)
    d, k = 50, 8
    X = rng.standard_normal((1, k, d))
    Q = random_orthogonal(rng, d)
    Y = X @ Q.T
    outside = rng.standard_normal(d)
    basis, _ = np.linalg.qr(np.concatenate([X[0], Y[0]]).T)
    outside -= basis @ (basis.T @ outside)  # orthogonal to the span
    from updatelens.fits.orthogonal import fit_orthogonal

    res = fit_orthogonal(torch.tensor(X), torch.tensor(Y - X), torch.tensor(outside[None]), FitParams(orthogonal_scale=False))
    np.testing.assert_allclose(res.tx.numpy()[0], outside, atol=1e-10)


@pytest.mark.parametrize("fn_class", ["diagonal", "psd_diagonal", "lowrank", "orthogonal", "global_linear"])
def test_every_linear_class_fitted_on_a_zero_update_returns_x(fn_class: str) -> None:
    """y = x: every linear class's T(x) is x (to 1e-6 of ||x||), whatever its ridge; an invariant of
    the solvers (tested here), not something a stored file could violate."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((120, 24)) * rng.uniform(0.5, 3.0, 24)
    params = FitParams(rank=4, ridge=1e-3, orthogonal_scale=True)
    if fn_class == "global_linear":
        from updatelens.fits.global_linear import fit_global_linear

        X = torch.as_tensor(x)
        B, _ = fit_global_linear(X, X, params)
        tx = (X + X @ B).numpy()
    else:
        neighbours = knn(x, np.arange(len(x)), 16, exclusion="self")
        tx = fit_local_batched(fn_class, x, x, neighbours, params).tx.numpy()
    err = np.linalg.norm(tx - x, axis=1) / np.linalg.norm(x, axis=1)
    assert err.max() <= 1e-6, (fn_class, err.max())

