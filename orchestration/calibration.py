"""Calibration study: the estimator's power against the sample size and k (engine:
`updatelens.calibration`). One capture of the largest sample, then for each layer, size and k the
real update and the positive controls fitted and scored; the rows go to the partitioned table
`calibration` (<data root>/calibration/model=<m>/layer=<l>/), SQL view `calibration`. Run from the
CLI (`updatelens calibrate`) or as the Dagster job `calibrate`.

(No `from __future__ import annotations`: Dagster reads the op's config annotation at definition time.)"""

from collections.abc import Callable, Sequence

import dagster as dg
import polars as pl

from updatelens.assets.common import frame_table
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.calibration import DEFAULT_ANCHORS, DEFAULT_KS, DEFAULT_TOKENS, calibrate
from updatelens.config import preset_layers
from updatelens.errors import ConfigError
from updatelens.orchestration.runner import check_inputs
from updatelens.registry import DEFAULT_MODEL
from updatelens.tables import Provenance

STUDY = "calibration"


def plan_lens(lens: UpdateLensResource, tokens: Sequence[int], ks: Sequence[int]) -> UpdateLensResource:
    """The lens of the largest size (its sample holds every smaller one: the first n windows), checked
    before any weight is loaded: ConfigError names the problem."""
    base = lens.config()
    if not tokens or not ks:
        raise ConfigError("give at least one sample size (--tokens) and one k (--k)")
    bad = [t for t in tokens if t < base.seq_len or t % base.seq_len]
    if bad:
        raise ConfigError(f"sample sizes {bad}: each must be a multiple of seq_len={base.seq_len}")
    if min(ks) < 1:
        raise ConfigError(f"k must be >= 1, got {sorted(ks)}")
    # AnalysisSettings is made by pydantic.create_model: mypy cannot see its methods
    settings = {**lens.analysis.model_dump(), "n_seq": max(tokens) // base.seq_len,  # type: ignore[attr-defined]
                "k": max(ks)}
    largest = UpdateLensResource(**{**lens.model_dump(), "analysis": AnalysisSettings(**settings)})
    cfg = largest.config()
    cfg.validate()  # the largest k against the smallest size's candidates is checked per size below
    for n_tokens in tokens:
        cfg.replace(n_seq=n_tokens // base.seq_len).validate()
    return largest


def run_calibration(model: str, lens: UpdateLensResource, tokens: Sequence[int], ks: Sequence[int],
                    layers: Sequence[int] | None = None, n_anchors: int = DEFAULT_ANCHORS,
                    log: Callable[[str], None] = print) -> list[int]:
    """Capture, fit and score; write each layer's partition of `calibration`; the layers done."""
    largest = plan_lens(lens, tokens, ks)
    report = check_inputs(model, largest, list(layers) if layers else None)
    chosen = sorted(set(layers)) if layers else preset_layers("study", report.n_layers)
    bad = [layer for layer in chosen if layer >= report.n_layers]
    if bad:
        raise ConfigError(f"{model} has {report.n_layers} layers; layers {bad} do not exist")
    cfg = largest.config()
    lm = largest.load(model)
    sample = largest.sample(lm)
    prov = Provenance.of(lm.slug, lm.revision, sample.corpus, sample.slice_desc, cfg, lm.n_layers, lm.weights)
    sizes = [t // cfg.seq_len for t in tokens]
    tables = calibrate(lm, sample, cfg, prov, chosen, sizes, ks, n_anchors=n_anchors, log=log)
    store = largest.store
    for layer, table in tables.items():
        store.partition(STUDY, model, layer).write(table)
    store.refresh()
    return chosen


def calibration_table(lens: UpdateLensResource, model: str) -> pl.DataFrame:
    """The model's rows of the `calibration` view, rounded for display."""
    store = lens.store
    store.refresh()
    return store.query("SELECT layer, n_tokens, fn_class, k, target, round(rel_err_median, 3) AS rel_err, "
                       "round(rel_err_lo, 3) AS rel_lo, round(rel_err_hi, 3) AS rel_hi, "
                       "round(cos_full_tok_median, 3) AS cos, round(cos_lo, 3) AS cos_lo, round(cos_hi, 3) AS cos_hi, "
                       "finding_1 FROM calibration WHERE model = $1 ORDER BY layer, n_tokens, fn_class, k, target", [model])


class CalibrateConfig(dg.Config):
    """The study to run: model, sample sizes in tokens (multiples of seq_len; nested: the first n
    windows), neighbour counts, layers (empty: first, middle and last) and anchors scored per size."""

    model: str = DEFAULT_MODEL
    tokens: list[int] = list(DEFAULT_TOKENS)
    ks: list[int] = list(DEFAULT_KS)
    layers: list[int] = []
    anchors: int = DEFAULT_ANCHORS


@dg.op(description="Capture the largest sample once; for each layer, size and k fit the real update and the positive "
                   "controls (targets tokenwise by construction) and score them: table and SQL view `calibration`.")
def calibrate_sizes(context: dg.OpExecutionContext, config: CalibrateConfig, lens: UpdateLensResource) -> None:
    layers = run_calibration(config.model, lens, config.tokens, config.ks, config.layers or None, config.anchors,
                             log=context.log.info)
    table = calibration_table(lens, config.model)
    context.add_output_metadata({"layers": ", ".join(map(str, layers)), "rows": len(table),
                                 "calibration": frame_table(table)})


@dg.job(name="calibrate", description="The estimator's power: the real update and the positive controls fitted at "
                                      "growing sample sizes and neighbour counts; SQL view `calibration`.")
def calibrate_job() -> None:
    calibrate_sizes()
