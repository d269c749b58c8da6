"""The exact split of each update (docs/method.md, "The exact split"): with every window starting with
the same token, block l run with each token attending to itself and the window's first position is
exactly tokenwise (y_ctl, captured with the activations), and

    y = y_ctl(x) + a,   Δ_full = Δ_ctl + a,   Δ_ctl = y_ctl - x,

a being what attention to the rest of the context adds, token by token, with no estimator. Per kept
token: the norms, the ratios to ‖Δ_full‖ and the cosines between Δ_full, Δ_ctl and a; per layer,
their medians on every bootstrap resample of the documents (the findings' resamples), so each has an
interval (view `context_split_summary`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from updatelens.bootstrap import geometry_replicates
from updatelens.config import AnalysisConfig
from updatelens.findings import SPLIT_STATISTICS
from updatelens.geometry import EPS, cosine
from updatelens.steps.layer import LayerData, resample_counts, sample_docs
from updatelens.tables import Provenance, with_provenance

TOKEN_COLUMNS = ("norm_full", "norm_ctl", "norm_ctx", "ctl_ratio", "ctx_ratio", "cos_full_ctl", "cos_ctx_full",
                 "cos_ctx_ctl")


def split_metrics(x: np.ndarray, y: np.ndarray, y_ctl: np.ndarray) -> dict[str, np.ndarray]:
    """Per token ([N, d] each): ‖Δ_full‖, ‖Δ_ctl‖, ‖a‖, ‖Δ_ctl‖ / ‖Δ_full‖, ‖a‖ / ‖Δ_full‖,
    cos(Δ_full, Δ_ctl), cos(a, Δ_full), cos(a, Δ_ctl)."""
    x64, y64, c64 = (np.asarray(v, np.float64) for v in (x, y, y_ctl))
    full, ctl, ctx = y64 - x64, c64 - x64, y64 - c64
    n_full, n_ctl, n_ctx = (np.linalg.norm(v, axis=1) for v in (full, ctl, ctx))
    scale = np.maximum(n_full, EPS)
    return {"norm_full": n_full, "norm_ctl": n_ctl, "norm_ctx": n_ctx, "ctl_ratio": n_ctl / scale,
            "ctx_ratio": n_ctx / scale, "cos_full_ctl": cosine(full, ctl), "cos_ctx_full": cosine(ctx, full),
            "cos_ctx_ctl": cosine(ctx, ctl)}


def context_split_tables(data: LayerData, y_ctl: np.ndarray, cfg: AnalysisConfig,
                         prov: Provenance) -> tuple[pa.Table, pa.Table]:
    """A whole layer's `context_split` (per kept token) and `context_split_bootstrap` (the medians on
    every resample, replicates 0 .. bootstrap-1) from its transition and y_ctl [n_seq, T, d]."""
    metrics = split_metrics(data.x, data.y, y_ctl[data.kept])
    columns: dict[str, pa.Array] = {"seq": pa.array(data.seq, pa.int32()), "pos": pa.array(data.pos, pa.int32())}
    columns.update({name: pa.array(metrics[name], pa.float64()) for name in TOKEN_COLUMNS})
    tokens = with_provenance(columns, prov, data.layer)
    replicates = geometry_replicates(data.seq, metrics, resample_counts(cfg, sample_docs(data)), SPLIT_STATISTICS)
    resampled = {"replicate": pa.array(np.arange(cfg.bootstrap), pa.int32())}
    resampled.update({name: pa.array(values, pa.float64()) for name, values in replicates.items()})
    return tokens, with_provenance(resampled, prov, data.layer)
