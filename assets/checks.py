"""Data-quality checks of every stage: what each validates, as functions of the written tables (the
catalogue of the checks, their thresholds and their Dagster form are in check_catalog.py).

Each asset declares its checks as `check_specs` and evaluates them on the partitions it has just
written (read back from Parquet, so the file is what is checked). Capture and fit checks are
blocking: a failure stops the downstream steps of the same run. Scalar columns go through
great-expectations suites; vector columns and cross-table identities through numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from updatelens.assets.check_catalog import (  # noqa: F401 - the stage assets call them as checks.<name>
    CHECK_DEFS,
    CHECKS,
    CheckDef,
    CheckSettings,
    Outcome,
    specs,
)
from updatelens.assets.expectations import Expect, Verdict, between, row_count, validate
from updatelens.config import AnalysisConfig
from updatelens.context_sources import DISTANCE_LABELS
from updatelens.findings import EXACT
from updatelens.fits import LOCAL_FITTERS, FitParams, LayerFit, refit_anchors, torch_dtype
from updatelens.geometry import CONTEXT_COLUMNS
from updatelens.models import LoadedModel
from updatelens.perturbation import OriginalOutput, Variant, patched_kl
from updatelens.steps.layer import LayerData
from updatelens.tables import to_matrix


def _finite_rows(matrix: np.ndarray) -> np.ndarray:
    return np.isfinite(matrix).all(axis=1)


def _ids(table: pa.Table, rows: Iterable[int], extra: dict[str, np.ndarray] | None = None) -> list[dict[str, object]]:
    out = []
    for i in list(rows)[:10]:
        row = {c: table[c][int(i)].as_py() for c in ("fn_class", "seq", "pos") if c in table.column_names}
        for key, values in (extra or {}).items():
            row[key] = float(values[int(i)])
        out.append(row)
    return out


@dataclass
class VectorScan:
    """A vector column of a stored partition checked a row group at a time (`add`), reported once
    with totals (`report`): length = d_model, finite rows, and optionally norms within a bound."""

    column: str
    d_model: int
    max_norm: float | None = None
    widths: set[int] = field(default_factory=set)
    n_bad: int = 0
    bad: list[dict[str, object]] = field(default_factory=list)
    n_big: int = 0
    big: list[dict[str, object]] = field(default_factory=list)

    def add(self, part: pa.Table) -> None:
        typ = part.schema.field(self.column).type
        width = typ.list_size if pa.types.is_fixed_size_list(typ) else -1
        self.widths.add(width)
        if width != self.d_model:
            return
        matrix = to_matrix(part[self.column], np.float64)
        rows = np.flatnonzero(~_finite_rows(matrix))
        self.n_bad += len(rows)
        self.bad += _ids(part, rows)
        if self.max_norm is not None:
            norms = np.linalg.norm(np.where(np.isnan(matrix), 0.0, matrix), axis=1)
            rows = np.flatnonzero(norms > self.max_norm)
            self.n_big += len(rows)
            self.big += _ids(part, rows, {"norm": norms})

    def report(self, verdict: Verdict) -> None:
        col, d = self.column, self.d_model
        lengths = ", ".join(str(w) for w in sorted(self.widths))
        verdict.expect(f"vector_length({col}) = {d}", self.widths == {d},
                       f"{col} vectors have length {lengths}, expected d_model = {d}")
        if self.widths != {d}:
            return
        verdict.expect(f"finite({col})", self.n_bad == 0, f"{col} has {self.n_bad} rows with NaN/Inf", self.bad[:10])
        if self.max_norm is not None:
            verdict.expect(f"norm({col}) <= {self.max_norm:g}", self.n_big == 0,
                           f"{col} has {self.n_big} rows with norm above {self.max_norm:g}", self.big[:10])


# ---- activations ----------------------------------------------------------------------------
def check_activations(parts: Iterable[pa.Table], cfg: AnalysisConfig, d_model: int, settings: CheckSettings) -> Verdict:
    """The stored partition, read a row group at a time (`parts`): memory holds one of them."""
    n_tokens = cfg.n_seq * cfg.seq_len
    n_kept = cfg.n_seq * (cfg.seq_len - (1 if cfg.skip_first_position else 0))
    scalars: list[pa.Table] = []
    scans = [VectorScan(column, d_model, settings.max_state_norm) for column in ("x", "y")]
    for part in parts:
        scalars.append(part.select(["seq", "pos", "token_id", "kept"]))
        for scan in scans:
            scan.add(part)
    frame = pa.concat_tables(scalars).to_pandas()
    verdict = validate(frame, [
        row_count(n_tokens),
        *between("seq", 0, cfg.n_seq - 1),
        *between("pos", 0, cfg.seq_len - 1),
        Expect("ExpectCompoundColumnsToBeUnique", {"column_list": ["seq", "pos"]}),
        Expect("ExpectColumnSumToBeBetween", {"column": "kept", "min_value": n_kept, "max_value": n_kept}),
    ])
    for scan in scans:
        scan.report(verdict)
    return verdict


def check_tokens(tokens: pa.Table, activations: pa.Table, cfg: AnalysisConfig) -> Verdict:
    """The `tokens` partition beside an activations partition (its seq, pos, token_id columns): one
    row with text per token of the sample, naming the same token ids at the same positions."""
    frame = tokens.select(["seq", "pos", "token_id", "token", "context"]).to_pandas()
    verdict = validate(frame, [
        row_count(cfg.n_seq * cfg.seq_len),
        Expect("ExpectColumnValuesToNotBeNull", {"column": "token"}),
        Expect("ExpectColumnValuesToNotBeNull", {"column": "context"}),
        Expect("ExpectCompoundColumnsToBeUnique", {"column_list": ["seq", "pos"]}),
    ])
    order = [("seq", "ascending"), ("pos", "ascending")]
    ours, theirs = tokens.sort_by(order), activations.sort_by(order)
    same = len(ours) == len(theirs) and all(ours[c].equals(theirs[c]) for c in ("seq", "pos", "token_id"))
    verdict.expect("tokens.token_id = activations.token_id", same,
                   "the tokens table names other tokens than the activations at the same (seq, pos)")
    return verdict


def check_against_hidden_states(lm: LoadedModel, input_ids: np.ndarray, tables: dict[int, pa.Table],
                                settings: CheckSettings) -> dict[int, Verdict]:
    """Recompute output_hidden_states for a few sequences; compare with the stored x and y."""
    n = min(settings.hidden_state_sequences, len(input_ids))
    ids = torch.as_tensor(input_ids[:n], device=lm.device)
    with torch.inference_mode():
        kwargs = {"attention_mask": torch.ones_like(ids)} if lm.allows_padding else {}
        hidden = lm.model(input_ids=ids, output_hidden_states=True, use_cache=False, **kwargs).hidden_states
    out: dict[int, Verdict] = {}
    for layer, table in tables.items():
        verdict = Verdict()
        sub = table.filter(pc.less(table["seq"], n)).sort_by([("seq", "ascending"), ("pos", "ascending")])
        for column, state in (("x", layer), ("y", layer + 1)):
            index = state - lm.hidden_states_offset  # position of h_state in the tuple
            if not 0 <= index < len(hidden) - 1:  # absent, or the last entry (final norm applied)
                verdict.cannot_check(f"{column} = h_{state}: output_hidden_states has no entry before the "
                                     f"final norm for it")
                continue
            typ = sub.schema.field(column).type
            if not (pa.types.is_fixed_size_list(typ) and typ.list_size == lm.d_model):
                verdict.expect(f"{column} width", False, f"stored {column} is {typ}, not vectors of d_model = "
                                                         f"{lm.d_model}: it cannot be compared")
                continue
            stored = to_matrix(sub[column], np.float64)
            ref = hidden[index].double().cpu().numpy().reshape(-1, lm.d_model)
            if stored.shape != ref.shape:
                verdict.expect(f"hidden_states[{index}] shape", False,
                               f"stored {column} has {stored.shape[0]} rows for the first {n} sequences, "
                               f"the model gives {ref.shape[0]}")
                continue
            # per row, relative to that row's own scale: a batch-wide scale is set by position 0's
            # outsized states and would hide an error elsewhere; position 0 itself is not compared
            scale = np.abs(ref).max(axis=1) + 1e-12
            err = np.abs(stored - ref).max(axis=1) / scale
            err[sub["pos"].to_numpy() == 0] = 0.0
            bad = np.flatnonzero(~(err <= settings.hidden_state_tol))
            verdict.expect(f"{column} == hidden_states[{index}] (tol {settings.hidden_state_tol:g})",
                           len(bad) == 0,
                           f"{column} differs from output_hidden_states[{index}] on {len(bad)} rows "
                           f"(max relative error {np.nanmax(err):.2e})", _ids(sub, bad, {"rel_err": err}))
        out[layer] = verdict
    return out


# ---- local fits -----------------------------------------------------------------------------
def check_fits(parts: Iterable[pa.Table], cfg: AnalysisConfig, d_model: int, settings: CheckSettings,
               n_kept: int) -> Verdict:
    """The stored partition, read a row group at a time (`parts`)."""
    scalars, scan = [], VectorScan("tx", d_model)
    for part in parts:
        scalars.append(part.select(["fn_class", "seq", "pos", "degenerate"]))
        scan.add(part)
    table = pa.concat_tables(scalars)
    verdict = validate(table.to_pandas(), [
        row_count(n_kept * len(cfg.classes)),
        Expect("ExpectColumnDistinctValuesToEqualSet", {"column": "fn_class", "value_set": list(cfg.classes)}),
        Expect("ExpectCompoundColumnsToBeUnique", {"column_list": ["fn_class", "seq", "pos"]}),
    ])
    scan.report(verdict)
    for fn_class in cfg.classes:
        part = table.filter(pc.equal(table["fn_class"], fn_class))
        frac = float(np.mean(part["degenerate"].to_numpy(zero_copy_only=False))) if len(part) else 1.0
        verdict.measured[f"degenerate_share({fn_class})"] = round(frac, 4)
        verdict.measured["degenerate_share_bound"] = settings.max_degenerate_frac
        verdict.expect(f"degenerate_share({fn_class}) <= {settings.max_degenerate_frac}",
                       frac <= settings.max_degenerate_frac,
                       f"{fn_class}: {frac:.1%} of fits are degenerate (bound {settings.max_degenerate_frac:.0%})")
    return verdict


def refit_audit(parts: Iterable[pa.Table], x: np.ndarray, y: np.ndarray, cfg: AnalysisConfig,
                settings: CheckSettings) -> Verdict:
    """Re-fit `audit_anchors` random anchors of each local class from the neighbours stored with them
    (`refit_anchors`: one plain call of the fitter) and compare with their stored T(x). Catches rows
    out of line with their neighbours or states, chunk or thread mix-ups and damaged vectors, which
    the range checks cannot see. `parts`: the stored partition (fn_class, neighbours, tx) row group
    by row group; x, y: the layer's kept states in the stored row order."""
    rng = np.random.default_rng([cfg.seed, 4099])
    rows = np.sort(rng.choice(len(x), size=min(settings.audit_anchors, len(x)), replace=False))
    seen: dict[str, int] = {}
    picked: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for part in parts:
        classes = part["fn_class"].to_numpy(zero_copy_only=False)
        for fn_class in dict.fromkeys(classes.tolist()):
            sub = part.filter(pc.equal(part["fn_class"], fn_class))
            lo = seen.get(fn_class, 0)
            seen[fn_class] = lo + len(sub)
            take = rows[(rows >= lo) & (rows < lo + len(sub))] - lo
            if fn_class not in LOCAL_FITTERS or not len(take):
                continue
            sub = sub.take(pa.array(take))
            nb = np.asarray(sub["neighbours"].combine_chunks().flatten().to_numpy(), dtype=np.int64)
            picked.setdefault(fn_class, []).append((nb.reshape(len(take), -1), to_matrix(sub["tx"], np.float64)))
    verdict = Verdict()
    params = FitParams(rank=cfg.rank, ridge=cfg.ridge, orthogonal_scale=cfg.orthogonal_scale)
    for fn_class in (c for c in cfg.classes if c in LOCAL_FITTERS):
        label = f"refit_audit({fn_class})"
        if fn_class not in picked or sum(len(nb) for nb, _ in picked[fn_class]) != len(rows):
            verdict.expect(label, False, f"{fn_class}: the stored partition lacks rows or neighbours of the "
                                         f"{len(rows)} audited anchors")
            continue
        nb = np.concatenate([n for n, _ in picked[fn_class]])
        stored = np.concatenate([t for _, t in picked[fn_class]])
        ref = refit_anchors(fn_class, x, y, nb, rows, params, torch_dtype(cfg.fit_dtype))
        err = np.linalg.norm(ref - stored, axis=1) / (np.linalg.norm(ref, axis=1) + 1e-30)
        finite_ref, finite_stored = np.isfinite(ref).all(axis=1), np.isfinite(stored).all(axis=1)
        ok = (finite_ref & finite_stored & (err <= settings.audit_tol)) | (~finite_ref & ~finite_stored)
        bad = np.flatnonzero(~ok)
        verdict.expect(label, len(bad) == 0,
                       f"{fn_class}: {len(bad)} of {len(rows)} re-fitted anchors differ from the stored T(x) "
                       f"(max relative difference {np.nanmax(err):.2e}, tolerance {settings.audit_tol:g})",
                       [{"fn_class": fn_class, "kept_row": int(rows[i]), "rel_diff": float(err[i])} for i in bad])
    return verdict


# ---- residuals ------------------------------------------------------------------------------
def check_reconstruction_gap(residuals: pa.Table, data: LayerData, fits: dict[str, LayerFit],
                             settings: CheckSettings) -> Verdict:
    """y = T(x) + r on the rows of one block (its residual vectors against the fits and states)."""
    verdict = Verdict()
    y = data.y.astype(np.float64)
    for fn_class, fit in fits.items():
        part = residuals.filter(pc.equal(residuals["fn_class"], fn_class))
        if not pa.types.is_fixed_size_list(part.schema.field("residual").type) or len(part) != len(y):
            verdict.expect(f"reconstruction({fn_class})", False,
                           f"{fn_class}: residual rows do not align with the kept tokens")
            continue
        r = to_matrix(part["residual"], np.float64)
        gap = np.linalg.norm(y - (fit.tx + r), axis=1) / (np.linalg.norm(y, axis=1) + 1e-30)
        bad = np.flatnonzero(~(gap <= settings.reconstruction_tol))
        verdict.expect(f"reconstruction({fn_class}): Δ_full = Δ_tok + r", len(bad) == 0,
                       f"{fn_class}: Δ_full != Δ_tok + r on {len(bad)} rows (max gap {np.nanmax(gap):.2e} "
                       f"of ||y||, tolerance {settings.reconstruction_tol:g})", _ids(part, bad, {"gap": gap}))
    return verdict


def check_reconstruction(residuals: pa.Table, n_kept: int, cfg: AnalysisConfig, gaps: Verdict) -> Verdict:
    """The stored scalar columns of a layer's residuals, and the per-block vector gaps (`gaps`)."""
    frame = residuals.select(["fn_class", "seq", "pos", "rel_err", "norm_full", "norm_tok", "norm_res"]).to_pandas()
    verdict = validate(frame, [row_count(n_kept * len(cfg.classes)),
                               *between("rel_err", 0), *between("norm_res", 0), *between("norm_full", 0)])
    rel = residuals["rel_err"].to_numpy()
    bad = np.flatnonzero(~np.isfinite(rel))
    verdict.expect("finite(rel_err)", len(bad) == 0, f"rel_err is not finite on {len(bad)} rows",
                   _ids(residuals, bad))
    _merge_by_label(verdict, gaps)
    return verdict


def _merge_by_label(verdict: Verdict, blocks: Verdict) -> None:
    """Expectations evaluated block by block, reported once per label (failures kept)."""
    for label in dict.fromkeys(blocks.evaluated):
        if label not in verdict.evaluated:
            verdict.evaluated.append(label)
    verdict.failures += blocks.failures
    verdict.offenders += blocks.offenders[:20]


def check_blown_up_fits(residuals: pa.Table, settings: CheckSettings) -> Verdict:
    """Residuals far longer than any update they could come from: ||r|| > max_residual_ratio x the larger
    of the layer's 99th-percentile ||Δ_full|| and the token's own ||Δ_full||. On SmolLM2 the largest ratio
    to the percentile over the default job's 30 layers and two classes was 4.1; one ill-conditioned
    lowrank neighbourhood at 8k tokens gave 26.7. The token's own update counts because a token with a
    massive activation (Gemma 3 270M layer 4: an update of 7 x the percentile) leaves a residual
    about as long as its update (1.5 x) when its fit is merely poor, not blown up."""
    verdict = Verdict()
    full = residuals["norm_full"].to_numpy()
    percentile = float(np.quantile(full[np.isfinite(full)], 0.99)) if len(full) else 0.0
    reference = np.maximum(np.nan_to_num(full, nan=0.0), max(percentile, 1e-30))
    res = residuals["norm_res"].to_numpy()
    ratio = res / reference
    bad = np.flatnonzero(ratio > settings.max_residual_ratio)
    worst = np.argsort(-ratio[bad])[:10]
    verdict.expect(f"||r|| <= {settings.max_residual_ratio:g} x max(p99 ||Δ_full||, own ||Δ_full||)", len(bad) == 0,
                   f"{len(bad)} residuals are longer than {settings.max_residual_ratio:g} x both the layer's "
                   f"99th-percentile update ({percentile:.3g}) and their own update; the longest "
                   f"{np.max(ratio) if len(ratio) else 0.0:.1f} x: a fit blew up",
                   _ids(residuals, bad[worst], {"norm_res": res, "ratio": ratio}))
    return verdict


DRIFT_QUANTILES = (0.1, 0.5, 0.9)


def _drift_quantiles(rel: np.ndarray) -> list[float]:
    return [float(q) for q in np.quantile(rel[np.isfinite(rel)], DRIFT_QUANTILES)]


def rel_err_quantiles(residuals: pa.Table) -> dict[str, list[float]]:
    """The relative error's DRIFT_QUANTILES per class of a residuals partition (fn_class, rel_err)."""
    return {fn_class: _drift_quantiles(residuals.filter(pc.equal(residuals["fn_class"], fn_class))["rel_err"].to_numpy())
            for fn_class in dict.fromkeys(residuals["fn_class"].to_pylist())}


def check_rel_err_drift(residuals: pa.Table, previous: dict[str, list[float]] | None,
                        settings: CheckSettings) -> Verdict:
    """The stored relative errors against the quantiles of the partition's previous materialization
    under the same configuration (GX quantile expectations, bounds +-rel_err_drift_tol relative)."""
    verdict = Verdict()
    if not previous:
        verdict.cannot_check("no previous materialization of this partition under this configuration to "
                             "compare the relative errors with")
        return verdict
    tol = settings.rel_err_drift_tol
    for fn_class, before in previous.items():
        part = residuals.filter(pc.equal(residuals["fn_class"], fn_class)).select(["seq", "pos", "rel_err"])
        if not len(part):
            continue
        ranges = [[q * (1 - tol), q * (1 + tol)] for q in before]
        result = validate(part.to_pandas(), [Expect("ExpectColumnQuantileValuesToBeBetween", {
            "column": "rel_err", "quantile_ranges": {"quantiles": list(DRIFT_QUANTILES), "value_ranges": ranges}})])
        verdict.evaluated.append(f"rel_err_drift({fn_class})")
        if not result.passed:
            now = _drift_quantiles(part["rel_err"].to_numpy())
            verdict.failures.append(
                f"{fn_class}: relative error quantiles (10/50/90 %) moved from "
                f"{', '.join(f'{q:.3g}' for q in before)} to {', '.join(f'{q:.3g}' for q in now)} "
                f"(tolerance {tol:.0%} of the previous materialization with this configuration)")
            verdict.offenders.append({"fn_class": fn_class, "before": before, "now": now})
    return verdict


def check_rel_err_bounds(residuals: pa.Table, settings: CheckSettings) -> Verdict:
    verdict = Verdict()
    medians = {}
    for fn_class in dict.fromkeys(residuals["fn_class"].to_pylist()):
        part = residuals.filter(pc.equal(residuals["fn_class"], fn_class))
        medians[fn_class] = float(np.median(part["rel_err"].to_numpy()))
    best = min(medians, key=lambda c: medians[c]) if medians else ""
    verdict.measured.update({f"rel_err_median({c})": round(m, 4) for c, m in medians.items()},
                            best_class=best, bound=settings.max_best_rel_err_median)
    ok = bool(medians) and medians[best] <= settings.max_best_rel_err_median
    verdict.expect(f"median rel_err of best class <= {settings.max_best_rel_err_median}", ok,
                   f"best class {best!r} has median relative error {medians.get(best, float('nan')):.3f} "
                   f"(bound {settings.max_best_rel_err_median})", [{"fn_class": c, "rel_err_median": m}
                                                                   for c, m in medians.items()])
    return verdict


# ---- geometry -------------------------------------------------------------------------------
def check_geometry(geometry: pa.Table, spectra: pa.Table, n_kept: int, classes: Sequence[str]) -> Verdict:
    """The stored geometry: one row per kept token (counted in the activations) and class, each once
    (a block lost or written twice by the streamed stage fails here), every value present and finite,
    in its range; the spectra non-negative and cumulated to at most 1."""
    # the estimator against the exact split: all null where no self-and-first output was captured
    absent = {c for c in CONTEXT_COLUMNS if c in geometry.column_names and geometry[c].null_count == len(geometry)}
    ranges = {c: (-1.0, 1.0) if c.startswith("cos_") else (0.0, 180.0) if c.startswith("angle_") else (0.0, 1.0 + 1e-9)
              for c in geometry.column_names if c.startswith(("cos_", "angle_", "proj_", "res_share")) and c not in absent}
    frame = geometry.select(["fn_class", "seq", "pos"]).to_pandas()
    # each row's columns that are missing, not finite or out of range, as one column: one expectation
    # (GX runs each expectation as a pass over the frame: one per column would make a pass per column)
    frame["out_of_range"] = _outside(geometry, ranges)
    verdict = validate(frame, [
        row_count(n_kept * len(classes)),
        Expect("ExpectColumnDistinctValuesToEqualSet", {"column": "fn_class", "value_set": list(classes)}),
        Expect("ExpectCompoundColumnsToBeUnique", {"column_list": ["fn_class", "seq", "pos"]}),
        Expect("ExpectColumnValuesToBeInSet", {"column": "out_of_range", "value_set": [""]}),
    ])
    verdict.merge(validate(spectra.select(["sigma", "cum_energy"]).to_pandas(),
                           [*between("sigma", 0.0), *between("cum_energy", 0.0, 1.0 + 1e-9)], ()))
    return verdict


SPECTRUM_ENERGY_RTOL = 1e-4  # float32 updates summed in float64 Grams agree to ~1e-6; one sequence of 16 is ~6 %


def check_spectra_energy(spectra: pa.Table, update_energy: float) -> Verdict:
    """The spectra of Δ_full hold every kept token's update once: the sum of their squared singular
    values (accumulated block by block in the stage's Gram matrices) equals sum ||y - x||^2 over the
    kept tokens of the stored activations, for every class. A block skipped, counted twice or paired
    with another layer's rows fails here (the token rows may still be right)."""
    verdict = Verdict()
    bad = []
    full = spectra.filter(pc.equal(spectra["which"], "full"))
    for fn_class in dict.fromkeys(full["fn_class"].to_pylist()):
        sigma = full.filter(pc.equal(full["fn_class"], fn_class))["sigma"].to_numpy()
        energy = float(np.sum(sigma.astype(np.float64) ** 2))
        if not abs(energy - update_energy) <= SPECTRUM_ENERGY_RTOL * update_energy:
            bad.append({"fn_class": fn_class, "spectrum_energy": energy, "update_energy": update_energy})
    verdict.expect("spectra of the update hold every token's update once", bool(len(full)) and not bad,
                   f"the spectrum of Δ_full sums to {bad[0]['spectrum_energy']:.6g} where the kept tokens' updates "
                   f"sum to {update_energy:.6g} (class {bad[0]['fn_class']})" if bad else "no spectrum of Δ_full stored",
                   bad)
    verdict.measured["update_energy"] = update_energy
    return verdict


def check_controls(geometry: pa.Table, spectra: pa.Table, n_kept: int, classes: Sequence[str],
                   expected: Sequence[str]) -> Verdict:
    """The stored positive controls: the configured controls the architecture has, each measured as
    `check_geometry` measures the real layer (one row per kept token and class, values in range)."""
    found = sorted(set(geometry["control"].to_pylist()))
    verdict = Verdict()
    verdict.expect("every positive control present", found == sorted(expected),
                   f"controls stored {found}, expected {sorted(expected)}",
                   [{"control": c, "problem": "missing" if c in expected else "not asked for"}
                    for c in sorted(set(found) ^ set(expected))])
    for control in [c for c in expected if c in found]:  # a missing one is named above, not measured empty
        rows = geometry.filter(pc.equal(geometry["control"], control)).drop_columns(["control"])
        spec = spectra.filter(pc.equal(spectra["control"], control)).drop_columns(["control"])
        measured = [EXACT] if control == EXACT else classes  # the exact split is its own class
        verdict.merge(check_geometry(rows, spec, n_kept, measured), prefix=f"{control}: ")
    return verdict


SPLIT_RTOL = 1e-6  # float64 norms of float32 vectors: the split's identity holds to ~1e-12 relative


def check_context_split(split: pa.Table, data: LayerData, expected: bool) -> Verdict:
    """The stored exact split (where the self-and-first control was captured): one row per kept token
    of the activations, in their order, whose ||Δ_full|| is the activations' ||y - x|| (a row paired
    with another token, layer or block fails here), cosines in [-1, 1], and the split adds up:
    ||Δ_full||² = ||Δ_ctl||² + ||a||² + 2 ||Δ_ctl|| ||a|| cos(a, Δ_ctl) (Δ_full = Δ_ctl + a)."""
    verdict = Verdict()
    if not expected:
        verdict.expect("no exact split without the self-and-first control", len(split) == 0,
                       f"{len(split)} context_split rows stored where no self-and-first control was captured")
        return verdict
    same_tokens = (len(split) == len(data.seq) and np.array_equal(split["seq"].to_numpy(), data.seq)
                   and np.array_equal(split["pos"].to_numpy(), data.pos))
    verdict.expect("context_split covers the kept tokens in order", same_tokens,
                   f"context_split has {len(split)} rows, the activations {len(data.seq)} kept tokens "
                   f"(or another order)")
    if not same_tokens:
        return verdict
    full = np.linalg.norm(data.y.astype(np.float64) - data.x, axis=1)
    stored = split["norm_full"].to_numpy()
    off = np.flatnonzero(~np.isclose(stored, full, rtol=SPLIT_RTOL, atol=1e-9))
    verdict.expect("norm_full is the activations' ||y - x||", len(off) == 0,
                   f"norm_full differs from the activations' ||y - x|| on {len(off)} tokens", _ids(split, off))
    n_ctl, n_ctx, cos = (split[c].to_numpy() for c in ("norm_ctl", "norm_ctx", "cos_ctx_ctl"))
    rebuilt = np.sqrt(np.maximum(n_ctl**2 + n_ctx**2 + 2 * n_ctl * n_ctx * cos, 0.0))
    gap = np.flatnonzero(~np.isclose(rebuilt, stored, rtol=1e-5, atol=1e-6 * float(np.median(stored) or 1.0)))
    verdict.expect("Δ_ctl + a = Δ_full", len(gap) == 0,
                   f"the split does not add up to Δ_full on {len(gap)} tokens", _ids(split, gap))
    ranges = {c: (-1.0, 1.0) for c in split.column_names if c.startswith("cos_")}
    ranges.update({c: (0.0, np.inf) for c in ("norm_ctl", "norm_ctx", "ctl_ratio", "ctx_ratio")})
    bad = np.flatnonzero(_outside(split, ranges) != "")
    verdict.expect("context_split values in range", len(bad) == 0,
                   f"{len(bad)} context_split rows with a value missing, not finite or out of range", _ids(split, bad))
    return verdict


HEADS_ATOL = 1e-3  # float32 parts of float32 states: the distance parts add up to a to ~1e-6 of ||a||^2


def check_context_heads(heads: pa.Table, data: LayerData, y_ctl: np.ndarray | None) -> Verdict:
    """The stored sources of the context part (where they were captured): a row per head, the heads'
    `together` row and a row per distance bin; each share the one the activations' per-token dot products
    give (a row moved to another head, bin or layer fails here); the distance parts adding up to a (their
    shares to 1) and `together` 1 less the heads'; each head's attention mass on the context, the first
    position and itself adding up to 1; intervals ordered."""
    verdict = Verdict()
    src = data.sources
    if src is None or y_ctl is None:
        verdict.expect("no context sources without their capture", len(heads) == 0,
                       f"{len(heads)} context_heads rows stored where no sources were captured")
        return verdict
    n_heads = src.n_heads
    want = [("head", str(h)) for h in range(n_heads)] + [("together", "all heads")] + \
        [("distance", label) for label in DISTANCE_LABELS]
    found = list(zip(heads["kind"].to_pylist(), heads["source"].to_pylist()))
    verdict.expect("context_heads holds each head, the heads together and each distance bin once", found == want,
                   f"context_heads rows {found}, expected {want}")
    if found != want:
        return verdict
    kept = data.kept
    a = data.y_full.astype(np.float64) - y_ctl.astype(np.float64)
    energy = float(np.einsum("std,std->st", a, a)[kept].sum()) or 1.0
    expected = np.concatenate([src.head_dot[kept].astype(np.float64).sum(0) / energy, [np.nan],
                               src.dist_dot[kept].astype(np.float64).sum(0) / energy])
    expected[n_heads] = 1.0 - expected[:n_heads].sum()
    share = heads["share"].to_numpy(zero_copy_only=False)
    off = np.flatnonzero(~np.isclose(share, expected, rtol=1e-6, atol=1e-9))
    verdict.expect("each share is the activations' <part, a> / ||a||^2", len(off) == 0,
                   f"{len(off)} context_heads shares differ from the activations' sources: rows {off.tolist()}")
    distance = float(share[n_heads + 1:].sum())
    verdict.expect("the distance parts add up to a", abs(distance - 1.0) <= HEADS_ATOL,
                   f"the distance bins' shares add up to {distance:.6f}, not 1")
    mass = heads.slice(0, n_heads)
    total = sum(mass[c].to_numpy(zero_copy_only=False) for c in ("mass", "mass_first", "mass_self"))
    bad = np.flatnonzero(~(np.abs(total - 1.0) <= HEADS_ATOL))
    verdict.expect("each head's attention mass adds up to 1", len(bad) == 0,
                   f"the attention mass of heads {bad.tolist()} adds up to {total[bad].round(6).tolist()}")
    lo, hi = heads["share_lo"].to_numpy(zero_copy_only=False), heads["share_hi"].to_numpy(zero_copy_only=False)
    disordered = np.flatnonzero(lo > hi)
    verdict.expect("share intervals ordered", len(disordered) == 0,
                   f"share_lo above share_hi on rows {disordered.tolist()}")
    n = heads["n_tokens"].to_numpy()
    verdict.expect("n_tokens is the layer's kept tokens", bool(np.all(n == int(kept.sum()))),
                   f"n_tokens {sorted(set(n.tolist()))}, the activations keep {int(kept.sum())}")
    return verdict


def _outside(table: pa.Table, ranges: dict[str, tuple[float, float]]) -> np.ndarray:
    """Per row, the names of the columns whose value is null, not finite or outside its [low, high]
    ("" where every one is in range)."""
    names = list(ranges)
    bad = np.zeros((len(table), len(names)), bool)
    for j, name in enumerate(names):
        low, high = ranges[name]
        values = table[name].to_numpy(zero_copy_only=False).astype(np.float64)
        bad[:, j] = ~(np.isfinite(values) & (values >= low) & (values <= high))
    labels = np.full(len(table), "", dtype=object)
    for row in np.flatnonzero(bad.any(axis=1)):
        labels[row] = ",".join(n for n, b in zip(names, bad[row]) if b)
    return labels


# ---- functional metrics ---------------------------------------------------------------------
def check_functional(fm: pa.Table, summary: pa.Table, settings: CheckSettings) -> Verdict:
    """KL finite; its sign before the clamp at 0 (`kl_raw_min` of the summary: a KL clearly below 0
    means the distributions are not normalised or not the same positions); the random-direction
    control's KL above a floor (a patch that is silently not applied gives 0 for every variant)."""
    kl = fm["kl"].to_numpy()
    bad = np.flatnonzero(~np.isfinite(kl))
    verdict = Verdict()
    verdict.expect("finite(kl)", len(bad) == 0, f"KL is not finite on {len(bad)} rows", _ids(fm, bad))
    rows = summary.select(["fn_class", "variant", "kl_raw_min", "kl_mean"]).to_pylist()
    negative = [r for r in rows if not r["kl_raw_min"] >= -settings.kl_rounding_tol]
    named = ", ".join(f"{r['variant']}/{r['fn_class']} {r['kl_raw_min']:.2e}" for r in negative)
    verdict.expect(f"KL before clamping >= -{settings.kl_rounding_tol:g}", not negative,
                   f"KL below 0 beyond rounding before the clamp: {named}", negative)
    random = [r for r in rows if r["variant"] == "random"]
    if random:
        flat = [r for r in random if not r["kl_mean"] > settings.min_random_kl]
        means = ", ".join(f"{r['kl_mean']:.2e}" for r in flat)
        verdict.expect(f"random control mean KL > {settings.min_random_kl:g} (patches applied)", not flat,
                       f"the random-direction control leaves the output unchanged (mean KL {means}): "
                       f"patches are not applied", flat)
    enough = summary.filter(pc.greater_equal(summary["n_tokens"], settings.min_tokens_spearman))
    if len(enough):
        verdict.merge(validate(enough.select(["fn_class", "variant", "spearman_relerr_kl", "spearman_normres_kl"]).to_pandas(),
                               [*between("spearman_relerr_kl", -1.0, 1.0), *between("spearman_normres_kl", -1.0, 1.0)],
                               ("fn_class", "variant")))
    return verdict


def check_identity_patch(lm: LoadedModel, data: LayerData, orig: OriginalOutput, batch: int,
                         returns_tuple: bool, settings: CheckSettings) -> Verdict:
    """Patch block l's output with its own true value on a few sequences: the KL must be 0."""
    n = min(settings.identity_sequences, len(data.input_ids))
    kl = patched_kl(lm, data.input_ids[:n], data.layer, [Variant("identity", "-", data.y_full[:n])],
                    orig.subset(slice(0, n)), batch, returns_tuple)[0]
    verdict = Verdict()
    verdict.expect(f"identity patch KL <= {settings.identity_kl_tol:g}", float(kl.max()) <= settings.identity_kl_tol,
                   f"identity patch at layer {data.layer} gives KL up to {kl.max():.2e}: the patching "
                   f"machinery does not reproduce the model")
    return verdict
