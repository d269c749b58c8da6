"""The estimator's power against the sample size: does it recover a layer that is tokenwise by
construction, and from how many tokens on?

One capture of the largest sample serves every size (the first n windows: nested samples, as the
convergence study's; with the default's one window per article, n windows are n articles). For each
layer, size and neighbour count k, the neighbours are searched anew among the size's tokens
(exclusion by document, as the pipeline's), and the local fit is evaluated at a fixed subsample of
anchors (the power comes from how densely the neighbours cover the space, not from how many anchors
are scored). Beside the local classes, the global ones (`global_linear`, `mlp`: one map per layer,
fitted on the size's documents in folds and evaluated on the held-out fold; k is 0 for them): for the
real update and for each positive control (updatelens.steps.controls), the median relative error
‖y - T(x)‖ / ‖y - x‖ and the median cos(Δ_full, Δ_tok) with 95 % bootstrap intervals over documents,
and where that cosine's interval lies against finding 1's threshold. The mlp, the costly one, is
fitted to the self-and-first control only (the power question); `CONTROL_ONLY`. The linear control
(one map fitted outside the sample) is not part of the study: an architecture without the
self-and-first block (Mamba) has no power row, and the power line says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from updatelens.bootstrap import sequence_counts, weighted_median
from updatelens.capture import capture_batches, kept_mask, self_first_layers
from updatelens.config import AnalysisConfig
from updatelens.corpus import Sample
from updatelens.findings import BY_ID
from updatelens.fits import LOCAL_FITTERS, fit_layer, fit_local_batched, torch_dtype
from updatelens.fits.base import FitParams
from updatelens.models import LoadedModel
from updatelens.neighbours import knn
from updatelens.tables import Provenance, with_provenance
from updatelens.verdicts import threshold_outcome

DEFAULT_TOKENS = (2048, 8192, 32768)
DEFAULT_KS = (16, 64, 256)
DEFAULT_ANCHORS = 2048  # anchors scored per (layer, size): the default job's whole sample
DEFAULT_CLASSES = ("lowrank", "global_linear", "mlp")
CONTROL_ONLY = frozenset({"mlp"})  # fitted to the power question's target (the self-and-first control) only
POWER_TARGET = "self_first"


@dataclass
class LayerSample:
    """The kept tokens of one layer over the largest sample, in (seq, pos) order."""

    x: np.ndarray  # [N, d] float32
    y: np.ndarray
    y_ctl: np.ndarray | None
    seq: np.ndarray  # [N]
    doc: np.ndarray  # [N]


def capture_layers(lm: LoadedModel, sample: Sample, layers: Sequence[int], cfg: AnalysisConfig) -> dict[int, LayerSample]:
    """h_l, h_{l+1} and the self-and-first block output (where the architecture has one) of every kept token."""
    self_first = self_first_layers(lm, ("self_first",), layers, sample.first_token)
    parts: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]]] = {layer: [] for layer in layers}
    for batch in capture_batches(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch,
                                 last_block=max(layers), self_first=self_first):
        kept = kept_mask(batch.attention_mask, cfg.skip_first_position)
        rows = np.nonzero(kept)[0] + batch.start
        for layer in layers:
            alone = batch.self_first.get(layer)
            parts[layer].append((batch.states[layer][kept], batch.states[layer + 1][kept],
                                 alone[kept] if alone is not None else None, rows))
    out = {}
    for layer, chunks in parts.items():
        seq = np.concatenate([c[3] for c in chunks]).astype(np.int32)
        selves = [c[2] for c in chunks if c[2] is not None]
        y_ctl = np.concatenate(selves) if len(selves) == len(chunks) else None
        out[layer] = LayerSample(np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]),
                                 y_ctl, seq, np.asarray(sample.doc_index)[seq].astype(np.int32))
    return out


def _row_stats(x: np.ndarray, y: np.ndarray, tx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per anchor: relative error ‖y - T(x)‖ / ‖y - x‖ and cos(y - x, T(x) - x)."""
    full = y.astype(np.float64) - x
    tok = tx.astype(np.float64) - x
    norm_full = np.linalg.norm(full, axis=1)
    rel = np.linalg.norm(full - tok, axis=1) / np.maximum(norm_full, 1e-30)
    cos = (full * tok).sum(axis=1) / np.maximum(norm_full * np.linalg.norm(tok, axis=1), 1e-30)
    return rel, cos


def _interval(values: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    reps = weighted_median(values, weights)
    lo, hi = np.quantile(reps, [0.025, 0.975])
    return float(lo), float(hi)


def calibrate_layer(data: LayerSample, n_seq: int, ks: Sequence[int], cfg: AnalysisConfig,
                    classes: Sequence[str], n_anchors: int, controls: Sequence[str]) -> list[dict[str, object]]:
    """The rows of one layer at one size (the first n_seq windows): per class, k (local classes; 0 for
    the global ones) and target (real, each control), the medians with their intervals over documents."""
    take = data.seq < n_seq
    x, y, seq, doc = data.x[take], data.y[take], data.seq[take], data.doc[take]
    targets: dict[str, np.ndarray] = {"real": y}
    if "self_first" in controls and data.y_ctl is not None:
        targets["self_first"] = data.y_ctl[take]
    rng = np.random.default_rng([cfg.seed, n_seq, 0xCA1])
    anchors = np.sort(rng.choice(len(x), size=min(n_anchors, len(x)), replace=False))
    groups = doc if cfg.exclusion == "document" else seq
    found = knn(x, groups, max(ks), cfg.metric, cfg.exclusion, cfg.index, cfg.seed, cfg.device, cfg.ann_threshold)
    # anchor rows first, so the batched fit (anchor i is row i) scores exactly the anchors
    order = np.concatenate([anchors, np.setdiff1d(np.arange(len(x)), anchors)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    xo = x[order]
    _, unit = np.unique(doc[anchors], return_inverse=True)
    counts = sequence_counts(np.unique(doc[anchors]), cfg.bootstrap, cfg.seed)[:, unit]
    params = FitParams(rank=cfg.rank, ridge=cfg.ridge, orthogonal_scale=cfg.orthogonal_scale)
    finding = BY_ID["1"]
    rows: list[dict[str, object]] = []

    def score(fn_class: str, k: int, target: str, tx: np.ndarray) -> None:
        rel, cos = _row_stats(x[anchors], targets[target][anchors], tx)
        rel_lo, rel_hi = _interval(rel, counts)
        cos_lo, cos_hi = _interval(cos, counts)
        rows.append({"n_tokens": int(len(x)), "n_seq": int(n_seq), "k": int(k), "fn_class": fn_class,
                     "target": target, "n_anchors": int(len(anchors)), "n_docs": int(len(np.unique(doc))),
                     "rel_err_median": float(np.median(rel)), "rel_err_lo": rel_lo, "rel_err_hi": rel_hi,
                     "cos_full_tok_median": float(np.median(cos)), "cos_lo": cos_lo, "cos_hi": cos_hi,
                     "finding_1": threshold_outcome(finding.op, finding.bound, cos_lo, cos_hi)})

    for fn_class in classes:
        wanted = [t for t in targets if fn_class not in CONTROL_ONLY or t == POWER_TARGET]
        if fn_class not in LOCAL_FITTERS:  # one map per layer, fitted in folds of documents, no neighbours
            for target in wanted:
                fit = fit_layer(fn_class, x, targets[target], doc, None, cfg)
                score(fn_class, 0, target, fit.tx[anchors])
            continue
        for k in ks:
            nb = inverse[found[anchors, :k]]
            for target in wanted:
                local = fit_local_batched(fn_class, xo, targets[target][order], nb, params, torch_dtype(cfg.fit_dtype),
                                          cfg.anchor_chunk, cfg.device)
                score(fn_class, k, target, local.tx.cpu().numpy())
    return rows


COLUMNS: dict[str, pa.DataType] = {  # as updatelens.schemas declares them; k is the provenance's (each row's own)
    "n_tokens": pa.int32(), "n_seq": pa.int32(), "fn_class": pa.string(), "target": pa.string(),
    "n_anchors": pa.int32(), "n_docs": pa.int32(), "rel_err_median": pa.float64(), "rel_err_lo": pa.float64(),
    "rel_err_hi": pa.float64(), "cos_full_tok_median": pa.float64(), "cos_lo": pa.float64(), "cos_hi": pa.float64(),
    "finding_1": pa.string(),
}


def calibration_table(rows: list[dict[str, object]], prov: Provenance, layer: int) -> pa.Table:
    """One layer's rows with the provenance columns, `k` each row's own."""
    columns: dict[str, pa.Array] = {name: pa.array([r[name] for r in rows], typ) for name, typ in COLUMNS.items()}
    table = with_provenance(columns, prov, layer)
    return table.set_column(table.schema.get_field_index("k"), "k", pa.array([r["k"] for r in rows], pa.int32()))


def calibrate(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig, prov: Provenance, layers: Sequence[int],
              sizes: Sequence[int], ks: Sequence[int], classes: Sequence[str] = DEFAULT_CLASSES,
              n_anchors: int = DEFAULT_ANCHORS,
              controls: Sequence[str] = ("self_first",),
              log: Callable[[str], None] = print) -> dict[int, pa.Table]:
    """Every layer's calibration table over the sizes (numbers of windows, nested) and neighbour counts."""
    with torch.inference_mode():
        captured = capture_layers(lm, sample, layers, cfg)
    out = {}
    for layer in layers:
        rows = []
        for n_seq in sorted(sizes):
            rows += calibrate_layer(captured[layer], n_seq, ks, cfg, classes, n_anchors, controls)
            log(f"calibrate: {lm.slug} layer {layer}, {n_seq} windows: done")
        out[layer] = calibration_table(rows, prov, layer)
    return out
