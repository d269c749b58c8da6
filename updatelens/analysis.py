"""The five stages as plain functions from arrays to Arrow tables, one layer at a time.

    activations -> local_fits -> residuals -> geometry -> functional_metrics

The Dagster assets call these; so can a notebook (see `analyse_model`). Nothing here imports
Dagster or knows where tables are stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens import CODE_VERSION
from updatelens.capture import Captured, capture, kept_mask
from updatelens.config import LOCAL_CLASSES, AnalysisConfig
from updatelens.corpus import Sample
from updatelens.fits import LayerFit, fit_layer
from updatelens.geometry import (
    decompose,
    dominant_subspace,
    projection_metrics,
    spectrum,
    token_metrics,
)
from updatelens.models import LoadedModel
from updatelens.neighbours import knn
from updatelens.perturbation import (
    OriginalOutput,
    Variant,
    original_output,
    patched_kl,
    random_control,
    single_position_kl,
    spearman,
)
from updatelens.tables import Provenance, to_matrix, vector_column, with_provenance


def provenance(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig) -> Provenance:
    return Provenance(
        model=lm.slug,
        model_revision=lm.revision,
        corpus=sample.corpus,
        corpus_slice=sample.slice_desc,
        config_id=cfg.config_id,
        k=cfg.k,
        rank=cfg.rank,
        dtype=cfg.fit_dtype,
        code_version=CODE_VERSION,
        config_json=cfg.to_json(),
    )


# ---- stage 1: activations -----------------------------------------------------------------------
def activations_table(cap: Captured, layer: int, cfg: AnalysisConfig, prov: Provenance) -> pa.Table:
    """Transition l: x = h_l, y = h_{l+1}, every position (kept flags the ones in statistics)."""
    n_seq, seq_len = cap.input_ids.shape
    kept = kept_mask(cap.attention_mask, cfg.skip_first_position)
    d = cap.states.shape[-1]
    cols = {
        "seq": pa.array(np.repeat(np.arange(n_seq), seq_len), pa.int32()),
        "pos": pa.array(np.tile(np.arange(seq_len), n_seq), pa.int32()),
        "token_id": pa.array(cap.input_ids.reshape(-1), pa.int64()),
        "attention_mask": pa.array(cap.attention_mask.reshape(-1), pa.int8()),
        "kept": pa.array(kept.reshape(-1)),
        "x": vector_column(cap.states[layer].reshape(-1, d)),
        "y": vector_column(cap.states[layer + 1].reshape(-1, d)),
    }
    return with_provenance(cols, prov, layer)


@dataclass
class LayerData:
    """One transition read back from the activations table, in (seq, pos) order."""

    layer: int
    input_ids: np.ndarray  # [n_seq, T]
    kept: np.ndarray  # [n_seq, T] bool
    x_full: np.ndarray  # [n_seq, T, d]
    y_full: np.ndarray  # [n_seq, T, d]

    @property
    def x(self) -> np.ndarray:
        return self.x_full[self.kept]

    @property
    def y(self) -> np.ndarray:
        return self.y_full[self.kept]

    @property
    def seq(self) -> np.ndarray:
        return np.nonzero(self.kept)[0].astype(np.int32)

    @property
    def pos(self) -> np.ndarray:
        return np.nonzero(self.kept)[1].astype(np.int32)


def layer_data(table: pa.Table) -> LayerData:
    table = table.sort_by([("seq", "ascending"), ("pos", "ascending")])
    seq = table["seq"].to_numpy()
    n_seq, seq_len = int(seq.max()) + 1, int(table["pos"].to_numpy().max()) + 1
    if len(table) != n_seq * seq_len:
        raise ValueError(f"activations table has {len(table)} rows, expected {n_seq} x {seq_len}")
    x = to_matrix(table["x"])
    y = to_matrix(table["y"])
    d = x.shape[1]
    return LayerData(
        layer=int(table["layer"][0].as_py()),
        input_ids=table["token_id"].to_numpy().reshape(n_seq, seq_len).copy(),
        kept=table["kept"].to_numpy(zero_copy_only=False).reshape(n_seq, seq_len),
        x_full=x.reshape(n_seq, seq_len, d),
        y_full=y.reshape(n_seq, seq_len, d),
    )


# ---- stage 2: local fits ------------------------------------------------------------------------
def compute_fits(data: LayerData, cfg: AnalysisConfig) -> tuple[dict[str, LayerFit], np.ndarray | None]:
    x, y, seq = data.x, data.y, data.seq
    neighbours = None
    if any(c in LOCAL_CLASSES for c in cfg.classes):
        neighbours = knn(x, seq, cfg.k, cfg.metric, cfg.exclusion, cfg.index, cfg.seed, cfg.device)
    fits = {c: fit_layer(c, x, y, seq, neighbours, cfg) for c in cfg.classes}
    return fits, neighbours


def fits_table(data: LayerData, fits: dict[str, LayerFit], neighbours: np.ndarray | None,
               prov: Provenance) -> pa.Table:
    """Rows per (class, kept token). `neighbours` holds the k neighbours' row numbers among the
    layer's kept tokens in (seq, pos) order; null for the per-layer classes."""
    n = int(data.kept.sum())
    width = neighbours.shape[1] if neighbours is not None else 1
    local_nb = (pa.FixedSizeListArray.from_arrays(pa.array(neighbours.reshape(-1).astype(np.int32)), width)
                if neighbours is not None else None)
    parts = []
    for fn_class, fit in fits.items():
        nb = local_nb if local_nb is not None and fn_class in LOCAL_CLASSES else pa.nulls(n, pa.list_(pa.int32(), width))
        cols = {
            "fn_class": pa.array([fn_class] * n),
            "seq": pa.array(data.seq),
            "pos": pa.array(data.pos),
            "tx": vector_column(fit.tx),
            "fit_cond": pa.array(fit.cond, pa.float64()),
            "degenerate": pa.array(fit.degenerate),
            "neighbours": nb,
        }
        parts.append(with_provenance(cols, prov, data.layer))
    return pa.concat_tables(parts)


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


# ---- stage 3: residuals -------------------------------------------------------------------------
def residuals_table(data: LayerData, fits: dict[str, LayerFit], prov: Provenance) -> pa.Table:
    parts = []
    for fn_class, fit in fits.items():
        dec = decompose(data.x, data.y, fit.tx)
        m = token_metrics(data.x, data.y, fit.tx, dec)
        cols = {
            "fn_class": pa.array([fn_class] * len(fit.tx)),
            "seq": pa.array(data.seq),
            "pos": pa.array(data.pos),
            "residual": vector_column(dec.residual),
            "norm_full": pa.array(m["norm_full"]),
            "norm_tok": pa.array(m["norm_tok"]),
            "norm_res": pa.array(m["norm_res"]),
            "rel_err": pa.array(m["rel_err"]),
        }
        parts.append(with_provenance(cols, prov, data.layer))
    return pa.concat_tables(parts)


# ---- stage 4: geometry --------------------------------------------------------------------------
def geometry_tables(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig,
                    prov: Provenance) -> tuple[pa.Table, pa.Table]:
    """Per-token geometry, and the per-layer singular spectra of Δ_full, Δ_tok and r."""
    token_parts, spec_parts = [], []
    for fn_class, fit in fits.items():
        dec = decompose(data.x, data.y, fit.tx)
        metrics = token_metrics(data.x, data.y, fit.tx, dec)
        sub = dominant_subspace(dec.delta_tok, cfg.energy_threshold)
        metrics.update(projection_metrics(dec, sub, cfg.subspace_ms))
        n = len(fit.tx)
        cols: dict[str, pa.Array] = {
            "fn_class": pa.array([fn_class] * n),
            "seq": pa.array(data.seq),
            "pos": pa.array(data.pos),
        }
        for key, values in metrics.items():
            if key.startswith("norm_"):
                continue  # in residuals
            cols[key] = pa.array(values, pa.float64())
        cols["m90_tok"] = pa.array([sub.m_energy] * n, pa.int32())
        token_parts.append(with_provenance(cols, prov, data.layer))
        for which, v in (("full", dec.delta_full), ("tok", dec.delta_tok), ("res", dec.residual)):
            sp = spectrum(v, cfg.energy_threshold)
            k = len(sp.singular_values)
            spec_parts.append(with_provenance({
                "fn_class": pa.array([fn_class] * k),
                "which": pa.array([which] * k),
                "idx": pa.array(np.arange(k), pa.int32()),
                "sigma": pa.array(sp.singular_values),
                "cum_energy": pa.array(sp.cum_energy),
                "effective_rank": pa.array([sp.effective_rank] * k),
                "m_energy": pa.array([sp.m_energy] * k, pa.int32()),
            }, prov, data.layer))
    return pa.concat_tables(token_parts), pa.concat_tables(spec_parts)


# ---- stage 5: functional metrics ----------------------------------------------------------------
def build_variants(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig) -> list[Variant]:
    """The main patch per class (y -> T(x) at kept positions) and the configured controls."""

    def scatter(values: np.ndarray) -> np.ndarray:
        state = data.y_full.astype(np.float64).copy()
        state[data.kept] = values
        return state

    variants = [Variant("patch", c, scatter(fit.tx)) for c, fit in fits.items()]
    primary = fits[cfg.primary_class]
    if "random" in cfg.controls:
        rng = np.random.default_rng([cfg.seed, data.layer])
        norm_res = np.linalg.norm(data.y - primary.tx, axis=1)
        variants.append(Variant("random", cfg.primary_class,
                                scatter(random_control(data.y.astype(np.float64), norm_res, rng))))
    if "crude" in cfg.controls and cfg.crude_class != cfg.primary_class:
        crude = fits[cfg.crude_class]
        variants.append(Variant("crude", cfg.primary_class, scatter(data.y + (crude.tx - primary.tx))))
    if "identity" in cfg.controls:
        variants.append(Variant("identity", cfg.primary_class, data.y_full.astype(np.float64)))
    return variants


def single_positions(data: LayerData, per_seq: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 7919])
    out = []
    for s in range(data.kept.shape[0]):
        candidates = np.flatnonzero(data.kept[s])
        chosen = rng.choice(candidates, size=min(per_seq, len(candidates)), replace=False)
        out.extend((s, int(p)) for p in np.sort(chosen))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def functional_tables(lm: LoadedModel, data: LayerData, fits: dict[str, LayerFit], orig: OriginalOutput,
                      cfg: AnalysisConfig, prov: Provenance, returns_tuple: bool = False) -> tuple[pa.Table, pa.Table]:
    variants = build_variants(data, fits, cfg)
    if cfg.patch_mode == "all":
        kls = patched_kl(lm, data.input_ids, data.layer, variants, orig, cfg.patch_batch, returns_tuple)
        measured = data.kept
    else:
        positions = single_positions(data, cfg.single_positions, cfg.seed)
        kls = single_position_kl(lm, data.input_ids, data.layer, variants, data.y_full, positions,
                                 orig, cfg.patch_batch, returns_tuple)
        measured = np.zeros_like(data.kept)
        measured[positions[:, 0], positions[:, 1]] = True
    seq_idx, pos_idx = np.nonzero(measured)
    key_all = data.seq.astype(np.int64) * data.kept.shape[1] + data.pos
    key_measured = seq_idx.astype(np.int64) * data.kept.shape[1] + pos_idx
    rows_in_kept = np.searchsorted(key_all, key_measured)
    token_parts, summary_parts = [], []
    for variant, kl_grid in zip(variants, kls):
        fit = fits[variant.fn_class]
        err = token_metrics(data.x[rows_in_kept], data.y[rows_in_kept], fit.tx[rows_in_kept])
        kl = kl_grid[seq_idx, pos_idx]
        n = len(kl)
        token_parts.append(with_provenance({
            "fn_class": pa.array([variant.fn_class] * n),
            "variant": pa.array([variant.name] * n),
            "patch_mode": pa.array([cfg.patch_mode] * n),
            "seq": pa.array(seq_idx.astype(np.int32)),
            "pos": pa.array(pos_idx.astype(np.int32)),
            "kl": pa.array(kl),
            "rel_err": pa.array(err["rel_err"]),
            "norm_res": pa.array(err["norm_res"]),
        }, prov, data.layer))
        s_rel = spearman(err["rel_err"], kl)
        s_abs = spearman(err["norm_res"], kl)
        summary_parts.append(with_provenance({
            "fn_class": pa.array([variant.fn_class]),
            "variant": pa.array([variant.name]),
            "patch_mode": pa.array([cfg.patch_mode]),
            "n_tokens": pa.array([n], pa.int32()),
            "kl_mean": pa.array([float(np.mean(kl)) if n else float("nan")]),
            "kl_median": pa.array([float(np.median(kl)) if n else float("nan")]),
            "kl_max": pa.array([float(np.max(kl)) if n else float("nan")]),
            "spearman_relerr_kl": pa.array([s_rel.rho]),
            "spearman_relerr_kl_p": pa.array([s_rel.p_value]),
            "spearman_normres_kl": pa.array([s_abs.rho]),
            "spearman_normres_kl_p": pa.array([s_abs.p_value]),
        }, prov, data.layer))
    return pa.concat_tables(token_parts), pa.concat_tables(summary_parts)


# ---- notebook entry point -----------------------------------------------------------------------
@dataclass
class LayerResult:
    layer: int
    tables: dict[str, pa.Table]


def analyse_model(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig,
                  layers: list[int] | None = None) -> Iterator[LayerResult]:
    """All five stages for each layer, in memory, one layer at a time (for notebooks and tests)."""
    cfg.validate(d_model=lm.d_model, max_positions=lm.max_positions)
    prov = provenance(lm, sample, cfg)
    cap = capture(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch)
    orig = original_output(lm, sample.input_ids, cfg.patch_batch)
    for layer in layers if layers is not None else range(lm.n_layers):
        act = activations_table(cap, layer, cfg, prov)
        data = layer_data(act)
        fits, neighbours = compute_fits(data, cfg)
        geo, spec = geometry_tables(data, fits, cfg, prov)
        fm, fs = functional_tables(lm, data, fits, orig, cfg, prov, cap.block_returns_tuple)
        yield LayerResult(layer, {
            "activations": act,
            "local_fits": fits_table(data, fits, neighbours, prov),
            "residuals": residuals_table(data, fits, prov),
            "geometry": geo,
            "spectra": spec,
            "functional_metrics": fm,
            "functional_summary": fs,
        })
