"""Stage 4, geometry: per-token geometry, the per-layer spectra and the findings' statistics on
every resample, in two passes over blocks of whole sequences."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from updatelens.bootstrap import (
    ResampledGrams,
    effective_ranks_of,
    geometry_replicates,
    jackknife_counts,
)
from updatelens.config import AnalysisConfig
from updatelens.findings import JACKKNIFE_FIRST, RANK_DEFS, TOKEN_STATISTICS
from updatelens.fits import LayerFit
from updatelens.geometry import (
    CONTEXT_COLUMNS,
    Subspace,
    context_alignment,
    decompose,
    null_metrics,
    null_residual,
    projection_metrics,
    shaped_directions,
    spectrum_from_gram,
    subspace_from_gram,
    token_metrics,
    unrelated_alignment,
    update_shape,
)
from updatelens.steps.layer import LayerData, random_directions, resample_counts, resample_units, sample_docs
from updatelens.tables import Provenance, with_provenance

WHICH = ("full", "tok", "res")
# the spectra of the null (docs/method.md, "Nulls"): Δ_full and r when each residual keeps its length
# but points in a random direction drawn in the shape of the layer's updates (`shaped_directions`)
NULL_WHICH = ("full_null", "res_null")
NULL_M = 16  # the tokenwise subspace of finding "2 projection"


class LayerGeometry:
    """The geometry of one layer in two passes over blocks of whole sequences (or one block: the whole
    layer), so memory holds a block plus d x d matrices whatever the number of tokens:
    `accumulate` every block (Gram matrices of Δ_full, Δ_tok and r per class, and per bootstrap
    resample for the spectra), `finish` (the dominant tokenwise subspaces, and the shape of the
    layer's updates that the null's residuals are drawn in), then `token_table` every block
    (per-token geometry against the subspace, the null's per-token measures and its Gram matrices);
    `spectra_table` and `bootstrap_table` once at the end."""

    def __init__(self, cfg: AnalysisConfig, classes: list[str], d: int, docs: np.ndarray,
                 null_spectra: bool = True, partners: np.ndarray | None = None) -> None:
        """`null_spectra`: also the spectra of the null's Δ_full and r (finding 3's null); a positive
        control, whose null no verdict reads, leaves them out (their ranks are NaN). `partners` (the
        exact split, one block): finding 1's null columns pair each token with another document's
        tokenwise update (`unrelated_alignment`) instead of the random-direction residual."""
        self.cfg = cfg
        self.partners = partners
        self.counts = resample_counts(cfg, docs)
        self.jackknife = jackknife_counts(resample_units(cfg, docs), cfg.jackknife_groups, cfg.seed)
        self.which = WHICH + NULL_WHICH if null_spectra else WHICH
        self.grams = {(c, w): np.zeros((d, d)) for c in classes for w in self.which}
        self.sums = {(c, w): np.zeros(d) for c in classes for w in self.which}  # for the centred spectra
        self.replicate_grams = {(c, w): ResampledGrams(self.jackknife, d) for c in classes for w in self.which}
        self.n_rows = 0
        self.subspaces: dict[str, Subspace] = {}
        self.shape: np.ndarray | None = None  # [d, d]: Σ_Δfull = shape @ shape.T
        self.scalars: dict[str, list[dict[str, np.ndarray]]] = {c: [] for c in classes}

    def accumulate(self, data: LayerData, fits: dict[str, LayerFit]) -> None:
        seq = data.seq
        self.n_rows += len(seq)
        for fn_class, fit in fits.items():
            dec = decompose(data.x, data.y, fit.tx)
            for which, v in zip(WHICH, (dec.delta_full, dec.delta_tok, dec.residual)):
                self._add(fn_class, which, v, seq)

    def _add(self, fn_class: str, which: str, v: np.ndarray, seq: np.ndarray) -> None:
        self.grams[(fn_class, which)] += v.T @ v
        self.sums[(fn_class, which)] += v.sum(axis=0)
        self.replicate_grams[(fn_class, which)].add(v, seq)

    def finish(self) -> None:
        self.subspaces = {c: subspace_from_gram(g, self.n_rows, self.cfg.energy_threshold)
                          for (c, w), g in self.grams.items() if w == "tok"}
        first = next(c for c, w in self.grams if w == "full")  # Δ_full is the same for every class
        self.shape = update_shape(self.grams[(first, "full")], self.n_rows)

    def token_table(self, data: LayerData, fits: dict[str, LayerFit], prov: Provenance) -> pa.Table:
        if self.shape is None:
            raise RuntimeError("token_table before finish: the null's shape is the whole layer's")
        parts = []
        directions = shaped_directions(random_directions(data, self.cfg.seed), self.shape)
        for fn_class, fit in fits.items():
            sub = self.subspaces[fn_class]
            dec = decompose(data.x, data.y, fit.tx)
            null = null_residual(dec, directions)
            if "res_null" in self.which:
                for which, v in (("full_null", null.delta_full), ("res_null", null.residual)):
                    self._add(fn_class, which, v, data.seq)
            metrics = token_metrics(data.x, data.y, fit.tx, dec)
            metrics.update(projection_metrics(dec, sub, self.cfg.subspace_ms))
            metrics.update(null_metrics(dec, null, data.x, sub, NULL_M))
            if self.partners is not None:
                if len(self.partners) != len(fit.tx):
                    raise ValueError("paired nulls need the whole layer in one block")
                metrics.update(unrelated_alignment(dec, data.x, self.partners))
            if data.y_ctl_full is not None:
                metrics.update(context_alignment(dec, data.x, data.y_ctl_full[data.kept]))
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
            for key in CONTEXT_COLUMNS:  # null where no self-and-first output was captured
                cols.setdefault(key, pa.nulls(n, pa.float64()))
            cols["m90_tok"] = pa.array([sub.m_energy] * n, pa.int32())
            parts.append(with_provenance(cols, prov, data.layer))
            self.scalars[fn_class].append({"seq": data.seq, **{k: metrics[k] for k in TOKEN_STATISTICS if k in metrics}})
        return pa.concat_tables(parts)

    def spectra_table(self, prov: Provenance, layer: int) -> pa.Table:
        parts = []
        for (fn_class, which), gram in self.grams.items():
            sp = spectrum_from_gram(gram, self.n_rows, self.cfg.energy_threshold)
            total = self.sums[(fn_class, which)]
            centred = spectrum_from_gram(gram - np.outer(total, total) / max(self.n_rows, 1), self.n_rows,
                                         self.cfg.energy_threshold)
            k = len(sp.singular_values)
            parts.append(with_provenance({
                "fn_class": pa.array([fn_class] * k),
                "which": pa.array([which] * k),
                "idx": pa.array(np.arange(k), pa.int32()),
                "sigma": pa.array(sp.singular_values),
                "cum_energy": pa.array(sp.cum_energy),
                "effective_rank": pa.array([sp.effective_rank] * k),
                "effective_rank_centred": pa.array([centred.effective_rank] * k),
                "m_energy": pa.array([sp.m_energy] * k, pa.int32()),
            }, prov, layer))
        return pa.concat_tables(parts)

    def bootstrap_table(self, prov: Provenance, layer: int) -> pa.Table:
        """The findings' per-layer statistics on every bootstrap resample (replicates 0 .. bootstrap-1;
        their effective ranks null), then the effective ranks on every jackknife replicate
        (replicates -2, -3, ...: `JACKKNIFE_FIRST`; their other statistics null): `geometry_bootstrap`."""
        parts = []
        b, g = self.cfg.bootstrap, len(self.jackknife)
        keys = [(c, w) for c in self.scalars for w in self.which]
        spectra_ranks = {(*key, centred): ranks for centred in (False, True) for key, ranks in zip(
            keys, effective_ranks_of([self.replicate_grams[key] for key in keys], centred=centred))}
        for fn_class, blocks in self.scalars.items():
            merged = {k: np.concatenate([blk[k] for blk in blocks]) for k in blocks[0]}
            resampled = geometry_replicates(merged["seq"], merged, self.counts)
            cols: dict[str, pa.Array] = {
                "fn_class": pa.array([fn_class] * (b + g)),
                "replicate": pa.array(np.concatenate([np.arange(b), JACKKNIFE_FIRST - np.arange(g)]), pa.int32())}
            cols.update({k: pa.array(np.concatenate([v, np.full(g, np.nan)]), pa.float64(), from_pandas=True)
                         for k, v in resampled.items()})
            for name, which, centred in RANK_DEFS:
                ranks = np.full(b + g, np.nan)
                if which in self.which:
                    ranks[b:] = spectra_ranks[(fn_class, which, centred)]
                cols[name] = pa.array(ranks, pa.float64(), from_pandas=True)
            parts.append(with_provenance(cols, prov, layer))
        return pa.concat_tables(parts)


def geometry_tables(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig,
                    prov: Provenance, null_spectra: bool = True,
                    partners: np.ndarray | None = None) -> tuple[pa.Table, pa.Table, pa.Table]:
    """Per-token geometry, the per-layer singular spectra of Δ_full, Δ_tok and r, and the per-layer
    statistics of the findings on every bootstrap resample of the sequences: a whole layer in memory.
    `partners`: see LayerGeometry."""
    geo = LayerGeometry(cfg, list(fits), data.x_full.shape[-1], sample_docs(data), null_spectra, partners)
    geo.accumulate(data, fits)
    geo.finish()
    tokens = geo.token_table(data, fits, prov)
    return tokens, geo.spectra_table(prov, data.layer), geo.bootstrap_table(prov, data.layer)


# sequences lo..hi-1 of a layer: the transition's arrays and the fitted T(x) per class
BlockReader = Callable[[int, int], tuple[LayerData, dict[str, LayerFit]]]


def stream_geometry(read: BlockReader, blocks: Sequence[tuple[int, int]], cfg: AnalysisConfig, docs: np.ndarray,
                    prov: Provenance, write: Callable[[pa.Table], None]) -> tuple[pa.Table, pa.Table]:
    """A layer's geometry over blocks of whole sequences, each read twice: the first pass accumulates the
    Gram matrices, the second writes the per-token rows block by block (`write`). Returns the spectra and
    the resamples (tables); the Gram matrices go with the call, before the caller makes the next layer's."""
    geo: LayerGeometry | None = None
    for lo, hi in blocks:
        data, fits = read(lo, hi)
        geo = geo or LayerGeometry(cfg, list(fits), data.x_full.shape[-1], docs)
        geo.accumulate(data, fits)
    if geo is None:
        raise ValueError("no blocks of sequences to measure the geometry on")
    geo.finish()
    for lo, hi in blocks:
        data, fits = read(lo, hi)
        write(geo.token_table(data, fits, prov))
    return geo.spectra_table(prov, data.layer), geo.bootstrap_table(prov, data.layer)
