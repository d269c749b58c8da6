"""Positive controls: what the estimator shows when the truth is tokenwise by construction.

A null says whether noise would look the same; a positive control says whether the local fits would
show the paper's structure if it were there (docs/method.md, "Positive controls"). Each control
replaces the real output y of block l by a target that maps each token by itself, and runs the same
fits (the same classes, on the same stored neighbours) and the same geometry as the real layer:

- `self_first`: block l on h_l with each token attending to itself and the window's first position (captured with the
  activations, column `y_ctl`): the model's own norms, MLP and nonlinearity, and no path between
  tokens. Attention architectures only (Mamba's mixer has no mask: no self-and-first stand-in).
- `linear`: x -> x + xB, B one ridge map per layer fitted on the update y - x of held-out windows (the
  windows after the sample, from documents the sample does not hold: `held_out_windows`), so the
  target is one tokenwise function that never saw the sample; the activations stage fits it
  (`updatelens.linear_control`) and stores x + xB per token as the activations' `y_lin`.

Beside them, always, the null target `unrelated` (`unrelated_target`): x -> x + the update of a token
of another document, so the target has the layer's own updates (their mean, spread and shape) and
no relation to x at all. The same fits on it say what the estimator reports when there is nothing
tokenwise to find: the null of findings 1 and 1 map (docs/method.md, "Nulls").

Its tables (`control_geometry`, `control_spectra`, `control_geometry_bootstrap`) are the geometry
stage's tables with a `control` column: the catalog renders the findings over them unchanged and
sets each finding's real value beside its controls'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pyarrow as pa

from updatelens.config import AnalysisConfig
from updatelens.findings import EXACT
from updatelens.fits import LayerFit, fit_layer
from updatelens.linear_control import made_controls
from updatelens.schemas import empty_table
from updatelens.stages import BY_NAME
from updatelens.steps.context_split import context_heads_table, context_split_tables
from updatelens.steps.geometry import geometry_tables
from updatelens.steps.layer import LayerData
from updatelens.tables import Provenance

CONTROL_TABLES = BY_NAME["controls"].tables  # control_geometry, control_spectra, control_geometry_bootstrap, context_*
MEASURED_TABLES = CONTROL_TABLES[:3]  # the geometry stage's tables, per control
SPLIT_TABLES = CONTROL_TABLES[3:5]  # the exact split by the self-and-first block
SOURCES_TABLE = CONTROL_TABLES[5]  # where its context part comes from, per head and source distance


NULL_TARGET = "unrelated"  # the findings' fitted null (updatelens.findings.Finding.null_target)
# the exact split measured as an estimator (findings.EXACT): the real layer, with the self-and-first output in
# the place of T(x) (Δ_tok = Δ_ctl, r = a, what attention to the context adds), its class and control so named


def unrelated_partners(doc: np.ndarray, seed: int) -> np.ndarray:
    """For each kept token, the row of a token of another document: the tokens grouped by document
    (each document's in a seeded random order), each paired with the token `m` places on in that
    order, cyclically, `m` the largest document's count. A bijection (every update is used once), and
    no token meets its own document: a block of at most m rows, shifted m places, lands outside itself
    (wrapping round, it lands before itself when no document holds more than half of the tokens)."""
    n = len(doc)
    counts = np.unique(doc, return_counts=True)[1]
    m = int(counts.max()) if n else 0
    if 2 * m > n:
        raise ValueError(f"the unrelated null target pairs each token with another document's: it needs no document "
                         f"to hold more than half of the kept tokens (the largest holds {m} of {n})")
    order = np.lexsort((np.random.default_rng([seed, 7121]).random(n), doc))
    partners = np.empty(n, dtype=np.int64)
    partners[order] = order[(np.arange(n) + m) % n]
    return partners


def unrelated_target(x: np.ndarray, y: np.ndarray, doc: np.ndarray, seed: int) -> np.ndarray:
    """x + (y - x) of another document's token (`unrelated_partners`), per kept token [N, d] float32:
    the layer's own updates, re-paired so that none belongs to its x."""
    partners = unrelated_partners(doc, seed)
    delta = y.astype(np.float64) - x.astype(np.float64)
    return (x.astype(np.float64) + delta[partners]).astype(np.float32)


def control_targets(data: LayerData, y_ctl: np.ndarray | None, cfg: AnalysisConfig) -> dict[str, np.ndarray]:
    """Each configured control's target over the full grid [n_seq, T, d] (kept positions filled; the
    others hold y, never read), then the null target `unrelated`. `y_ctl`: the stored self-and-first
    outputs [n_seq, T, d], None where the architecture has none: the linear control then stands in for it,
    read from the activations' `y_lin` (data.y_lin_full)."""
    out: dict[str, np.ndarray] = {}
    for control in [*made_controls(cfg.positive_controls, y_ctl is not None), NULL_TARGET]:
        if control == "self_first":
            if y_ctl is not None:
                out[control] = y_ctl
            continue
        grid = data.y_full.copy()
        if control == "linear":
            if data.y_lin_full is None:
                raise ValueError(f"layer {data.layer}: the linear control's target (the activations' y_lin, x + xB "
                                 f"with B fitted on held-out windows) was not captured; rerun the activations stage")
            grid[data.kept] = data.y_lin_full[data.kept]
        elif control == NULL_TARGET:
            grid[data.kept] = unrelated_target(data.x, data.y, data.doc, cfg.seed)
        else:
            raise ValueError(f"unknown positive control {control!r}")
        out[control] = grid
    return out


def made_targets(asked: tuple[str, ...], has_self_first: bool) -> list[str]:
    """What the controls stage measures: the positive controls made for `asked`, the null target, and
    the exact split where the self-and-first output was captured."""
    return [*made_controls(asked, has_self_first), NULL_TARGET, *([EXACT] if has_self_first else [])]


def exact_tables(data: LayerData, y_ctl: np.ndarray, cfg: AnalysisConfig,
                 prov: Provenance) -> tuple[pa.Table, pa.Table, pa.Table]:
    """The real layer measured by the geometry stage's code with the self-and-first output in the place of
    a fit (class `exact`): every geometric finding on the exact split, with its nulls: finding 1's pairs
    each token's full update with another document's tokenwise update (the fits' null target, without
    fits), the others are the geometry's own (the residual a turned to a direction of the layer's shape)."""
    n = len(data.seq)
    fit = LayerFit(EXACT, y_ctl[data.kept].astype(np.float64), np.ones(n), np.zeros(n, bool))
    return geometry_tables(data, {EXACT: fit}, cfg, prov, partners=unrelated_partners(data.doc, cfg.seed))


def control_tables(data: LayerData, y_ctl: np.ndarray | None, neighbours: np.ndarray | None,
                   cfg: AnalysisConfig, prov: Provenance) -> Iterator[tuple[str, tuple[pa.Table, pa.Table, pa.Table]]]:
    """(control, (per-token geometry, spectra, bootstrap statistics)) for each control: the target
    fitted by every configured class on the real layer's neighbours, then measured by the geometry
    stage's own code. One control's fits in memory at a time."""
    for control, target in control_targets(data, y_ctl, cfg).items():
        controlled = replace(data, y_full=target, y_ctl_full=None)  # a control's residual is not the layer's
        fits = {c: fit_layer(c, controlled.x, controlled.y, controlled.seq, neighbours, cfg) for c in cfg.classes}
        # the null target serves findings 1 and 1 map (cosines): its effective ranks' jackknife is not read
        measured = cfg.replace(jackknife_groups=0) if control == NULL_TARGET else cfg
        tables = geometry_tables(controlled, fits, measured, prov, null_spectra=False)
        geometry, spectra, resamples = (_with_control(t, control) for t in tables)
        yield control, (geometry, spectra, resamples)


def control_layer_tables(data: LayerData, y_ctl: np.ndarray | None, neighbours: np.ndarray | None,
                         cfg: AnalysisConfig, prov: Provenance,
                         log: Callable[[str], None] = lambda _msg: None) -> dict[str, pa.Table]:
    """The controls stage's tables of one layer (`control_geometry`, `control_spectra`,
    `control_geometry_bootstrap`: every control's rows; `context_split` and its resamples: the exact
    split by the self-and-first block where it was captured), or the empty table where none is made.
    The asset and the in-memory analysis (`updatelens.analysis.analyse_layer`) both build them here."""
    made: dict[str, list[pa.Table]] = {name: [] for name in CONTROL_TABLES}
    for control, tables in control_tables(data, y_ctl, neighbours, cfg, prov):
        log(f"layer {data.layer}: positive control {control} fitted and measured")
        for name, part in zip(MEASURED_TABLES, tables):
            made[name].append(part)
    if y_ctl is not None:
        for name, part in zip(MEASURED_TABLES, exact_tables(data, y_ctl, cfg, prov)):
            made[name].append(_with_control(part, EXACT))
        log(f"layer {data.layer}: the exact split measured")
        for name, part in zip(SPLIT_TABLES, context_split_tables(data, y_ctl, cfg, prov)):
            made[name].append(part)
        if data.sources is not None:
            made[SOURCES_TABLE].append(context_heads_table(data, y_ctl, cfg, prov))
    return {name: pa.concat_tables(parts) if parts else empty_table(name, cfg) for name, parts in made.items()}


def _with_control(table: pa.Table, control: str) -> pa.Table:
    """The table with `control` as its second column (after `layer`)."""
    return table.add_column(1, "control", pa.array([control] * len(table), pa.string()))
