"""Stage 2, local fits: T(x) at every kept token, fitted on its k nearest neighbours."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens.config import LOCAL_CLASSES, AnalysisConfig
from updatelens.fits import LayerFit, fit_layer
from updatelens.neighbours import knn
from updatelens.steps.layer import LayerData, Transition
from updatelens.tables import Provenance, to_matrix, vector_column, with_provenance


def layer_neighbours(data: LayerData | Transition, cfg: AnalysisConfig) -> np.ndarray | None:
    """The k nearest tokens of every kept token, when a local class needs them."""
    if not any(c in LOCAL_CLASSES for c in cfg.classes):
        return None
    # document exclusion: the sequence exclusion's mechanism over documents (every token of the
    # anchor's group is dropped), so a fit never borrows the anchor's article
    groups = data.doc if cfg.exclusion == "document" else data.seq
    return knn(data.x, groups, cfg.k, cfg.metric, cfg.exclusion, cfg.index, cfg.seed, cfg.device, cfg.ann_threshold)


def compute_fits(data: LayerData | Transition, cfg: AnalysisConfig) -> tuple[dict[str, LayerFit], np.ndarray | None]:
    x, y, seq = data.x, data.y, data.seq
    neighbours = layer_neighbours(data, cfg)
    fits = {c: fit_layer(c, x, y, seq, neighbours, cfg) for c in cfg.classes}
    return fits, neighbours


def stream_fits(data: LayerData | Transition, neighbours: np.ndarray | None, cfg: AnalysisConfig, prov: Provenance,
                layer: int, write: Callable[[pa.Table], None], label: str = "") -> int:
    """Every class's fits of a layer, written part by part (`write`) with one class's T(x) in memory at a
    time; returns how many fits are degenerate."""
    degenerate = 0
    for fn_class in cfg.classes:
        fit = fit_layer(fn_class, data.x, data.y, data.seq, neighbours, cfg, label=label)
        for part in fit_row_parts(data, fit, neighbours, prov, layer):
            write(part)
        degenerate += int(np.sum(fit.degenerate))
        del fit
    return degenerate


def fit_row_parts(data: LayerData | Transition, fit: LayerFit, neighbours: np.ndarray | None, prov: Provenance,
                  layer: int, rows: int = 8192) -> Iterator[pa.Table]:
    """One class's rows of `local_fits`, `rows` kept tokens at a time (float32 T(x) made per part).
    `neighbours` holds the k neighbours' row numbers among the layer's kept tokens in (seq, pos)
    order; null for the per-layer classes."""
    seq, pos = data.seq, data.pos
    n = len(seq)
    width = neighbours.shape[1] if neighbours is not None else 1
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        if neighbours is not None and fit.fn_class in LOCAL_CLASSES:
            nb = pa.FixedSizeListArray.from_arrays(pa.array(neighbours[lo:hi].reshape(-1).astype(np.int32)), width)
        else:
            nb = pa.nulls(hi - lo, pa.list_(pa.int32(), width))
        yield with_provenance({
            "fn_class": pa.array([fit.fn_class] * (hi - lo)),
            "seq": pa.array(seq[lo:hi]),
            "pos": pa.array(pos[lo:hi]),
            "tx": vector_column(fit.tx[lo:hi]),
            "fit_cond": pa.array(fit.cond[lo:hi], pa.float64()),
            "degenerate": pa.array(fit.degenerate[lo:hi]),
            "neighbours": nb,
        }, prov, layer)


def fits_table(data: LayerData, fits: dict[str, LayerFit], neighbours: np.ndarray | None,
               prov: Provenance) -> pa.Table:
    """Rows per (class, kept token), in memory (notebooks, tests)."""
    return pa.concat_tables([part for fit in fits.values()
                             for part in fit_row_parts(data, fit, neighbours, prov, data.layer)])


def fits_from_table(table: pa.Table, data: LayerData) -> dict[str, LayerFit]:
    """Read local_fits back, aligned with data's kept-token order."""
    out: dict[str, LayerFit] = {}
    n_seq, seq_len = data.kept.shape
    order_key = data.seq.astype(np.int64) * seq_len + data.pos
    for fn_class in dict.fromkeys(table["fn_class"].to_pylist()):
        part = table.filter(pc.equal(table["fn_class"], fn_class))
        key = part["seq"].to_numpy().astype(np.int64) * seq_len + part["pos"].to_numpy()
        idx = np.argsort(key)
        if not np.array_equal(key[idx], order_key):
            raise ValueError(f"local_fits for {fn_class!r} do not cover the kept tokens of layer {data.layer}")
        out[fn_class] = LayerFit(
            fn_class=fn_class,
            tx=to_matrix(part["tx"], np.float64)[idx],
            cond=part["fit_cond"].to_numpy()[idx],
            degenerate=part["degenerate"].to_numpy(zero_copy_only=False)[idx],
        )
    return out
