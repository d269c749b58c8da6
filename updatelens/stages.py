"""The pipeline's stages, described once.

Everything that needs to know the stages reads this tuple: the Dagster assets (name, group, kinds,
upstream, checks, whether the step holds the model), the jobs, the storage layout (which tables a
stage writes), staleness (the last table of the last stage) and the tests. Adding a stage is one
entry here plus its module `assets/<name>.py` defining an asset function of the same name (and the
definitions of any new checks in `assets/checks.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # the asset's name, its module under assets/, and its tables' first entry
    group: str  # the asset group in the UI: capture, decomposition, analysis
    tables: tuple[str, ...]  # the Parquet tables it writes per (model, layer)
    needs_model: bool  # loads the model: the `model` pool, the GPU queue and pod size
    checks: tuple[str, ...]  # its asset checks (defined in assets/checks.py)
    kinds: tuple[str, ...]  # the technologies the UI shows on the asset
    description: str
    reads: tuple[str, ...] = ()  # the stages whose tables it reads: its Dagster dependencies, nothing else
    may_be_empty: bool = False  # writes no rows where the configuration asks for none (no positive controls)


STAGES: tuple[Stage, ...] = (
    Stage("activations", "capture", ("activations", "tokens"), True,
          ("activations_valid", "activations_match_hidden_states"), ("pytorch", "parquet"),
          "Raw block inputs/outputs (x = h_l, y = h_{l+1}) of every token of the corpus sample, captured "
          "with forward hooks; one row per (sequence, position). Table `tokens`: each token's text and "
          "its short left context."),
    Stage("local_fits", "decomposition", ("local_fits",), False,
          ("fits_valid", "fits_refit_audit"), ("faiss", "parquet"),
          "T(x) at every kept token for each function class, fitted on the token's k nearest neighbours "
          "(other sequences) and evaluated out of sample; fit condition numbers.", ("activations",)),
    Stage("residuals", "decomposition", ("residuals",), False,
          ("residuals_match_fits", "rel_err_within_bounds", "no_blown_up_fits", "rel_err_drift"), ("parquet",),
          "Residual r = y - T(x) per token and class, with ||Δ_full||, ||Δ_tok||, ||r|| and the relative "
          "error ||r|| / ||Δ_full||.", ("activations", "local_fits")),
    Stage("geometry", "analysis", ("geometry", "spectra", "geometry_bootstrap"), False,
          ("geometry_ranges",), ("parquet",),
          "Per token: cosines and angles between Δ_full, Δ_tok and r (update and map forms), projection "
          "energies on the top-m tokenwise subspace; per layer: singular spectra (table `spectra`) and the "
          "findings' statistics on bootstrap resamples (`geometry_bootstrap`).", ("activations", "local_fits")),
    Stage("controls", "calibration", ("control_geometry", "control_spectra", "control_geometry_bootstrap",
                                      "context_split", "context_split_bootstrap", "context_heads"), False,
          ("controls_valid",), ("parquet",),
          "Positive controls: the same classes, fitted on the same neighbours, to targets that are tokenwise "
          "by construction (block l with each token attending to itself and the window's first position; a "
          "linear map fitted without the token's document), measured like the real layer: the geometry tables "
          "with a `control` column. What the estimator shows when the paper's structure is there; and the null "
          "target `unrelated` (each x paired with another document's update): what it shows when nothing "
          "tokenwise is there, finding 1's null. Tables "
          "`context_split` and `context_split_bootstrap`: the exact split y = y_ctl + a of every update by the "
          "self-and-first block; `context_heads`: where a comes from, per attention head and source distance.",
          ("activations", "local_fits"), may_be_empty=True),
    Stage("functional_metrics", "analysis", ("functional_metrics", "functional_summary", "functional_bootstrap"),
          True, ("functional_valid",), ("pytorch", "parquet"),
          "Per token KL of the next-token distribution when block l's output is replaced by T(h_l) (residual "
          "removed), plus random-direction and cruder-class controls; per layer Spearman(error, KL) in table "
          "`functional_summary`.", ("activations", "local_fits")),
)

# the steps that hold a model and make its forward passes; every other step of a run (fits, residuals,
# geometry, reports) is work that no forward pass, however fast, takes off
MODEL_STEPS = frozenset(stage.name for stage in STAGES if stage.needs_model)

BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
STAGE_NAMES: tuple[str, ...] = tuple(BY_NAME)
TABLES_BY_STAGE: dict[str, tuple[str, ...]] = {s.name: s.tables for s in STAGES}
STAGE_OF_TABLE: dict[str, str] = {t: s.name for s in STAGES for t in s.tables}
# Every table the pipeline writes per (model, layer), in the stages' order.
TABLES: tuple[str, ...] = tuple(t for s in STAGES for t in s.tables)
# What a convention sweep stores per (configuration, model, layer): what the findings read, with
# their resamples (so that a setting's finding has an interval, paired with the baseline's), and the
# fits they are measured on (the patched passes read them back block by block).
SWEEP_TABLES: tuple[str, ...] = ("local_fits", "geometry", "spectra", "geometry_bootstrap", "functional_metrics",
                                 "functional_summary", "functional_bootstrap")
# Tables written per (model, layer) by a study outside the pipeline's stages (updatelens.calibration):
# verified and served like the stages' tables, never part of a layer's completeness.
STUDY_TABLES: tuple[str, ...] = ("calibration",)
# written by the last stage; whether a (model, layer) is complete is every table's presence
LAST_TABLE: str = STAGES[-1].tables[-1]


def upstream(name: str) -> tuple[Stage, ...]:
    """The stages whose tables `name` reads (a stage waits for these and no other): residuals,
    geometry and the output perturbation each read the activations and the local fits only."""
    return tuple(BY_NAME[s] for s in BY_NAME[name].reads)


def with_readers(stale: set[str]) -> list[str]:
    """The stale stages and every stage that reads their tables, directly or not, in the stages' order."""
    out = set(stale)
    for stage in STAGES:
        if out & set(stage.reads):
            out.add(stage.name)
    return [s.name for s in STAGES if s.name in out]
