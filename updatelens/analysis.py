"""The five stages as plain functions from arrays to Arrow tables, one layer at a time.

    activations -> local_fits -> residuals -> geometry -> functional_metrics

The Dagster assets call these; so can a notebook (see `analyse_model`). Nothing here imports
Dagster or knows where tables are stored.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens.bootstrap import (
    ResampledGrams,
    effective_ranks_of,
    geometry_replicates,
    jackknife_counts,
    median_ratio,
    paired_ratio,
    row_weights,
    sequence_counts,
    weighted_spearman,
)
from updatelens.capture import Captured, capture, kept_mask, self_only_layers
from updatelens.config import LOCAL_CLASSES, AnalysisConfig
from updatelens.corpus import Sample
from updatelens.findings import JACKKNIFE_FIRST, TOKEN_STATISTICS
from updatelens.fits import LayerFit, fit_layer
from updatelens.geometry import (
    Subspace,
    decompose,
    null_metrics,
    null_residual,
    projection_metrics,
    spectrum_from_gram,
    subspace_from_gram,
    token_metrics,
)
from updatelens.models import LoadedModel
from updatelens.neighbours import knn
from updatelens.perturbation import (
    OriginalOutput,
    Variant,
    later_position_kl,
    original_output,
    patched_kl,
    single_position_kl,
    spearman,
)
from updatelens.single_position import all_single_position_kl, resolve_patch_mode
from updatelens.stages import TABLES
from updatelens.tables import Provenance, to_matrix, vector_column, with_provenance


def provenance(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig) -> Provenance:
    return Provenance.of(lm.slug, lm.revision, sample.corpus, sample.slice_desc, cfg, lm.n_layers, lm.weights)


# ---- stage 1: activations -----------------------------------------------------------------------
def activation_rows(states: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray, layer: int,
                    cfg: AnalysisConfig, prov: Provenance, docs: np.ndarray, seq_offset: int = 0,
                    self_only: np.ndarray | None = None) -> pa.Table:
    """Transition l for a batch of sequences: x = h_l, y = h_{l+1}, every position (kept flags the
    ones in statistics). `states` [L+1, b, T, d]; the rows are sequences seq_offset.. of the sample,
    `docs` [b] the document each was cut from; `self_only` [b, T, d]: block l with each token
    attending to itself alone (null where not made: an architecture without attention, or not asked)."""
    n_seq, seq_len = input_ids.shape
    kept = kept_mask(attention_mask, cfg.skip_first_position)
    d = states.shape[-1]
    cols = {
        "seq": pa.array(np.repeat(np.arange(seq_offset, seq_offset + n_seq), seq_len), pa.int32()),
        "doc": pa.array(np.repeat(np.asarray(docs), seq_len), pa.int32()),
        "pos": pa.array(np.tile(np.arange(seq_len), n_seq), pa.int32()),
        "token_id": pa.array(input_ids.reshape(-1), pa.int64()),
        "attention_mask": pa.array(attention_mask.reshape(-1), pa.int8()),
        "kept": pa.array(kept.reshape(-1)),
        "x": vector_column(states[layer].reshape(-1, d)),
        "y": vector_column(states[layer + 1].reshape(-1, d)),
        "y_self": (vector_column(self_only.reshape(-1, d)) if self_only is not None
                   else pa.nulls(n_seq * seq_len, pa.list_(pa.float32(), d))),
    }
    return with_provenance(cols, prov, layer)


CONTEXT_TOKENS = 8  # the left context of a token in the tokens table: it and the 7 before it


def token_rows(tokenizer: object, input_ids: np.ndarray, layer: int, prov: Provenance, seq_offset: int = 0,
               context: int = CONTEXT_TOKENS) -> pa.Table:
    """Which text each (seq, pos) of a batch is: the token decoded alone and a short left context
    ending with it (the `context` tokens up to and including it), so SQL answers with words."""
    n_seq, seq_len = input_ids.shape
    ids = input_ids.tolist()
    windows = [row[max(0, p - context + 1) : p + 1] for row in ids for p in range(seq_len)]
    decode = tokenizer.batch_decode  # type: ignore[attr-defined]
    cols = {
        "seq": pa.array(np.repeat(np.arange(seq_offset, seq_offset + n_seq), seq_len), pa.int32()),
        "pos": pa.array(np.tile(np.arange(seq_len), n_seq), pa.int32()),
        "token_id": pa.array(input_ids.reshape(-1), pa.int64()),
        "token": pa.array(decode([[t] for t in input_ids.reshape(-1).tolist()]), pa.string()),
        "context": pa.array(decode(windows), pa.string()),
    }
    return with_provenance(cols, prov, layer)


def activations_table(cap: Captured, layer: int, cfg: AnalysisConfig, prov: Provenance, docs: np.ndarray) -> pa.Table:
    """Transition l of a whole in-memory capture (notebooks, sweeps); `docs`: the sample's doc_index."""
    return activation_rows(cap.states, cap.input_ids, cap.attention_mask, layer, cfg, prov, docs,
                           self_only=cap.self_only.get(layer))


@dataclass
class LayerData:
    """One transition read back from the activations table, in (seq, pos) order."""

    layer: int
    input_ids: np.ndarray  # [n_seq, T]
    kept: np.ndarray  # [n_seq, T] bool
    x_full: np.ndarray  # [n_seq, T, d]
    y_full: np.ndarray  # [n_seq, T, d]
    seq_offset: int = 0  # sample index of the first sequence (a block of the sample starts later)
    docs: np.ndarray | None = None  # [n_seq] the document of each sequence (None: each its own)

    @property
    def x(self) -> np.ndarray:
        return self.x_full[self.kept]

    @property
    def y(self) -> np.ndarray:
        return self.y_full[self.kept]

    @property
    def seq(self) -> np.ndarray:
        return (np.nonzero(self.kept)[0] + self.seq_offset).astype(np.int32)

    @property
    def pos(self) -> np.ndarray:
        return np.nonzero(self.kept)[1].astype(np.int32)

    @property
    def doc(self) -> np.ndarray:
        """The document of each kept token (its sequence's number where documents are unknown)."""
        rows = np.nonzero(self.kept)[0]
        return (self.docs[rows] if self.docs is not None else rows + self.seq_offset).astype(np.int32)


def layer_data(table: pa.Table) -> LayerData:
    """A transition's rows (a whole layer, or the sequences of a block) as arrays."""
    table = table.sort_by([("seq", "ascending"), ("pos", "ascending")])
    seq = table["seq"].to_numpy()
    first = int(seq.min())
    n_seq, seq_len = int(seq.max()) + 1 - first, int(table["pos"].to_numpy().max()) + 1
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
        seq_offset=first,
        docs=table["doc"].to_numpy().reshape(n_seq, seq_len)[:, 0].copy() if "doc" in table.column_names else None,
    )


@dataclass
class Transition:
    """The kept tokens of one layer as arrays (what the fits need), without the full-grid copies."""

    layer: int
    x: np.ndarray  # [N, d] float32
    y: np.ndarray  # [N, d] float32
    seq: np.ndarray  # [N] int32
    pos: np.ndarray  # [N] int32
    doc: np.ndarray  # [N] int32: the document each token's window was cut from


def transition_from_parts(parts: Iterable[pa.Table], n_kept: int) -> Transition:
    """Fill a layer's kept rows from its activations row groups (in (seq, pos) order), one row group
    in memory at a time besides the [n_kept, d] arrays themselves."""
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    seq = np.empty(n_kept, np.int32)
    pos = np.empty(n_kept, np.int32)
    doc = np.empty(n_kept, np.int32)
    filled, layer, last = 0, -1, -1
    for part in parts:
        kept = part["kept"].to_numpy(zero_copy_only=False)
        key = part["seq"].to_numpy().astype(np.int64) * (1 << 32) + part["pos"].to_numpy()
        if len(key) and (np.any(np.diff(key) <= 0) or key[0] <= last):
            raise ValueError("activations rows are not in (seq, pos) order")
        last = int(key[-1]) if len(key) else last
        layer = int(part["layer"][0].as_py()) if len(part) else layer
        xs, ys = to_matrix(part["x"])[kept], to_matrix(part["y"])[kept]
        if x is None:
            x = np.empty((n_kept, xs.shape[1]), np.float32)
            y = np.empty((n_kept, xs.shape[1]), np.float32)
        m = len(xs)
        if filled + m > n_kept:
            raise ValueError(f"activations hold more than the {n_kept} kept tokens expected")
        assert x is not None and y is not None
        x[filled : filled + m], y[filled : filled + m] = xs, ys
        seq[filled : filled + m] = part["seq"].to_numpy()[kept]
        pos[filled : filled + m] = part["pos"].to_numpy()[kept]
        doc[filled : filled + m] = (part["doc"] if "doc" in part.column_names else part["seq"]).to_numpy()[kept]
        filled += m
    if x is None or y is None or filled != n_kept:
        raise ValueError(f"activations hold {filled} kept tokens, expected {n_kept}")
    return Transition(layer, x, y, seq, pos, doc)


# ---- stage 2: local fits ------------------------------------------------------------------------
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


# ---- the bootstrap's unit -----------------------------------------------------------------------
def resample_units(cfg: AnalysisConfig, docs: np.ndarray) -> np.ndarray:
    """The independent unit of each sample sequence: its document (`bootstrap_unit="document"`) or
    itself. `docs`: the document of each sample sequence."""
    units = np.asarray(docs) if cfg.bootstrap_unit == "document" else np.arange(cfg.n_seq)
    if len(units) != cfg.n_seq:
        raise ValueError(f"{len(units)} sequences' documents given, the sample has {cfg.n_seq}")
    return units


def resample_counts(cfg: AnalysisConfig, docs: np.ndarray) -> np.ndarray:
    """[bootstrap, n_seq] multiplicity of each sample sequence in each resample: its unit drawn with
    replacement (`resample_units`)."""
    return sequence_counts(resample_units(cfg, docs), cfg.bootstrap, cfg.seed)




def sample_docs(data: LayerData | pa.Table) -> np.ndarray:
    """The document of each sample sequence, from a whole layer's data or its activations' `seq` and
    `doc` columns."""
    if isinstance(data, LayerData):
        return data.docs if data.docs is not None else np.arange(data.kept.shape[0]) + data.seq_offset
    seq, doc = data["seq"].to_numpy(), data["doc"].to_numpy()
    out = np.empty(int(seq.max()) + 1, np.int64)
    out[seq] = doc
    return out


# ---- stage 4: geometry --------------------------------------------------------------------------
WHICH = ("full", "tok", "res")
# the spectra of the null (docs/method.md, "Nulls"): Δ_full and r when each residual keeps its length
# but points in a random direction (the random control's direction)
NULL_WHICH = ("full_null", "res_null")
NULL_M = 16  # the tokenwise subspace of finding "2 projection"


class LayerGeometry:
    """The geometry of one layer in two passes over blocks of whole sequences (or one block: the whole
    layer), so memory holds a block plus d x d matrices whatever the number of tokens:
    `accumulate` every block (Gram matrices of Δ_full, Δ_tok and r per class, and per bootstrap
    resample for the spectra), `finish`, then `token_table` every block (per-token geometry against
    the dominant tokenwise subspace); `spectra_table` and `bootstrap_table` once at the end."""

    def __init__(self, cfg: AnalysisConfig, classes: list[str], d: int, docs: np.ndarray,
                 null_spectra: bool = True) -> None:
        """`null_spectra`: also the spectra of the null's Δ_full and r (finding 3's null); a positive
        control, whose null no verdict reads, leaves them out (their ranks are NaN)."""
        self.cfg = cfg
        self.counts = resample_counts(cfg, docs)
        self.jackknife = jackknife_counts(resample_units(cfg, docs), cfg.jackknife_groups, cfg.seed)
        self.which = WHICH + NULL_WHICH if null_spectra else WHICH
        self.grams = {(c, w): np.zeros((d, d)) for c in classes for w in self.which}
        self.replicate_grams = {(c, w): ResampledGrams(self.jackknife, d) for c in classes for w in self.which}
        self.n_rows = 0
        self.subspaces: dict[str, Subspace] = {}
        self.scalars: dict[str, list[dict[str, np.ndarray]]] = {c: [] for c in classes}

    def accumulate(self, data: LayerData, fits: dict[str, LayerFit]) -> None:
        seq = data.seq
        self.n_rows += len(seq)
        directions = random_directions(data, self.cfg.seed)
        for fn_class, fit in fits.items():
            dec = decompose(data.x, data.y, fit.tx)
            null = null_residual(dec, directions)
            for which, v in zip(self.which, (dec.delta_full, dec.delta_tok, dec.residual,
                                             null.delta_full, null.residual)):
                self.grams[(fn_class, which)] += v.T @ v
                self.replicate_grams[(fn_class, which)].add(v, seq)

    def finish(self) -> None:
        self.subspaces = {c: subspace_from_gram(g, self.n_rows, self.cfg.energy_threshold)
                          for (c, w), g in self.grams.items() if w == "tok"}

    def token_table(self, data: LayerData, fits: dict[str, LayerFit], prov: Provenance) -> pa.Table:
        parts = []
        directions = random_directions(data, self.cfg.seed)
        for fn_class, fit in fits.items():
            sub = self.subspaces[fn_class]
            dec = decompose(data.x, data.y, fit.tx)
            metrics = token_metrics(data.x, data.y, fit.tx, dec)
            metrics.update(projection_metrics(dec, sub, self.cfg.subspace_ms))
            metrics.update(null_metrics(dec, data.x, directions, sub, NULL_M))
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
            parts.append(with_provenance(cols, prov, data.layer))
            self.scalars[fn_class].append({"seq": data.seq, **{k: metrics[k] for k in TOKEN_STATISTICS if k in metrics}})
        return pa.concat_tables(parts)

    def spectra_table(self, prov: Provenance, layer: int) -> pa.Table:
        parts = []
        for (fn_class, which), gram in self.grams.items():
            sp = spectrum_from_gram(gram, self.n_rows, self.cfg.energy_threshold)
            k = len(sp.singular_values)
            parts.append(with_provenance({
                "fn_class": pa.array([fn_class] * k),
                "which": pa.array([which] * k),
                "idx": pa.array(np.arange(k), pa.int32()),
                "sigma": pa.array(sp.singular_values),
                "cum_energy": pa.array(sp.cum_energy),
                "effective_rank": pa.array([sp.effective_rank] * k),
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
        spectra_ranks = dict(zip(keys, effective_ranks_of([self.replicate_grams[key] for key in keys])))
        for fn_class, blocks in self.scalars.items():
            merged = {k: np.concatenate([blk[k] for blk in blocks]) for k in blocks[0]}
            resampled = geometry_replicates(merged["seq"], merged, self.counts)
            cols: dict[str, pa.Array] = {
                "fn_class": pa.array([fn_class] * (b + g)),
                "replicate": pa.array(np.concatenate([np.arange(b), JACKKNIFE_FIRST - np.arange(g)]), pa.int32())}
            cols.update({k: pa.array(np.concatenate([v, np.full(g, np.nan)]), pa.float64(), from_pandas=True)
                         for k, v in resampled.items()})
            for which in WHICH + NULL_WHICH:
                ranks = np.full(b + g, np.nan)
                if which in self.which:
                    ranks[b:] = spectra_ranks[(fn_class, which)]
                cols[f"rank_{which}"] = pa.array(ranks, pa.float64(), from_pandas=True)
            parts.append(with_provenance(cols, prov, layer))
        return pa.concat_tables(parts)


def geometry_tables(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig,
                    prov: Provenance, null_spectra: bool = True) -> tuple[pa.Table, pa.Table, pa.Table]:
    """Per-token geometry, the per-layer singular spectra of Δ_full, Δ_tok and r, and the per-layer
    statistics of the findings on every bootstrap resample of the sequences: a whole layer in memory."""
    geo = LayerGeometry(cfg, list(fits), data.x_full.shape[-1], sample_docs(data), null_spectra)
    geo.accumulate(data, fits)
    geo.finish()
    tokens = geo.token_table(data, fits, prov)
    return tokens, geo.spectra_table(prov, data.layer), geo.bootstrap_table(prov, data.layer)


# ---- stage 5: functional metrics ----------------------------------------------------------------
def random_directions(data: LayerData, seed: int) -> np.ndarray:
    """A random unit vector per kept token, drawn per sequence (seeded by seed, layer and the
    sequence's index in the sample): a token's direction does not depend on the sample size or on
    how the sample is cut into blocks. [kept tokens, d] in (seq, pos) order."""
    parts = []
    for s in range(data.kept.shape[0]):
        rng = np.random.default_rng([seed, data.layer, data.seq_offset + s])
        u = rng.standard_normal((int(data.kept[s].sum()), data.y_full.shape[-1]))
        parts.append(u / np.linalg.norm(u, axis=-1, keepdims=True))
    return np.concatenate(parts)


def control_plan(cfg: AnalysisConfig) -> list[str]:
    """The controls that get a patched pass of their own, in the order they are measured (the crude
    control needs a crude class other than the primary one)."""
    return [name for name in ("random", "crude", "identity") if name in cfg.controls
            and not (name == "crude" and cfg.crude_class == cfg.primary_class)]


def patched_pass_count(cfg: AnalysisConfig) -> int:
    """How many patched versions of a layer's output the functional stage runs: one per class and
    one per control (each a forward pass from the layer on over every sequence), plus the unpatched
    stream the exact single-position effects run beside them (patch_mode "exact", and "auto" on the
    attention models it resolves to "exact" for)."""
    return len(cfg.classes) + len(control_plan(cfg)) + (cfg.patch_mode in ("auto", "exact"))


def build_variants(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig) -> list[Variant]:
    """The main patch per class (y -> T(x) at kept positions) and the controls of `control_plan`."""

    def scatter(values: np.ndarray) -> np.ndarray:
        state = data.y_full.astype(np.float64).copy()
        state[data.kept] = values
        return state

    variants = [Variant("patch", c, scatter(fit.tx)) for c, fit in fits.items()]
    primary = fits[cfg.primary_class]
    for name in control_plan(cfg):
        if name == "random":
            y = data.y.astype(np.float64)
            norm_res = np.linalg.norm(data.y - primary.tx, axis=1)
            state = scatter(y + norm_res[:, None] * random_directions(data, cfg.seed))
        elif name == "crude":
            state = scatter(data.y + (fits[cfg.crude_class].tx - primary.tx))
        else:  # identity
            state = data.y_full.astype(np.float64)
        variants.append(Variant(name, cfg.primary_class, state))
    return variants


def single_positions(kept: np.ndarray, per_seq: int, seed: int) -> np.ndarray:
    """(sequence, position) pairs [P, 2] of the single-position patches over the whole sample."""
    rng = np.random.default_rng([seed, 7919])
    out: list[tuple[int, int]] = []
    for s in range(kept.shape[0]):
        candidates = np.flatnonzero(kept[s])
        chosen = rng.choice(candidates, size=min(per_seq, len(candidates)), replace=False)
        out.extend((s, int(p)) for p in np.sort(chosen))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def later_positions(measured: np.ndarray, per_seq: int, seed: int, seq_offset: int = 0) -> np.ndarray:
    """(sequence, position) pairs [P, 2] whose effect on the later positions is measured: `per_seq`
    measured positions of each sequence that have a position after them, drawn from the seed and the
    sequence's number in the sample (so a block of sequences draws what the whole sample would)."""
    out: list[tuple[int, int]] = []
    for s in range(measured.shape[0]):
        candidates = np.flatnonzero(measured[s, :-1])
        rng = np.random.default_rng([seed, 7920, seq_offset + s])
        chosen = rng.choice(candidates, size=min(per_seq, len(candidates)), replace=False)
        out.extend((s, int(p)) for p in np.sort(chosen))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


# per variant: fn_class, variant, seq, pos, kl (clamped at 0), kl_raw (before the clamp), rel_err, norm_res,
# kl_later (the summed KL after the position, on the `later_positions` subsample of the main patch of the
# primary class; NaN elsewhere)
FunctionalRows = list[dict[str, np.ndarray | str]]


def functional_rows(lm: LoadedModel, data: LayerData, fits: dict[str, LayerFit], orig: OriginalOutput,
                    cfg: AnalysisConfig, returns_tuple: bool = False,
                    positions: np.ndarray | None = None) -> FunctionalRows:
    """KL of every variant at the measured tokens of `data` (a layer, or a block of its sequences:
    `orig` covers the same sequences). `positions`: the sample's single-position pairs (patch_mode
    "single"), in sample sequence numbers."""
    variants = build_variants(data, fits, cfg)
    mode = resolve_patch_mode(lm, cfg.patch_mode)
    if mode == "exact":  # every position's single-position effect, in one pass of 1 + len(variants) streams
        kls = all_single_position_kl(lm, data.input_ids, data.layer, variants, data.y_full, orig,
                                     cfg.patch_batch * 2, returns_tuple)
        measured = data.kept
    elif mode == "all":
        kls = patched_kl(lm, data.input_ids, data.layer, variants, orig, cfg.patch_batch, returns_tuple)
        measured = data.kept
    else:
        assert positions is not None, "single patch mode needs the sample's positions"
        n_seq = data.kept.shape[0]
        local = positions[(positions[:, 0] >= data.seq_offset) & (positions[:, 0] < data.seq_offset + n_seq)]
        local = local - np.array([data.seq_offset, 0])
        kls = single_position_kl(lm, data.input_ids, data.layer, variants, data.y_full, local,
                                 orig, cfg.patch_batch, returns_tuple)
        measured = np.zeros_like(data.kept)
        measured[local[:, 0], local[:, 1]] = True
    seq_idx, pos_idx = np.nonzero(measured)
    key_all = data.seq.astype(np.int64) * data.kept.shape[1] + data.pos
    key_measured = (seq_idx + data.seq_offset).astype(np.int64) * data.kept.shape[1] + pos_idx
    rows_in_kept = np.searchsorted(key_all, key_measured)
    later = np.full(measured.shape, np.nan)
    if cfg.later_positions:
        main = next(v for v in variants if v.name == "patch" and v.fn_class == cfg.primary_class)
        chosen = later_positions(measured, cfg.later_positions, cfg.seed, data.seq_offset)
        _, total = later_position_kl(lm, data.input_ids, data.layer, main.state, data.y_full, chosen, orig,
                                     cfg.patch_batch, returns_tuple)
        later[chosen[:, 0], chosen[:, 1]] = total
    out: FunctionalRows = []
    for variant, kl_grid in zip(variants, kls):
        fit = fits[variant.fn_class]
        err = token_metrics(data.x[rows_in_kept], data.y[rows_in_kept], fit.tx[rows_in_kept])
        raw = kl_grid[seq_idx, pos_idx]
        main_patch = variant.name == "patch" and variant.fn_class == cfg.primary_class
        out.append({"fn_class": variant.fn_class, "variant": variant.name, "patch_mode": mode,
                    "seq": (seq_idx + data.seq_offset).astype(np.int32), "pos": pos_idx.astype(np.int32),
                    "kl": np.maximum(raw, 0.0), "kl_raw": raw, "rel_err": err["rel_err"], "norm_res": err["norm_res"],
                    "kl_later": later[seq_idx, pos_idx] if main_patch else np.full(len(seq_idx), np.nan)})
    return out


def functional_tables_from_rows(rows: FunctionalRows, cfg: AnalysisConfig, prov: Provenance,
                                layer: int) -> tuple[pa.Table, pa.Table]:
    """Per-token and per-layer tables from the rows of every block (concatenated per variant)."""
    merged: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        merged.setdefault((str(row["fn_class"]), str(row["variant"])), []).append(row)
    token_parts, summary_parts = [], []
    columns = {key: {k: np.concatenate([p[k] for p in parts])
                     for k in ("seq", "pos", "kl", "kl_raw", "rel_err", "norm_res", "kl_later")} for key, parts in merged.items()}
    for (fn_class, name), parts in merged.items():
        mode = str(parts[0].get("patch_mode", cfg.patch_mode))  # as measured ("auto" resolved per model)
        col = columns[(fn_class, name)]
        kl = col["kl"]
        ratio = _ratio_to_random(columns, fn_class) if name == "patch" else None
        n = len(kl)
        token_parts.append(with_provenance({
            "fn_class": pa.array([fn_class] * n),
            "variant": pa.array([name] * n),
            "patch_mode": pa.array([mode] * n),
            "seq": pa.array(col["seq"]),
            "pos": pa.array(col["pos"]),
            "kl": pa.array(kl),
            "rel_err": pa.array(col["rel_err"]),
            "norm_res": pa.array(col["norm_res"]),
            "kl_later": pa.array(col["kl_later"], from_pandas=True),  # null where not measured
        }, prov, layer))
        s_rel = spearman(col["rel_err"], kl)
        s_abs = spearman(col["norm_res"], kl)
        on_later = np.isfinite(col["kl_later"])
        s_later = spearman(kl, col["kl_later"])
        summary_parts.append(with_provenance({
            "fn_class": pa.array([fn_class]),
            "variant": pa.array([name]),
            "patch_mode": pa.array([mode]),
            "n_tokens": pa.array([n], pa.int32()),
            "kl_mean": pa.array([float(np.mean(kl)) if n else float("nan")]),
            "kl_median": pa.array([float(np.median(kl)) if n else float("nan")]),
            "kl_max": pa.array([float(np.max(kl)) if n else float("nan")]),
            # the most negative KL before the clamp at 0: rounding is ~1e-7 or less, more is a fault
            "kl_raw_min": pa.array([float(np.min(col["kl_raw"])) if n else float("nan")]),
            "spearman_relerr_kl": pa.array([s_rel.rho]),
            "spearman_relerr_kl_p": pa.array([s_rel.p_value]),
            "spearman_normres_kl": pa.array([s_abs.rho]),
            "spearman_normres_kl_p": pa.array([s_abs.p_value]),
            # null where not measured: the ratio on the random control's class, the later effect on the
            # main patch of the primary class
            "kl_ratio_random": pa.array([float(median_ratio(ratio, np.ones((1, len(ratio))))[0])
                                         if ratio is not None else None], pa.float64()),
            "n_later": pa.array([int(on_later.sum())], pa.int32()),
            "kl_later_mean": pa.array([float(np.mean(col["kl_later"][on_later])) if on_later.any() else None],
                                      pa.float64()),
            "kl_at_mean_on_later": pa.array([float(np.mean(kl[on_later])) if on_later.any() else None], pa.float64()),
            "spearman_kl_later": pa.array([s_later.rho if np.isfinite(s_later.rho) else None], pa.float64()),
        }, prov, layer))
    return pa.concat_tables(token_parts), pa.concat_tables(summary_parts)


def _ratio_to_random(columns: dict[tuple[str, str], dict[str, np.ndarray]], fn_class: str) -> np.ndarray | None:
    """Per token, KL(remove r) / KL(the random perturbation of the same norm) for the class the random
    control was made for (None for the others): both measured at the same positions, in the same order."""
    patch, random = columns[(fn_class, "patch")], columns.get((fn_class, "random"))
    if random is None:
        return None
    if not (np.array_equal(patch["seq"], random["seq"]) and np.array_equal(patch["pos"], random["pos"])):
        raise ValueError("the random control was measured at other positions than the patch: no paired ratio")
    return paired_ratio(patch["kl"], random["kl"])


def _replicate_spearman(part: pa.Table, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spearman(relative error, KL) and Spearman(||r||, KL) of one variant's rows on every resample."""
    seq, kl = part["seq"].to_numpy(), part["kl"].to_numpy()
    rel, norm = part["rel_err"].to_numpy(), part["norm_res"].to_numpy()
    rho_rel, rho_norm = np.full(len(counts), np.nan), np.full(len(counts), np.nan)
    if len(part):
        for start, w in row_weights(counts, seq):  # weights of 32 resamples x tokens at a time
            rho_rel[start : start + len(w)] = weighted_spearman(rel, kl, w)
            rho_norm[start : start + len(w)] = weighted_spearman(norm, kl, w)
    return rho_rel, rho_norm


def functional_bootstrap_table(fm: pa.Table, cfg: AnalysisConfig, prov: Provenance, layer: int,
                               docs: np.ndarray) -> pa.Table:
    """Spearman(error, KL) of the main patch on every bootstrap resample, and its null: the same
    Spearman with the KL of the random control (the output moved as far in a random direction), for
    the class the controls use (NaN for the others). `docs`: the document of each sample sequence."""
    counts = resample_counts(cfg, docs)
    parts = []
    patch = fm.filter(pc.equal(fm["variant"], "patch"))
    random = fm.filter(pc.equal(fm["variant"], "random"))
    for fn_class in dict.fromkeys(patch["fn_class"].to_pylist()):
        own, own_random = (part.filter(pc.equal(part["fn_class"], fn_class)).sort_by([("seq", "ascending"),
                                                                                      ("pos", "ascending")])
                           for part in (patch, random))
        rho_rel, rho_norm = _replicate_spearman(own, counts)
        null_rel, null_norm = _replicate_spearman(own_random, counts)
        ratio = np.full(len(counts), np.nan)
        if len(own_random):
            per_token = _ratio_to_random({(fn_class, name): {k: part[k].to_numpy() for k in ("seq", "pos", "kl")}
                                          for name, part in (("patch", own), ("random", own_random))}, fn_class)
            assert per_token is not None
            seq = own["seq"].to_numpy()
            for start, w in row_weights(counts, seq):
                ratio[start : start + len(w)] = median_ratio(per_token, w)
        parts.append(with_provenance({
            "fn_class": pa.array([fn_class] * cfg.bootstrap),
            "replicate": pa.array(np.arange(cfg.bootstrap), pa.int32()),
            "spearman_relerr_kl": pa.array(rho_rel, pa.float64(), from_pandas=True),
            "spearman_normres_kl": pa.array(rho_norm, pa.float64(), from_pandas=True),
            "spearman_relerr_kl_null": pa.array(null_rel, pa.float64(), from_pandas=True),
            "spearman_normres_kl_null": pa.array(null_norm, pa.float64(), from_pandas=True),
            "kl_ratio_random": pa.array(ratio, pa.float64(), from_pandas=True),
        }, prov, layer))
    return pa.concat_tables(parts)


def functional_tables(lm: LoadedModel, data: LayerData, fits: dict[str, LayerFit], orig: OriginalOutput,
                      cfg: AnalysisConfig, prov: Provenance, returns_tuple: bool = False) -> tuple[pa.Table, pa.Table]:
    """One whole layer in memory (`orig` covers the whole sample): notebooks, sweeps, tests."""
    positions = single_positions(data.kept, cfg.single_positions, cfg.seed) if cfg.patch_mode == "single" else None
    rows = functional_rows(lm, data, fits, orig, cfg, returns_tuple, positions)
    return functional_tables_from_rows(rows, cfg, prov, data.layer)


# ---- one layer in memory: the notebook, the tests and the sweep -----------------------------------
@dataclass
class LayerResult:
    layer: int
    tables: dict[str, pa.Table]


def analyse_layer(lm: LoadedModel, data: LayerData, orig: OriginalOutput, cfg: AnalysisConfig, prov: Provenance,
                  returns_tuple: bool = False, tables: Collection[str] = TABLES,
                  y_self: np.ndarray | None = None) -> dict[str, pa.Table]:
    """The tables of the stages after the capture for one layer, in memory, in the stages' order
    (updatelens.stages); only what `tables` asks for is built. The assets run the same steps stage by
    stage, streaming blocks of sequences through storage. `y_self` [n_seq, T, d]: the layer's
    self-only block outputs (the positive control; None where the architecture has none)."""
    from updatelens.controls import CONTROL_TABLES, control_layer_tables  # controls builds on this module

    fits, neighbours = compute_fits(data, cfg)
    out: dict[str, pa.Table] = {}
    if "local_fits" in tables:
        out["local_fits"] = fits_table(data, fits, neighbours, prov)
    if "residuals" in tables:
        out["residuals"] = residuals_table(data, fits, prov)
    if {"geometry", "spectra", "geometry_bootstrap"} & set(tables):
        out["geometry"], out["spectra"], out["geometry_bootstrap"] = geometry_tables(data, fits, cfg, prov)
    if {"functional_metrics", "functional_summary", "functional_bootstrap"} & set(tables):
        fm, fs = functional_tables(lm, data, fits, orig, cfg, prov, returns_tuple)
        out["functional_metrics"], out["functional_summary"] = fm, fs
        if "functional_bootstrap" in tables:
            out["functional_bootstrap"] = functional_bootstrap_table(fm, cfg, prov, data.layer, sample_docs(data))
    if set(CONTROL_TABLES) & set(tables):
        out.update(control_layer_tables(data, y_self, neighbours, cfg, prov))
    return {name: out[name] for name in TABLES if name in tables and name in out}


def analyse_model(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig,
                  layers: list[int] | None = None) -> Iterator[LayerResult]:
    """Every stage for each layer, in memory, one layer at a time (for notebooks and tests)."""
    cfg.validate(d_model=lm.d_model, max_positions=lm.max_positions)
    prov = provenance(lm, sample, cfg)
    chosen = list(layers) if layers is not None else list(range(lm.n_layers))
    cap = capture(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch,
                  self_only=self_only_layers(lm, cfg.positive_controls, chosen))
    orig = original_output(lm, sample.input_ids, cfg.patch_batch)
    for layer in chosen:
        act = activations_table(cap, layer, cfg, prov, sample.doc_index)
        tables = {"activations": act, "tokens": token_rows(lm.tokenizer, sample.input_ids, layer, prov)}
        tables.update(analyse_layer(lm, layer_data(act), orig, cfg, prov, cap.block_returns_tuple,
                                    y_self=cap.self_only.get(layer)))
        yield LayerResult(layer, tables)
