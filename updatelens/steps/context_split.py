"""The exact split of each update (docs/method.md, "The exact split"): with every window starting with
the same token, block l run with each token attending to itself and the window's first position is
exactly tokenwise (y_ctl, captured with the activations), and

    y = y_ctl(x) + a,   Δ_full = Δ_ctl + a,   Δ_ctl = y_ctl - x,

a being what attention to the rest of the context adds, token by token, with no estimator. Per kept
token: the norms, the ratios to ‖Δ_full‖ and the cosines between Δ_full, Δ_ctl and a; per layer,
their medians on every bootstrap resample of the documents (the findings' resamples), so each has an
interval (view `context_split_summary`); per head and per source distance, where a comes from
(`context_heads_table`, from what the capture measured: `updatelens.context_sources`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from updatelens.bootstrap import geometry_replicates
from updatelens.config import AnalysisConfig
from updatelens.context_sources import DISTANCE_LABELS
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


def _ratio(per_seq: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Ratios of sums Σ per_seq / Σ total over the sequences ([n_seq, m] and [n_seq])."""
    return per_seq.sum(0) / max(float(total.sum()), EPS)


def _ratio_with_interval(per_seq: np.ndarray, total: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """`_ratio`, and its 2.5 % and 97.5 % quantiles over the resamples (`counts` [B, n_seq]; NaN without
    resamples)."""
    point = _ratio(per_seq, total)
    if len(counts) == 0:
        nan = np.full(per_seq.shape[1], np.nan)
        return point, nan, nan
    resampled = (counts @ per_seq) / np.maximum(counts @ total, EPS)[:, None]  # [B, m]
    return point, np.quantile(resampled, 0.025, axis=0), np.quantile(resampled, 0.975, axis=0)


def _nullable(values: np.ndarray) -> pa.Array:
    """float64 with null where a value does not apply (NaN here): a stored table compares equal to itself."""
    return pa.array(values, pa.float64(), from_pandas=True)


def context_heads_table(data: LayerData, y_ctl: np.ndarray, cfg: AnalysisConfig, prov: Provenance) -> pa.Table:
    """Where a layer's context part a = y - y_ctl comes from (`context_sources`), over its kept tokens:
    one row per attention head (kind `head`: the share of a along the head's context restored alone,
    <a_h, a> summed over tokens / ||a||^2 summed; the head's attention mass on the context, the first
    position and itself), one for what the heads add only together (kind `together`: 1 less the
    heads' shares), and one per source-distance bin (kind `distance`: the share of what the bin's sources
    add to the nearer ones, these shares adding up to 1; the heads' mean attention mass on the bin).
    Intervals: the 2.5 % and 97.5 % quantiles over the findings' document resamples."""
    src = data.sources
    if src is None:
        raise ValueError(f"layer {data.layer}: the activations hold no context sources (ctx_head_dot ...); rerun the "
                         f"activations stage")
    kept = data.kept
    a = data.y_full.astype(np.float64) - y_ctl.astype(np.float64)
    energy = np.where(kept, np.einsum("std,std->st", a, a), 0.0)  # [n_seq, T]
    counts = resample_counts(cfg, sample_docs(data)) if cfg.bootstrap else np.zeros((0, kept.shape[0]))

    def per_seq(values: np.ndarray) -> np.ndarray:  # [n_seq, T, m] -> kept tokens' sums per sequence [n_seq, m]
        return np.where(kept[..., None], values.astype(np.float64), 0.0).sum(1)

    total = energy.sum(1)
    head_share = _ratio_with_interval(per_seq(src.head_dot), total, counts)
    head_sq = _ratio(per_seq(src.head_norm.astype(np.float64) ** 2), total)
    together = _ratio_with_interval(total[:, None] - per_seq(src.head_dot).sum(1, keepdims=True), total, counts)
    dist_share = _ratio_with_interval(per_seq(src.dist_dot), total, counts)
    dist_sq = _ratio(per_seq(src.dist_norm.astype(np.float64) ** 2), total)
    n = int(kept.sum())
    mass = src.mass[kept].astype(np.float64).mean(0) if n else np.full(src.mass.shape[2:], np.nan)  # [H, 6]
    heads = src.n_heads
    bins = len(DISTANCE_LABELS)
    kinds = ["head"] * heads + ["together"] + ["distance"] * bins
    sources = [str(h) for h in range(heads)] + ["all heads"] + list(DISTANCE_LABELS)
    index = list(range(heads)) + [-1] + list(range(bins))
    nan = np.full(1, np.nan)
    columns: dict[str, pa.Array] = {
        "kind": pa.array(kinds, pa.string()), "source": pa.array(sources, pa.string()),
        "idx": pa.array(index, pa.int32()),
        **{name: _nullable(np.concatenate([head_share[i], together[i], dist_share[i]]))
           for i, name in enumerate(("share", "share_lo", "share_hi"))},
        "norm_ratio": _nullable(np.sqrt(np.concatenate([head_sq, nan, dist_sq]))),
        "mass": _nullable(np.concatenate([mass[:, 2:].sum(1), nan, mass[:, 2:].mean(0)])),
        "mass_first": _nullable(np.concatenate([mass[:, 0], nan, np.full(bins, np.nan)])),
        "mass_self": _nullable(np.concatenate([mass[:, 1], nan, np.full(bins, np.nan)])),
        "n_tokens": pa.array([n] * len(kinds), pa.int32()),
    }
    return with_provenance(columns, prov, data.layer)
