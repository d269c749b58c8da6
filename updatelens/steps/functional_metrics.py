"""Stage 6, functional metrics: the effect on the output of removing r (KL at the patched position
and after it), with the random, crude and identity controls, and their resamples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens.bootstrap import (
    median_ratio,
    paired_ratio,
    row_weights,
    weighted_spearman,
)
from updatelens.config import AnalysisConfig
from updatelens.fits import LayerFit
from updatelens.geometry import shaped_directions, token_metrics, update_shape
from updatelens.models import LoadedModel
from updatelens.perturbation import (
    OriginalOutput,
    Variant,
    later_position_kl,
    original_output,
    patched_kl,
    single_position_kl,
    spearman,
    vocab_size,
)
from updatelens.progress import progress
from updatelens.single_position import all_single_position_kl, resolve_patch_mode
from updatelens.steps.layer import LayerData, random_directions, resample_counts
from updatelens.tables import Provenance, with_provenance


def control_plan(cfg: AnalysisConfig) -> list[str]:
    """The controls that get a patched pass of their own, in the order they are measured (the crude
    control needs a crude class other than the primary one)."""
    return [name for name in ("random", "crude", "identity", "context") if name in cfg.controls
            and not (name == "crude" and cfg.crude_class == cfg.primary_class)]


def patched_pass_count(cfg: AnalysisConfig) -> int:
    """How many patched versions of a layer's output the functional stage runs: one per class and
    one per control (each a forward pass from the layer on over every sequence), plus the unpatched
    stream the exact single-position effects run beside them (patch_mode "exact", and "auto" on the
    attention models it resolves to "exact" for); the context control brings its random move too."""
    plan = control_plan(cfg)
    return len(cfg.classes) + len(plan) + ("context" in plan) + (cfg.patch_mode in ("auto", "exact"))


def residual_gram(data: LayerData, fit: LayerFit) -> np.ndarray:
    """Σ r rᵀ over the kept tokens of `data` (r = y - T(x) of `fit`), float64 [d, d]."""
    r = data.y.astype(np.float64) - fit.tx
    return r.T @ r


def context_gram(data: LayerData) -> np.ndarray:
    """Σ a aᵀ over the kept tokens of `data` (a = y - y_ctl, the exact split's context part), float64 [d, d]."""
    assert data.y_ctl_full is not None
    a = data.y.astype(np.float64) - data.y_ctl_full[data.kept]
    return a.T @ a


def build_variants(data: LayerData, fits: dict[str, LayerFit], cfg: AnalysisConfig,
                   move_shape: np.ndarray | None = None, context_shape: np.ndarray | None = None) -> list[Variant]:
    """The main patch per class (y -> T(x) at kept positions) and the controls of `control_plan`. The
    random control moves each state as far as the patch does, in a random direction drawn in the shape of
    the residuals (N(0, Σ_r), `move_shape` a square root of Σ_r over the whole layer; None: over `data`),
    so the move stays in the directions the residuals use (docs/method.md, "Nulls"). The context control
    (y -> y_ctl, a removed) comes with its own random move, `context_random`: each state moved ||a|| in a
    random direction of a's shape (`context_shape`, over the whole layer; None: over `data`)."""

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
            shape = move_shape if move_shape is not None else update_shape(residual_gram(data, primary), len(y))
            state = scatter(y + norm_res[:, None] * shaped_directions(random_directions(data, cfg.seed), shape))
        elif name == "crude":
            state = scatter(data.y + (fits[cfg.crude_class].tx - primary.tx))
        elif name == "context":  # the exact split's a removed: y -> y_ctl (not made where y_ctl was not captured)
            if data.y_ctl_full is None:
                continue
            state = scatter(data.y_ctl_full[data.kept])
            variants.append(Variant(name, cfg.primary_class, state))
            y = data.y.astype(np.float64)
            norm_ctx = np.linalg.norm(y - data.y_ctl_full[data.kept], axis=1)
            shape = context_shape if context_shape is not None else update_shape(context_gram(data), len(y))
            directions = shaped_directions(random_directions(data, cfg.seed + 1), shape)
            variants.append(Variant("context_random", cfg.primary_class, scatter(y + norm_ctx[:, None] * directions)))
            continue
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


def later_positions(measured: np.ndarray, per_seq: int, seed: int, seq_offset: int = 0, horizon: int = 1) -> np.ndarray:
    """(sequence, position) pairs [P, 2] whose effect on the later positions is measured: `per_seq`
    measured positions of each sequence that have `horizon` positions after them, drawn from the seed and
    the sequence's number in the sample (so a block of sequences draws what the whole sample would)."""
    out: list[tuple[int, int]] = []
    for s in range(measured.shape[0]):
        candidates = np.flatnonzero(measured[s, : max(measured.shape[1] - horizon, 0)])
        rng = np.random.default_rng([seed, 7920, seq_offset + s])
        chosen = rng.choice(candidates, size=min(per_seq, len(candidates)), replace=False)
        out.extend((s, int(p)) for p in np.sort(chosen))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


LATER_STATISTICS = ("kl_later_mean", "kl_later_random_mean", "later_ratio_median")  # `later_statistics`

# per variant: fn_class, variant, seq, pos, kl (clamped at 0), kl_raw (before the clamp), rel_err, norm_res,
# kl_later and kl_later_random (the mean KL per later position over `later_horizon` positions after the
# position, with r removed there, and with the random control's move there instead; on the
# `later_positions` subsample of the main patch of the primary class; NaN elsewhere)
FunctionalRows = list[dict[str, np.ndarray | str]]


def functional_rows(lm: LoadedModel, data: LayerData, fits: dict[str, LayerFit], orig: OriginalOutput,
                    cfg: AnalysisConfig, returns_tuple: bool = False,
                    positions: np.ndarray | None = None, move_shape: np.ndarray | None = None,
                    context_shape: np.ndarray | None = None) -> FunctionalRows:
    """KL of every variant at the measured tokens of `data` (a layer, or a block of its sequences:
    `orig` covers the same sequences). `positions`: the sample's single-position pairs (patch_mode
    "single"), in sample sequence numbers; `move_shape`, `context_shape`: the random moves' shapes
    (`build_variants`)."""
    variants = build_variants(data, fits, cfg, move_shape, context_shape)
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
    later, later_random = np.full(measured.shape, np.nan), np.full(measured.shape, np.nan)
    # after the last block no attention follows, so the later positions cannot move (their KL is rounding): not measured
    if cfg.later_positions and data.layer < lm.n_layers - 1:
        main = next(v for v in variants if v.name == "patch" and v.fn_class == cfg.primary_class)
        chosen = later_positions(measured, cfg.later_positions, cfg.seed, data.seq_offset, cfg.later_horizon)
        _, per_position = later_position_kl(lm, data.input_ids, data.layer, main.state, data.y_full, chosen, orig,
                                            cfg.patch_batch, returns_tuple, cfg.later_horizon)
        later[chosen[:, 0], chosen[:, 1]] = per_position
        random = next((v for v in variants if v.name == "random"), None)
        if random is not None:  # the same positions moved as far in a random direction of the residuals' shape
            _, per_position = later_position_kl(lm, data.input_ids, data.layer, random.state, data.y_full, chosen,
                                                orig, cfg.patch_batch, returns_tuple, cfg.later_horizon)
            later_random[chosen[:, 0], chosen[:, 1]] = per_position
    out: FunctionalRows = []
    for variant, kl_grid in zip(variants, kls):
        # the error that goes with the KL: the fit's residual; for the context control, a (y - y_ctl)
        tx = fits[variant.fn_class].tx
        if variant.name in ("context", "context_random"):  # its move is ||a|| long
            assert data.y_ctl_full is not None, "the context control is made only where y_ctl was captured"
            tx = data.y_ctl_full[data.kept]
        err = token_metrics(data.x[rows_in_kept], data.y[rows_in_kept], tx[rows_in_kept])
        raw = kl_grid[seq_idx, pos_idx]
        main_patch = variant.name == "patch" and variant.fn_class == cfg.primary_class
        out.append({"fn_class": variant.fn_class, "variant": variant.name, "patch_mode": mode,
                    "seq": (seq_idx + data.seq_offset).astype(np.int32), "pos": pos_idx.astype(np.int32),
                    "kl": np.maximum(raw, 0.0), "kl_raw": raw, "rel_err": err["rel_err"], "norm_res": err["norm_res"],
                    "kl_later": later[seq_idx, pos_idx] if main_patch else np.full(len(seq_idx), np.nan),
                    "kl_later_random": later_random[seq_idx, pos_idx] if main_patch else np.full(len(seq_idx), np.nan)})
    return out


@dataclass(frozen=True)
class Measure:
    """One (layer, configuration) the functional stream measures, and where its fits of a block of
    sequences come from: `fits(data, lo, hi)` for the layer's sequences lo..hi-1."""

    layer: int
    cfg: AnalysisConfig
    fits: Callable[[LayerData, int, int], dict[str, LayerFit]]


def stream_functional(lm: LoadedModel, input_ids: np.ndarray, kept: np.ndarray, measures: Sequence[Measure],
                      read: Callable[[int, int, int], LayerData], block: AnalysisConfig, returns_tuple: bool,
                      label: str, first_block: Callable[[int, LayerData], None] | None = None) -> list[FunctionalRows]:
    """The rows of every measure over blocks of whole sequences (`block`'s kl_block_size and
    patch_batch): each block's unpatched distributions are computed once, resumed after the lowest
    layer from its captured output (`read(layer, lo, hi)`), and serve every layer and configuration,
    then are dropped; memory holds one block's distributions and states whatever the sample size.
    `kept` [n_seq, T]: the sample's kept positions (the single-position draws); `first_block(layer,
    data)` is called on each layer's first block (the identity check)."""
    layers = sorted({m.layer for m in measures})
    positions = [single_positions(kept, m.cfg.single_positions, m.cfg.seed) if m.cfg.patch_mode == "single" else None
                 for m in measures]
    rows: list[FunctionalRows] = [[] for _ in measures]
    n_seq = len(input_ids)
    size = block.kl_block_size(vocab_size(lm))
    shapes = [_move_shape(m, read, n_seq, size) for m in measures]
    context_shapes = [_context_shape(m, read, n_seq, size) for m in measures]
    with progress(label, n_seq * len(measures), "seq x layer") as bar:
        for lo in range(0, n_seq, size):
            hi = min(n_seq, lo + size)
            blocks = {layer: read(layer, lo, hi) for layer in layers}
            orig = original_output(lm, input_ids[lo:hi], block.patch_batch, resume=(layers[0], blocks[layers[0]].y_full),
                                   returns_tuple=returns_tuple)
            for layer in layers:
                data = blocks.pop(layer)
                for i, measure in enumerate(measures):
                    if measure.layer == layer:
                        rows[i] += functional_rows(lm, data, measure.fits(data, lo, hi), orig, measure.cfg,
                                                   returns_tuple, positions[i], shapes[i], context_shapes[i])
                        bar.update(hi - lo)
                if lo == 0 and first_block is not None:
                    first_block(layer, data)
            del orig
    return rows


def _layer_shape(measure: Measure, read: Callable[[int, int, int], LayerData], n_seq: int, size: int,
                 gram: Callable[[LayerData, int, int], np.ndarray | None]) -> np.ndarray | None:
    """A square root of a second moment over the whole layer (`gram(data, lo, hi)` of each block of
    sequences, read block by block before the patched passes, so a token's move does not depend on how
    the sample is cut into blocks); None where a block has none."""
    total, count = None, 0
    for lo in range(0, n_seq, size):
        hi = min(n_seq, lo + size)
        data = read(measure.layer, lo, hi)
        part = gram(data, lo, hi)
        if part is None:
            return None
        total = part if total is None else total + part
        count += len(data.seq)
    return update_shape(total, count) if total is not None else None


def _move_shape(measure: Measure, read: Callable[[int, int, int], LayerData], n_seq: int,
                size: int) -> np.ndarray | None:
    """The random control's shape for one measure: of the primary class's residuals over the whole layer;
    None where no random control is made."""
    if "random" not in control_plan(measure.cfg):
        return None
    return _layer_shape(measure, read, n_seq, size, lambda data, lo, hi: residual_gram(
        data, measure.fits(data, lo, hi)[measure.cfg.primary_class]))


def _context_shape(measure: Measure, read: Callable[[int, int, int], LayerData], n_seq: int,
                   size: int) -> np.ndarray | None:
    """The context control's random move's shape: of a = y - y_ctl over the whole layer; None where no
    context control is made (not asked, or no y_ctl)."""
    if "context" not in control_plan(measure.cfg):
        return None
    return _layer_shape(measure, read, n_seq, size,
                        lambda data, lo, hi: context_gram(data) if data.y_ctl_full is not None else None)


def functional_tables_from_rows(rows: FunctionalRows, cfg: AnalysisConfig, prov: Provenance,
                                layer: int) -> tuple[pa.Table, pa.Table]:
    """Per-token and per-layer tables from the rows of every block (concatenated per variant)."""
    merged: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        merged.setdefault((str(row["fn_class"]), str(row["variant"])), []).append(row)
    token_parts, summary_parts = [], []
    columns = {key: {k: np.concatenate([p[k] for p in parts])
                     for k in ("seq", "pos", "kl", "kl_raw", "rel_err", "norm_res", "kl_later", "kl_later_random")}
               for key, parts in merged.items()}
    for (fn_class, name), parts in merged.items():
        mode = str(parts[0].get("patch_mode", cfg.patch_mode))  # as measured ("auto" resolved per model)
        col = columns[(fn_class, name)]
        kl = col["kl"]
        ratio = (_ratio_to_random(columns, fn_class) if name == "patch"
                 else _ratio_to_random(columns, fn_class, "context", "context_random") if name == "context" else None)
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
            "kl_later_random": pa.array(col["kl_later_random"], from_pandas=True),
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
            "kl_at_mean_on_later": pa.array([float(np.mean(kl[on_later])) if on_later.any() else None], pa.float64()),
            "spearman_kl_later": pa.array([s_later.rho if np.isfinite(s_later.rho) else None], pa.float64()),
            **{k: pa.array(v, pa.float64(), from_pandas=True)
               for k, v in later_statistics(col["kl_later"], col["kl_later_random"], np.ones((1, n))).items()},
        }, prov, layer))
    return pa.concat_tables(token_parts), pa.concat_tables(summary_parts)


def later_statistics(later: np.ndarray, later_random: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The effect on the later positions per weighted sample [b] (weights [b, n] over the tokens; the
    point estimate: one row of ones): `kl_later_mean`, the mean over the measured tokens of the mean KL
    per later position; `kl_later_random_mean`, the same with the random control's move at the token;
    `later_ratio_median`, the median over the tokens of the paired ratio of the two (NaN where none
    was measured)."""
    b = len(weights)

    def mean(values: np.ndarray) -> np.ndarray:
        ok = np.isfinite(values)
        total = weights[:, ok].sum(axis=1)
        return np.divide(weights[:, ok] @ values[ok], total, out=np.full(b, np.nan), where=total > 0)

    return {"kl_later_mean": mean(later), "kl_later_random_mean": mean(later_random),
            "later_ratio_median": median_ratio(paired_ratio(later, later_random), weights)}


def _ratio_to_random(columns: dict[tuple[str, str], dict[str, np.ndarray]], fn_class: str, moved: str = "patch",
                     control: str = "random") -> np.ndarray | None:
    """Per token, KL(remove r) / KL(the random perturbation of the same norm) for the class the random
    control was made for (None for the others): both measured at the same positions, in the same order.
    With `moved` "context" and `control` "context_random": KL(remove a) / KL(a random move of ||a||)."""
    patch, random = columns[(fn_class, moved)], columns.get((fn_class, control))
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
        later = {k: np.full(len(counts), np.nan) for k in LATER_STATISTICS}
        if len(own):
            kl_later, kl_later_random = (own[k].to_numpy(zero_copy_only=False) for k in ("kl_later", "kl_later_random"))
            for start, w in row_weights(counts, own["seq"].to_numpy()):
                for k, v in later_statistics(kl_later.astype(np.float64), kl_later_random.astype(np.float64), w).items():
                    later[k][start : start + len(w)] = v
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
            **{k: pa.array(v, pa.float64(), from_pandas=True) for k, v in later.items()},
        }, prov, layer))
    return pa.concat_tables(parts)


def functional_tables(lm: LoadedModel, data: LayerData, fits: dict[str, LayerFit], orig: OriginalOutput,
                      cfg: AnalysisConfig, prov: Provenance, returns_tuple: bool = False) -> tuple[pa.Table, pa.Table]:
    """One whole layer in memory (`orig` covers the whole sample): notebooks, tests."""
    positions = single_positions(data.kept, cfg.single_positions, cfg.seed) if cfg.patch_mode == "single" else None
    rows = functional_rows(lm, data, fits, orig, cfg, returns_tuple, positions)
    return functional_tables_from_rows(rows, cfg, prov, data.layer)
