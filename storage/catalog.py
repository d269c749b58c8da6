"""The DuckDB catalog: one view per table over its Parquet, plus derived views.

`layer_summary` is the public SQL interface: one row per (model, layer, fn_class, config_id);
`findings_by_class` and `findings` measure the paper's claims over it. Convention sweeps live in
their own tables (`sweep_geometry`, ...) with the same derived views prefixed `sweep_`, and
`sensitivity` shows how each finding moves with each convention.
Views are rebuilt after each materialization (and by `updatelens sql`), so they always cover
the partitions on disk; a view is created only for a table that has files.

On an object-store root (s3://...) DuckDB reads the Parquet through the root's fsspec filesystem,
registered on each connection (DuckDB's httpfs extension would need a download); the catalog file
is then not written (its views would only open where that filesystem is registered):
`connect()` / `query()` / `updatelens sql` build the views in memory instead.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

if TYPE_CHECKING:
    import polars as pl

from updatelens import CODE_VERSION, schemas
from updatelens.findings import (
    EXACT,
    FINDINGS,
    GEOMETRY_STATISTIC_DEFS,
    GEOMETRY_STATISTICS,
    JACKKNIFE_FIRST,
    SPLIT_STATISTICS,
    STATISTICS,
    Finding,
    aggregate_sql,
)
from updatelens.schemas import CONTROL_PREFIX
from updatelens.stages import STUDY_TABLES, SWEEP_TABLES, TABLES
from updatelens.storage.integrity import QUARANTINE, Damaged, scan
from updatelens.storage.layout import (
    CONVERGENCE,
    DAGSTER_DIR,
    LOCKS,
    STAGING,
    SWEEPS,
    has_sweep_runs,
    partition_file,
    sweep_runs_glob,
)
from updatelens.storage.location import RootLike, as_root, is_local, local_path, url
from updatelens.verdicts import (
    CONTROL_WORDS,
    NULL_WORDS,
    difference_outcome_sql,
    threshold_outcome_sql,
    verdict_sql,
)

CATALOG_FILE = "updatelens.duckdb"

# The statistics of the findings are rendered from their one declaration (findings.GEOMETRY_STATISTIC_DEFS),
# which the bootstrap recomputes on every resample.
LAYER_SUMMARY_GEOMETRY = """
SELECT model, layer, fn_class, config_id,
       any_value(model_revision) AS model_revision,
       any_value(weights) AS weights,
       any_value(corpus_slice) AS corpus_slice,
       any_value(k) AS k, any_value(rank) AS rank, any_value(dtype) AS dtype,
       any_value(code_version) AS code_version,
       count(*) AS n_tokens,
       avg(rel_err) AS rel_err_mean,
       median(cos_full_res) AS cos_full_res_median,
       median(angle_full_res) AS angle_full_res_median,
       avg(proj_full_m16) AS proj_full_m16,
       avg(proj_tok_m16) AS proj_tok_m16,
       any_value(m90_tok) AS m90_tok,
       any_value(model_layers) AS model_layers,
       {statistics}
FROM {{geometry}}
GROUP BY model, layer, fn_class, config_id
""".format(statistics=",\n       ".join(f"{aggregate_sql(column, how)} AS {name}"
                                        for name, column, how in GEOMETRY_STATISTIC_DEFS))

LAYER_SUMMARY_FUNCTIONAL = """
SELECT model, layer, fn_class, config_id,
       max(CASE WHEN variant = 'patch' THEN kl_mean END) AS kl_mean,
       max(CASE WHEN variant = 'patch' THEN kl_median END) AS kl_median,
       max(CASE WHEN variant = 'patch' THEN spearman_relerr_kl END) AS spearman_relerr_kl,
       max(CASE WHEN variant = 'patch' THEN spearman_normres_kl END) AS spearman_normres_kl,
       max(CASE WHEN variant = 'random' THEN kl_mean END) AS kl_mean_random_control,
       max(CASE WHEN variant = 'crude' THEN kl_mean END) AS kl_mean_crude_control,
       max(CASE WHEN variant = 'context' THEN kl_mean END) AS kl_mean_context,
       max(CASE WHEN variant = 'context' THEN spearman_normres_kl END) AS spearman_ctx_kl,
       max(CASE WHEN variant = 'random' THEN spearman_relerr_kl END) AS spearman_relerr_kl_null,
       max(CASE WHEN variant = 'random' THEN spearman_normres_kl END) AS spearman_normres_kl_null,
       max(CASE WHEN variant = 'patch' THEN kl_ratio_random END) AS kl_ratio_random,
       max(CASE WHEN variant = 'patch' AND n_later > 0 THEN kl_later_mean END) AS kl_later_mean,
       max(CASE WHEN variant = 'patch' AND n_later > 0 THEN kl_at_mean_on_later END) AS kl_at_mean_on_later,
       max(CASE WHEN variant = 'patch' AND n_later > 0 THEN spearman_kl_later END) AS spearman_kl_later
FROM {functional_summary}
GROUP BY model, layer, fn_class, config_id
"""

FUNCTIONAL_COLUMNS = ("kl_mean", "kl_median", "spearman_relerr_kl", "spearman_normres_kl",
                      "kl_mean_random_control", "kl_mean_crude_control", "kl_mean_context", "spearman_ctx_kl",
                      "spearman_relerr_kl_null",
                      "spearman_normres_kl_null", "kl_ratio_random", "kl_later_mean", "kl_at_mean_on_later",
                      "spearman_kl_later")

# Findings measured under another convention of docs/method.md than the main one:
# (finding id, the finding it re-measures, the convention, its setting here, the main setting).
ALTERNATIVE_MEASURES = (
    ("1 map", "1", "alignment form", "map: cos(y, T(x))", "update: cos(y - x, T(x) - x)"),
    ("2 angle vs tok", "2 angle", "angle reference", "against Δ_tok", "against Δ_full"),
    ("4 norm", "4", "error measure", "‖r‖", "relative error"),
    ("6 inner", "6", "edge layers", "without the two first and two last", "every layer"),
)

# The paper's findings, declared in `updatelens.findings` (claim, measure, threshold and its source),
# each measured per (model, config, class) in plain SQL over per-layer statistics, so a reader can see
# how every figure is derived. The statistics come once from `layer_summary` and `spectra` (replicate
# -1: the point estimate) and once per bootstrap resample of the documents from `layer_replicates`
# (replicate 0, 1, ...; the effective ranks on jackknife replicates -2, -3, ... instead); every finding
# is computed on each, and its 95% interval is the 2.5% and 97.5% quantiles of the resamples' values,
# or for a finding whose `interval` is 'jackknife' (finding 3) the point +- t times the jackknife's
# standard error (`jackknife_half_width`). `verdict`: see docs/method.md, "Verdicts"; NULL without
# resamples.
# `findings` keeps the class with the lowest median relative error.
POINT_STATS_SQL = """
SELECT ls.model, ls.config_id, ls.fn_class, ls.layer, -1 AS replicate, ls.model_layers,
       {columns}, r.rank_full, r.rank_tok, r.rank_res, r.rank_full_null, r.rank_res_null
FROM {layer_summary} ls LEFT JOIN (
    SELECT model, layer, config_id, fn_class,
           any_value(CASE WHEN which = 'full' THEN effective_rank END) AS rank_full,
           any_value(CASE WHEN which = 'tok' THEN effective_rank END) AS rank_tok,
           any_value(CASE WHEN which = 'res' THEN effective_rank END) AS rank_res,
           any_value(CASE WHEN which = 'full_null' THEN effective_rank END) AS rank_full_null,
           any_value(CASE WHEN which = 'res_null' THEN effective_rank END) AS rank_res_null
    FROM {spectra} GROUP BY model, layer, config_id, fn_class
) r USING (model, layer, config_id, fn_class)
"""

LAYER_REPLICATES_SQL = """
CREATE OR REPLACE VIEW {name} AS
SELECT g.model, g.config_id, g.fn_class, g.layer, g.replicate, g.model_layers,
       {geometry_columns}, f.spearman_relerr_kl, f.spearman_normres_kl,
       f.spearman_relerr_kl_null, f.spearman_normres_kl_null, f.kl_ratio_random,
       g.rank_full, g.rank_tok, g.rank_res, g.rank_full_null, g.rank_res_null
FROM {geometry_bootstrap} g LEFT JOIN {functional_bootstrap} f USING (model, layer, config_id, fn_class, replicate)
"""

# Each per-layer statistic of the findings with its 95% band over the resamples (the layer curves'
# shaded bands): `<statistic>_lo` and `<statistic>_hi` per (model, config, class, layer). The effective
# ranks' bands come from their jackknife replicates, centred on the replicates' mean (within O(1/G) of
# the curve's point).
LAYER_BANDS_SQL = """
CREATE OR REPLACE VIEW {name} AS
SELECT model, config_id, fn_class, layer, count(*) FILTER (WHERE replicate >= 0) AS n_resamples, {bands}
FROM {replicates}
GROUP BY model, config_id, fn_class, layer
ORDER BY model, config_id, layer, fn_class
"""

BAND_STATISTICS: tuple[str, ...] = (*GEOMETRY_STATISTICS, "spearman_relerr_kl", "spearman_normres_kl",
                                    "spearman_relerr_kl_null", "spearman_normres_kl_null", "kl_ratio_random",
                                    "rank_full", "rank_tok", "rank_res", "rank_full_null", "rank_res_null")

# A table, not a view: every finding on every resample is computed once, when the catalog is refreshed
# from the verified files, instead of in every query that reads
# the findings (the catalog's record of what was verified holds a digest of its rows: `_view_digest`).
FINDING_REPLICATES_SQL = """
CREATE OR REPLACE TABLE {name} AS
WITH stats AS ({stats}),
b AS (
    SELECT stats.*,
           max(model_layers) OVER (PARTITION BY model, config_id) AS n_layers,
           -- finding 6's null: the depth labels of the analysed layers shifted round by an offset of 1 to
           -- n - 1 places, one offset per replicate (deterministic: a hash of the replicate). A circular
           -- shift keeps neighbouring layers together (their statistics are correlated), which a free
           -- permutation would scatter, so the null keeps the depth profile's smoothness
           list_sort(list(layer) OVER w)[
               ((row_number() OVER (w ORDER BY layer) - 1
                 + 1 + CAST(hash(replicate, 'shift') % CAST(greatest(count(*) OVER w - 1, 1) AS UBIGINT) AS BIGINT))
                % count(*) OVER w) + 1] AS perm_layer
    FROM stats
    WINDOW w AS (PARTITION BY model, config_id, fn_class, replicate)
), f AS (
{findings}
)
-- a null measured by fitting (Finding.null_target): the same finding on the controls stage's null target,
-- replicate by replicate (the same resamples of the same documents)
SELECT f.* REPLACE (CASE WHEN f.null_target <> '' AND f.fn_class <> '{exact_class}' THEN n.value ELSE f.null_value END
                    AS null_value)
FROM f LEFT JOIN ({controls}) n
     ON n.control = f.null_target AND n.model = f.model AND n.config_id = f.config_id AND n.fn_class = f.fn_class
        AND n.finding = f.finding AND n.replicate = f.replicate
"""

# Each finding against its threshold, its null and its positive controls (docs/method.md, "Verdicts"):
# `threshold_outcome` (clears / misses / straddles: where the value's interval lies against the bound),
# `null_outcome` (beyond / opposite / indistinct: where the interval of the value minus its null lies,
# resample by resample), and per positive control (self_first, linear: the same finding over the
# control's tables, `{controls}`) its value, interval and the interval of the real value minus the
# control's (the same resamples: the control is measured on the same documents). The verdict's
# control is self_first where it exists, else linear (`control`, `control_threshold_outcome`,
# `control_outcome`: separates / same).
FINDINGS_BY_CLASS_SQL = """
CREATE OR REPLACE VIEW {name} AS
WITH f AS (SELECT * FROM {replicates}),
per_finding AS (
    SELECT model, config_id, fn_class, finding, any_value(statement) AS statement, any_value(measure) AS measure,
           any_value(threshold) AS threshold, any_value(op) AS op, any_value(bound) AS bound,
           any_value(threshold_source) AS threshold_source, any_value(null_source) AS null_source,
           any_value(control_role) AS control_role, any_value(interval) AS interval,
           any_value(layers) FILTER (WHERE replicate = -1) AS layers, any_value(n_layers) AS n_layers,
           any_value(note) FILTER (WHERE replicate = -1) AS note,
           max(value) FILTER (WHERE replicate = -1) AS value,
           quantile_cont(value, 0.025) FILTER (WHERE replicate >= 0) AS ci_lo,
           quantile_cont(value, 0.975) FILTER (WHERE replicate >= 0) AS ci_hi,
           coalesce(median(null_value) FILTER (WHERE replicate >= 0),
                    max(null_value) FILTER (WHERE replicate = -1)) AS null_value,
           quantile_cont(null_value, 0.025) FILTER (WHERE replicate >= 0) AS null_ci_lo,
           quantile_cont(null_value, 0.975) FILTER (WHERE replicate >= 0) AS null_ci_hi,
           -- the finding against its null, resample by resample (the same resample for both)
           quantile_cont(value - null_value, 0.025) FILTER (WHERE replicate >= 0) AS diff_ci_lo,
           quantile_cont(value - null_value, 0.975) FILTER (WHERE replicate >= 0) AS diff_ci_hi,
           count(value) FILTER (WHERE replicate >= 0) AS n_resamples,
           -- the delete-a-group jackknife (replicates <= -2, `interval` = 'jackknife'): its half-width
           max(null_value) FILTER (WHERE replicate = -1) AS null_point,
           count(value) FILTER (WHERE replicate <= {jackknife_first}) AS n_groups,
           {jk_value} AS half,
           {jk_null} AS null_half,
           {jk_diff} AS diff_half
    FROM f GROUP BY model, config_id, fn_class, finding
),
summary AS (
    SELECT * EXCLUDE (ci_lo, ci_hi, null_value, null_ci_lo, null_ci_hi, diff_ci_lo, diff_ci_hi, n_resamples,
                      null_point, n_groups, half, null_half, diff_half),
           CASE WHEN interval = 'jackknife' THEN value - half ELSE ci_lo END AS ci_lo,
           CASE WHEN interval = 'jackknife' THEN value + half ELSE ci_hi END AS ci_hi,
           CASE WHEN interval = 'jackknife' THEN null_point ELSE null_value END AS null_value,
           CASE WHEN interval = 'jackknife' THEN null_point - null_half ELSE null_ci_lo END AS null_ci_lo,
           CASE WHEN interval = 'jackknife' THEN null_point + null_half ELSE null_ci_hi END AS null_ci_hi,
           CASE WHEN interval = 'jackknife' THEN value - null_point - diff_half ELSE diff_ci_lo END AS diff_ci_lo,
           CASE WHEN interval = 'jackknife' THEN value - null_point + diff_half ELSE diff_ci_hi END AS diff_ci_hi,
           CASE WHEN interval = 'jackknife' THEN n_groups ELSE n_resamples END AS n_resamples
    FROM per_finding
),
ctl AS (
    SELECT c.model, c.config_id, c.fn_class, c.finding, c.control, any_value(f.interval) AS interval,
           max(c.value) FILTER (WHERE c.replicate = -1) AS value,
           max(f.value) FILTER (WHERE c.replicate = -1) AS real_value,
           quantile_cont(c.value, 0.025) FILTER (WHERE c.replicate >= 0) AS ci_lo,
           quantile_cont(c.value, 0.975) FILTER (WHERE c.replicate >= 0) AS ci_hi,
           quantile_cont(f.value - c.value, 0.025) FILTER (WHERE c.replicate >= 0) AS diff_ci_lo,
           quantile_cont(f.value - c.value, 0.975) FILTER (WHERE c.replicate >= 0) AS diff_ci_hi,
           {jk_c_value} AS half,
           {jk_c_diff} AS diff_half
    FROM ({controls}) c JOIN f USING (model, config_id, fn_class, finding, replicate)
    GROUP BY c.model, c.config_id, c.fn_class, c.finding, c.control
),
ctl_intervals AS (
    SELECT model, config_id, fn_class, finding, control, value,
           CASE WHEN interval = 'jackknife' THEN value - half ELSE ci_lo END AS ci_lo,
           CASE WHEN interval = 'jackknife' THEN value + half ELSE ci_hi END AS ci_hi,
           CASE WHEN interval = 'jackknife' THEN real_value - value - diff_half ELSE diff_ci_lo END AS diff_ci_lo,
           CASE WHEN interval = 'jackknife' THEN real_value - value + diff_half ELSE diff_ci_hi END AS diff_ci_hi
    FROM ctl
),
paired AS (
    SELECT s.*,
           so.value AS self_first_value, so.ci_lo AS self_first_ci_lo, so.ci_hi AS self_first_ci_hi,
           so.diff_ci_lo AS self_first_diff_ci_lo, so.diff_ci_hi AS self_first_diff_ci_hi,
           li.value AS linear_value, li.ci_lo AS linear_ci_lo, li.ci_hi AS linear_ci_hi,
           li.diff_ci_lo AS linear_diff_ci_lo, li.diff_ci_hi AS linear_diff_ci_hi,
           pc.control, pc.value AS control_value, pc.ci_lo AS control_ci_lo, pc.ci_hi AS control_ci_hi,
           pc.diff_ci_lo AS control_diff_ci_lo, pc.diff_ci_hi AS control_diff_ci_hi
    FROM summary s
    LEFT JOIN ctl_intervals so ON so.model = s.model AND so.config_id = s.config_id AND so.fn_class = s.fn_class
         AND so.finding = s.finding AND so.control = 'self_first' AND so.ci_lo IS NOT NULL
    LEFT JOIN ctl_intervals li ON li.model = s.model AND li.config_id = s.config_id AND li.fn_class = s.fn_class
         AND li.finding = s.finding AND li.control = 'linear' AND li.ci_lo IS NOT NULL
    LEFT JOIN ctl_intervals pc ON pc.model = s.model AND pc.config_id = s.config_id AND pc.fn_class = s.fn_class
         AND pc.finding = s.finding AND pc.ci_lo IS NOT NULL
         AND pc.control = CASE WHEN so.control IS NOT NULL THEN 'self_first' ELSE 'linear' END
),
outcomes AS (
    SELECT *,
           {threshold_outcome} AS threshold_outcome,
           {null_outcome} AS null_outcome,
           CASE WHEN control_role IN ('none', 'reference') THEN NULL
                ELSE {control_threshold_outcome} END AS control_threshold_outcome,
           CASE WHEN control_role IN ('none', 'reference') THEN NULL
                ELSE {control_outcome} END AS control_outcome
    FROM paired
)
SELECT model, config_id, fn_class, finding, statement, measure, value, threshold,
       CASE op WHEN '>=' THEN value >= bound AND value > null_value
               ELSE value <= bound AND value < null_value END AS holds,
       ci_lo, ci_hi, null_value, null_ci_lo, null_ci_hi, diff_ci_lo, diff_ci_hi, n_resamples, interval,
       {verdict} AS verdict,
       threshold_outcome, null_outcome, control_role, control, control_value, control_ci_lo, control_ci_hi,
       control_diff_ci_lo, control_diff_ci_hi, control_threshold_outcome, control_outcome,
       self_first_value, self_first_ci_lo, self_first_ci_hi, self_first_diff_ci_lo, self_first_diff_ci_hi,
       linear_value, linear_ci_lo, linear_ci_hi, linear_diff_ci_lo, linear_diff_ci_hi,
       threshold_source, null_source, layers, n_layers, note
FROM outcomes
ORDER BY model, config_id, fn_class, finding
"""

# The outcomes and the verdict, rendered from their one declaration (updatelens.verdicts)
OUTCOMES_SQL = {
    "threshold_outcome": threshold_outcome_sql("op", "bound", "ci_lo", "ci_hi"),
    "null_outcome": difference_outcome_sql("op", "diff_ci_lo", "diff_ci_hi", NULL_WORDS),
    "control_threshold_outcome": threshold_outcome_sql("op", "bound", "control_ci_lo", "control_ci_hi"),
    "control_outcome": difference_outcome_sql("op", "control_diff_ci_lo", "control_diff_ci_hi", CONTROL_WORDS),
    "verdict": verdict_sql(),
}

# t(0.975, nu) for nu = 1 .. 30 degrees of freedom (scipy.stats.t.ppf, to 6 decimals; a test checks them);
# beyond 30 the Cornish-Fisher series in the normal quantile is within 1e-6 of it
T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
        2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
        2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)
Z975 = 1.959963984540054


def t975_sql(nu: str) -> str:
    """SQL: t(0.975, nu) for an integer expression nu >= 1 (`T975`, then the Cornish-Fisher series)."""
    z = Z975
    series = (f"({z!r} + {z**3 + z!r} / (4 * {nu}) + {5 * z**5 + 16 * z**3 + 3 * z!r} / (96 * {nu} ^ 2) "
              f"+ {3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z!r} / (384 * {nu} ^ 3))")
    table = "[" + ", ".join(f"{t!r}" for t in T975) + "]"
    return f"(CASE WHEN {nu} <= {len(T975)} THEN {table}[{nu}] ELSE {series} END)"


def jackknife_half_width(expression: str, replicate: str = "replicate") -> str:
    """SQL aggregate: the half-width of the 95% delete-a-group jackknife interval of `expression` over the
    jackknife replicates (replicate <= -2; G of them with a finite value): t(0.975, G - 1) * sqrt((G - 1) / G
    * the sum of squared deviations from their mean); NULL with fewer than 2 groups."""
    finite = f"CASE WHEN isfinite({expression}) THEN {expression} END"
    jack = f"FILTER (WHERE {replicate} <= {JACKKNIFE_FIRST})"
    nu = f"(count({finite}) {jack} - 1)"
    return f"CASE WHEN {nu} >= 1 THEN {t975_sql(nu)} * sqrt({nu} * var_pop({finite}) {jack}) END"


# No positive controls in a family (sweeps): the relation of control replicates, empty.
NO_CONTROLS = ("SELECT NULL::VARCHAR AS model, NULL::VARCHAR AS config_id, NULL::VARCHAR AS control, "
               "NULL::VARCHAR AS fn_class, NULL::VARCHAR AS finding, NULL::INTEGER AS replicate, "
               "NULL::DOUBLE AS value WHERE false")
# The control family keys each control as a configuration of its own (`<config_id>/<control>`), so the
# findings are rendered over it unchanged; here the key is split back.
CONTROL_REPLICATES = ("SELECT model, split_part(config_id, '/', 1) AS config_id, split_part(config_id, '/', 2) AS control, "
                      "fn_class, finding, replicate, value FROM {prefix}control_finding_replicates")

FINDINGS_SQL = """
CREATE OR REPLACE VIEW {name} AS
WITH best AS (
    SELECT model, config_id, arg_min(fn_class, rel_err) AS fn_class
    FROM (SELECT model, config_id, fn_class, median(rel_err_median) AS rel_err FROM {layer_summary}
          GROUP BY model, config_id, fn_class)
    GROUP BY model, config_id
),
w AS (SELECT model, config_id, any_value(weights) AS weights FROM {layer_summary} GROUP BY model, config_id),
-- the exact split (estimator 'exact'): no estimator to limit it, so no control enters its verdict
exact AS (
    SELECT * REPLACE ('none' AS control_role, NULL AS control_threshold_outcome, NULL AS control_outcome)
    FROM ({exact}) WHERE value IS NOT NULL OR note IS NOT NULL
)
SELECT * FROM (
    SELECT f.*, w.weights, f.fn_class AS estimator FROM {by_class} f JOIN best USING (model, config_id, fn_class)
    LEFT JOIN w USING (model, config_id)
    UNION ALL BY NAME
    SELECT e.* REPLACE ({verdict} AS verdict), w.weights, '{exact_class}' AS estimator
    FROM exact e JOIN w USING (model, config_id)
)
ORDER BY model, config_id, finding, estimator = '{exact_class}'
"""

# Every pair of models side by side, finding by finding (each model on its best class, every
# configuration stored): both values with their intervals, their difference, and the difference's
# 95% interval. Resample b of a model draws documents by position with the configuration's seed, so
# two models that sampled the same documents (same corpus, same document in every window:
# `same_documents`) are paired resample by resample: the same documents drawn, a paired bootstrap.
# Where they sampled different documents, resample b of one is set against resample b + 1 of the
# other (independent draws: the same draw by position would tie unrelated documents together).
# Where the documents are not stored (no activations), the resamples are paired by number and
# `same_documents` is NULL. A finding read from delete-a-group jackknife replicates (finding 3) has no
# bootstrap resamples: with the same documents, group g of one model is set against group g of the
# other (the same documents left out: a paired jackknife of the difference); with different
# documents, the two jackknife half-widths add in quadrature (independent samples); either interval
# is centred on the difference of the points, as the findings' own jackknife intervals are. Where a paper's
# claim says which model should be higher (the larger model's Spearman in finding 4; the smaller
# model's diagonal-lowrank gap in finding 5), the interval says whether the two models separate.
ACROSS_MODELS_SQL = """
CREATE OR REPLACE VIEW findings_across_models AS
WITH best AS (SELECT model, config_id, fn_class, finding, value, ci_lo, ci_hi, verdict, n_layers FROM findings
              WHERE estimator <> '{exact_class}'),
best_replicates AS (
    SELECT r.model, r.config_id, r.finding, r.replicate, r.value
    FROM finding_replicates r JOIN best USING (model, config_id, fn_class, finding)
),
reps AS (SELECT * FROM best_replicates WHERE replicate >= 0),
jack AS (SELECT * FROM best_replicates WHERE replicate <= {jackknife_first}),
jack_one AS (
    SELECT model, config_id, finding, {jk_value} AS half FROM jack GROUP BY ALL
),
n_reps AS (SELECT model, config_id, finding, count(*) AS n FROM reps GROUP BY ALL),
sampled AS ({sampled}),
pairs AS (
    SELECT a.*, b.model AS model_b, b.config_id AS config_b, b.fn_class AS class_b, b.n_layers AS layers_b,
           b.value AS value_b, b.ci_lo AS ci_lo_b, b.ci_hi AS ci_hi_b, b.verdict AS verdict_b,
           CASE WHEN sa.docs IS NULL OR sb.docs IS NULL THEN NULL
                ELSE sa.corpus = sb.corpus AND sa.docs = sb.docs END AS same_documents
    FROM best a JOIN best b ON a.finding = b.finding AND a.model < b.model
    LEFT JOIN sampled sa ON sa.model = a.model AND sa.config_id = a.config_id
    LEFT JOIN sampled sb ON sb.model = b.model AND sb.config_id = b.config_id
),
boot AS (
    SELECT p.finding, p.model, p.config_id, p.model_b, p.config_b,
           quantile_cont(ra.value - rb.value, 0.025) AS lo, quantile_cont(ra.value - rb.value, 0.975) AS hi,
           count(rb.value) AS n_resamples
    FROM pairs p
    JOIN reps ra ON ra.model = p.model AND ra.config_id = p.config_id AND ra.finding = p.finding
    JOIN n_reps nb ON nb.model = p.model_b AND nb.config_id = p.config_b AND nb.finding = p.finding
    JOIN reps rb ON rb.model = p.model_b AND rb.config_id = p.config_b AND rb.finding = p.finding
                AND rb.replicate = CASE WHEN p.same_documents IS DISTINCT FROM false THEN ra.replicate
                                        ELSE (ra.replicate + 1) % nb.n END
    GROUP BY ALL
),
jack_paired AS (  -- group g against group g: only where both models left out the same documents
    SELECT p.finding, p.model, p.config_id, p.model_b, p.config_b,
           {jk_diff} AS half
    FROM pairs p
    JOIN jack ja ON ja.model = p.model AND ja.config_id = p.config_id AND ja.finding = p.finding
    JOIN jack jb ON jb.model = p.model_b AND jb.config_id = p.config_b AND jb.finding = p.finding
                AND jb.replicate = ja.replicate
    WHERE p.same_documents IS DISTINCT FROM false
    GROUP BY ALL
)
SELECT p.finding, p.model AS model_a, p.config_id AS config_a, p.fn_class AS class_a, p.n_layers AS layers_a,
       p.value AS value_a, p.ci_lo AS ci_lo_a, p.ci_hi AS ci_hi_a, p.verdict AS verdict_a,
       p.model_b, p.config_b, p.class_b, p.layers_b, p.value_b, p.ci_lo_b, p.ci_hi_b, p.verdict_b,
       p.value - p.value_b AS diff,
       CASE WHEN bt.n_resamples > 0 THEN bt.lo
            WHEN p.same_documents IS DISTINCT FROM false THEN p.value - p.value_b - jp.half
            ELSE p.value - p.value_b - sqrt(ja.half ^ 2 + jb.half ^ 2) END AS diff_ci_lo,
       CASE WHEN bt.n_resamples > 0 THEN bt.hi
            WHEN p.same_documents IS DISTINCT FROM false THEN p.value - p.value_b + jp.half
            ELSE p.value - p.value_b + sqrt(ja.half ^ 2 + jb.half ^ 2) END AS diff_ci_hi,
       coalesce(bt.n_resamples, 0) AS n_resamples, p.same_documents,
       CASE WHEN bt.n_resamples > 0 THEN
                CASE WHEN p.same_documents IS NULL THEN 'by resample number (documents not stored)'
                     WHEN p.same_documents THEN 'paired (same documents)'
                     ELSE 'independent (different documents)' END
            WHEN ja.half IS NULL OR jb.half IS NULL THEN NULL
            WHEN p.same_documents IS NULL THEN 'jackknife by group number (documents not stored)'
            WHEN p.same_documents THEN 'paired jackknife (same documents)'
            ELSE 'independent jackknifes (different documents)' END AS resampling
FROM pairs p
LEFT JOIN boot bt ON bt.finding = p.finding AND bt.model = p.model AND bt.config_id = p.config_id
                 AND bt.model_b = p.model_b AND bt.config_b = p.config_b
LEFT JOIN jack_paired jp ON jp.finding = p.finding AND jp.model = p.model AND jp.config_id = p.config_id
                        AND jp.model_b = p.model_b AND jp.config_b = p.config_b
LEFT JOIN jack_one ja ON ja.model = p.model AND ja.config_id = p.config_id AND ja.finding = p.finding
LEFT JOIN jack_one jb ON jb.model = p.model_b AND jb.config_id = p.config_b AND jb.finding = p.finding
ORDER BY p.finding, model_a, p.model_b
"""
# the documents each (model, configuration) sampled, window by window, from the stored activations
SAMPLED_SQL = ("SELECT model, config_id, any_value(corpus) AS corpus, "
               "list(DISTINCT (seq, doc) ORDER BY (seq, doc)) AS docs FROM activations GROUP BY model, config_id")
NO_SAMPLED_SQL = ("SELECT NULL::VARCHAR AS model, NULL::VARCHAR AS config_id, NULL::VARCHAR AS corpus, "
                  "NULL::STRUCT(seq INTEGER, doc INTEGER)[] AS docs WHERE false")

# How each finding moves with each convention. Three kinds of rows:
#   a convention swept as a configuration (sweep_runs: one config per setting), measured on the
#   baseline's best class; `class`: the baseline configuration, every class; and the measurement
#   conventions (ALTERNATIVE_MEASURES), which every run computes both ways.
# Each finding of a convention sweep under each swept setting, against the sweep's own baseline.
# Every configuration of a sweep resamples the same documents (same seed), so resample b of a
# setting is paired with resample b of the baseline: `delta_ci_lo/hi` is the 95% interval of the
# paired difference, `separates` says it excludes zero, and `flips` says the verdict differs from
# the baseline's AND the difference separates (a verdict that changes within the noise does not flip).
SENSITIVITY_SQL = """
CREATE OR REPLACE VIEW sensitivity AS
WITH measures(alt, finding, convention, setting, main_setting) AS (VALUES {measures}),
bases AS (SELECT DISTINCT model, base_config_id AS config_id FROM sweep_runs),
base AS (SELECT f.* FROM sweep_findings f JOIN bases USING (model, config_id)),
rows AS (
    -- one convention changed, on the baseline's class
    SELECT r.model, b.finding, r.convention, r.setting, r.config_id, b.fn_class, b.finding AS source,
           r.base_config_id
    FROM sweep_runs r
    JOIN base b ON b.model = r.model AND b.config_id = r.base_config_id
    WHERE r.convention <> 'class'
    UNION ALL
    -- every class measured (the baseline's and the class runs')
    SELECT r.model, f.finding, 'class', f.fn_class, f.config_id, f.fn_class, f.finding, r.base_config_id
    FROM (SELECT DISTINCT model, config_id, base_config_id FROM sweep_runs
          WHERE convention = 'class' OR config_id = base_config_id) r
    JOIN sweep_findings_by_class f ON f.model = r.model AND f.config_id = r.config_id
    WHERE f.finding NOT IN (SELECT alt FROM measures)
    UNION ALL
    -- a measure's other convention, measured by every run (e.g. finding 1 in map form)
    SELECT b.model, m.finding, m.convention, m.setting, b.config_id, b.fn_class, m.alt, b.config_id
    FROM base b JOIN measures m ON b.finding = m.alt
),
paired AS (
    -- resample b of the setting against resample b of the baseline; a jackknife finding (3): group g
    -- against group g (the same sample, so the same documents left out)
    SELECT rows.model, rows.finding, rows.convention, rows.setting, rows.config_id, rows.fn_class,
           quantile_cont(rr.value - br.value, 0.025) FILTER (WHERE rr.replicate >= 0) AS q_lo,
           quantile_cont(rr.value - br.value, 0.975) FILTER (WHERE rr.replicate >= 0) AS q_hi,
           {jk_delta} AS half
    FROM rows
    JOIN base ON base.model = rows.model AND base.config_id = rows.base_config_id AND base.finding = rows.finding
    JOIN sweep_finding_replicates rr ON rr.model = rows.model AND rr.config_id = rows.config_id
         AND rr.fn_class = rows.fn_class AND rr.finding = rows.source AND rr.replicate <> -1
    JOIN sweep_finding_replicates br ON br.model = base.model AND br.config_id = base.config_id
         AND br.fn_class = base.fn_class AND br.finding = base.finding AND br.replicate = rr.replicate
    GROUP BY ALL
),
deltas AS (
    SELECT rows.model, rows.finding, rows.convention, rows.setting, rows.config_id, rows.fn_class,
           f.value, f.ci_lo, f.ci_hi, f.holds, f.verdict,
           base.value AS baseline_value, base.verdict AS baseline_verdict, base.holds AS baseline_holds,
           f.value - base.value AS delta,
           CASE WHEN f.interval = 'jackknife' THEN f.value - base.value - p.half ELSE p.q_lo END AS delta_ci_lo,
           CASE WHEN f.interval = 'jackknife' THEN f.value - base.value + p.half ELSE p.q_hi END AS delta_ci_hi
    FROM rows
    JOIN base ON base.model = rows.model AND base.config_id = rows.base_config_id AND base.finding = rows.finding
    JOIN sweep_findings_by_class f ON f.model = rows.model AND f.config_id = rows.config_id
         AND f.fn_class = rows.fn_class AND f.finding = rows.source
    LEFT JOIN paired p ON p.model = rows.model AND p.finding = rows.finding AND p.convention = rows.convention
         AND p.setting = rows.setting AND p.config_id = rows.config_id AND p.fn_class = rows.fn_class
    WHERE rows.finding NOT IN (SELECT alt FROM measures)
)
SELECT *, delta_ci_lo > 0 OR delta_ci_hi < 0 AS separates,
       verdict IS DISTINCT FROM baseline_verdict AND coalesce(delta_ci_lo > 0 OR delta_ci_hi < 0, false) AS flips
FROM deltas
ORDER BY model, finding, convention, setting
"""


def context_split_summary_sql() -> str:
    """Per (model, layer, configuration): the exact split's medians over the kept tokens with their 95 %
    bootstrap intervals over documents (the 2.5 % and 97.5 % quantiles of the resamples' medians)."""
    points = ", ".join(f"{aggregate_sql(column, how)} AS {name}" for name, column, how in SPLIT_STATISTICS)
    bands = ", ".join(f"quantile_cont({name}, 0.025) AS {name}_lo, quantile_cont({name}, 0.975) AS {name}_hi"
                      for name, _, _ in SPLIT_STATISTICS)
    return f"""
CREATE OR REPLACE VIEW context_split_summary AS
WITH point AS (
    SELECT model, layer, config_id, any_value(model_revision) AS model_revision, any_value(weights) AS weights,
           any_value(corpus_slice) AS corpus_slice, any_value(code_version) AS code_version, count(*) AS n_tokens,
           {points}
    FROM context_split GROUP BY model, layer, config_id
), bands AS (
    SELECT model, layer, config_id, count(*) AS n_resamples, {bands}
    FROM context_split_bootstrap GROUP BY model, layer, config_id
)
SELECT * FROM point LEFT JOIN bands USING (model, layer, config_id)
ORDER BY model, config_id, layer
"""


def catalog_path(root: RootLike) -> Path | None:
    """The DuckDB file with the views, for a local root; None on an object store."""
    root = as_root(root)
    return local_path(root) / CATALOG_FILE if is_local(root) else None


def _sql_string(value: object) -> str:
    """A SQL string literal (quotes doubled), for view text that cannot take parameters."""
    return "'" + str(value).replace("'", "''") + "'"


def _read_parquet(files: list[str], hive_types: str) -> str:
    """The table expression over an explicit list of verified files (hive keys read from their paths)."""
    listed = ", ".join(_sql_string(f) for f in files)
    return (f"read_parquet([{listed}], hive_partitioning = true, union_by_name = true, "
            f"hive_types = {{{hive_types}}})")


def _parquet_view(name: str, files: list[str], hive_types: str, select: str = "*") -> str:
    """A view over an explicit list of verified files."""
    return f"CREATE OR REPLACE VIEW {name} AS SELECT {select} FROM {_read_parquet(files, hive_types)}"


# Per-token tables whose views carry each token (`token_id`, `token`, `context`) from `tokens`. The
# others stay plain: layer_summary and the findings aggregate `geometry` and need no join.
WITH_TEXT = ("residuals", "functional_metrics")


def _text_view(name: str, files: list[str], hive_types: str) -> str:
    """A per-token view with the token's text joined from the `tokens` view (same model, layer,
    corpus slice, sequence and position)."""
    return (f"CREATE OR REPLACE VIEW {name} AS SELECT m.*, t.token_id, t.token, t.context FROM "
            f"{_read_parquet(files, hive_types)} m LEFT JOIN tokens t ON t.model = m.model AND t.layer = m.layer "
            f"AND t.corpus_slice = m.corpus_slice AND t.seq = m.seq AND t.pos = m.pos")


MAIN_HIVE = "'model': VARCHAR, 'layer': INTEGER"
SWEEP_HIVE = "'config': VARCHAR, 'model': VARCHAR, 'layer': INTEGER"  # rows carry config_id: `config=` dropped
CONV_HIVE = "'n_seq': INTEGER, 'model': VARCHAR, 'layer': INTEGER"  # n_seq is part of config_id: dropped


def damaged_view_sql(damaged: list[Damaged]) -> str:
    """`damaged_partitions(path, table_name, model, layer, reason)`: the files the views leave out,
    and the `tokens` partitions whose absence leaves the text columns NULL."""
    if not damaged:
        return ("CREATE OR REPLACE VIEW damaged_partitions AS SELECT NULL::VARCHAR AS path, NULL::VARCHAR AS "
                "table_name, NULL::VARCHAR AS model, NULL::INTEGER AS layer, NULL::VARCHAR AS reason WHERE false")
    rows = ", ".join(f"({_sql_string(d.path)}, {_sql_string(d.table)}, {_sql_string(d.model)}, {d.layer}, "
                     f"{_sql_string(d.reason)})" for d in damaged)
    return f"CREATE OR REPLACE VIEW damaged_partitions AS SELECT * FROM (VALUES {rows}) t(path, table_name, model, layer, reason)"


# Each finding of a convergence study at each sample size, with its interval.
CONVERGENCE_SQL = """
CREATE OR REPLACE VIEW convergence AS
WITH sizes AS (
    SELECT model, config_id,
           CAST(json_extract(any_value(config_json), '$.n_seq') AS INTEGER)
         * CAST(json_extract(any_value(config_json), '$.seq_len') AS INTEGER) AS n_tokens,
           array_to_string(list_sort(list_distinct(list(layer))), ',') AS layers
    FROM conv_geometry_bootstrap GROUP BY model, config_id
)
SELECT f.model, f.config_id, f.finding, f.fn_class, s.n_tokens, f.value, f.ci_lo, f.ci_hi, f.verdict,
       f.threshold, s.layers
FROM conv_findings_by_class f JOIN sizes s USING (model, config_id)
ORDER BY f.model, f.finding, f.fn_class, s.n_tokens
"""


def layer_summary_sql(has_functional: bool, prefix: str = "") -> str:
    geometry = LAYER_SUMMARY_GEOMETRY.format(geometry=f"{prefix}geometry")
    if has_functional:
        functional = LAYER_SUMMARY_FUNCTIONAL.format(functional_summary=f"{prefix}functional_summary")
        return (f"CREATE OR REPLACE VIEW {prefix}layer_summary AS SELECT g.*, "
                f"{', '.join('f.' + c for c in FUNCTIONAL_COLUMNS)} "
                f"FROM ({geometry}) g LEFT JOIN ({functional}) f "
                f"USING (model, layer, fn_class, config_id) ORDER BY model, layer, fn_class")
    nulls = ", ".join(f"CAST(NULL AS DOUBLE) AS {c}" for c in FUNCTIONAL_COLUMNS)
    return (f"CREATE OR REPLACE VIEW {prefix}layer_summary AS SELECT g.*, {nulls} "
            f"FROM ({geometry}) g ORDER BY model, layer, fn_class")


def _finding_select(f: Finding) -> str:
    """One finding's rows over `b` (the per-layer statistics with n_layers, the model's depth, and
    perm_layer): one per (model, config, replicate, class), with the value and its null. A finding
    that aggregates over layers is NULL, with a note, where its layers are too few (Finding.coverage)."""
    constants = (f"{_sql_string(f.id)} AS finding, {_sql_string(f.claim)} AS statement, "
                 f"{_sql_string(f.measure)} AS measure, {_sql_string(f.threshold)} AS threshold, "
                 f"{_sql_string(f.op)} AS op, CAST({f.bound!r} AS DOUBLE) AS bound, "
                 f"{_sql_string(f.source)} AS threshold_source, {_sql_string(f.null_source)} AS null_source, "
                 f"{_sql_string(f.control_role)} AS control_role, {_sql_string(f.interval)} AS interval, "
                 f"{_sql_string(f.null_target)} AS null_target")
    covered = f"({f.coverage})"
    note = (f"CASE WHEN NOT {covered} THEN {_sql_string(f.coverage_note)} || ' (layers analysed: ' || "
            f"array_to_string(list_sort(list(DISTINCT layer)), ',') || ' of ' || any_value(n_layers) || ')' END")
    measured = (f"CASE WHEN {covered} THEN {f.value} END AS value, CASE WHEN {covered} THEN {f.null} END AS null_value, "
                f"array_to_string(list_sort(list(DISTINCT layer)), ',') AS layers, any_value(n_layers) AS n_layers, "
                f"{note} AS note")
    if f.scope == "class":
        return (f"    SELECT model, config_id, replicate, fn_class, {constants}, {measured}\n"
                f"    FROM b GROUP BY model, config_id, replicate, fn_class")
    return (f"    SELECT c.model, c.config_id, c.replicate, c.fn_class, {constants}, m.value, m.null_value, m.layers,\n"
            f"           m.n_layers, m.note\n"
            f"    FROM (SELECT model, config_id, replicate, {measured} FROM b GROUP BY model, config_id, replicate) m\n"
            f"    JOIN (SELECT DISTINCT model, config_id, replicate, fn_class FROM b) c USING (model, config_id, replicate)\n"
            f"    WHERE m.value IS NOT NULL OR m.note IS NOT NULL")


def findings_select() -> str:
    """Every finding of `updatelens.findings`, rendered as one UNION ALL."""
    return "\n    UNION ALL\n".join(_finding_select(f) for f in FINDINGS)


def findings_sql(prefix: str = "", with_replicates: bool = False, controls: str = NO_CONTROLS) -> list[str]:
    """The findings views of one family; with its bootstrap tables, the `layer_replicates` view too.
    `controls`: the relation of the family's positive controls' finding replicates (none: empty)."""
    columns = ", ".join(f"ls.{c}" for c in STATISTICS)
    stats = POINT_STATS_SQL.format(columns=columns, layer_summary=f"{prefix}layer_summary", spectra=f"{prefix}spectra")
    statements = []
    if with_replicates:
        statements.append(LAYER_REPLICATES_SQL.format(name=f"{prefix}layer_replicates",
                                                      geometry_columns=", ".join(f"g.{c}" for c in GEOMETRY_STATISTICS),
                                                      geometry_bootstrap=f"{prefix}geometry_bootstrap",
                                                      functional_bootstrap=f"{prefix}functional_bootstrap"))
        bands = ", ".join(
            f"avg({c}) FILTER (WHERE replicate <= {JACKKNIFE_FIRST}) - {jackknife_half_width(c)} AS {c}_lo, "
            f"avg({c}) FILTER (WHERE replicate <= {JACKKNIFE_FIRST}) + {jackknife_half_width(c)} AS {c}_hi"
            if c.startswith("rank_")
            else f"quantile_cont({c}, 0.025) FILTER (WHERE replicate >= 0) AS {c}_lo, "
                 f"quantile_cont({c}, 0.975) FILTER (WHERE replicate >= 0) AS {c}_hi"
            for c in BAND_STATISTICS)
        statements.append(LAYER_BANDS_SQL.format(name=f"{prefix}layer_bands", bands=bands,
                                                 replicates=f"{prefix}layer_replicates"))
        stats += f" UNION ALL BY NAME SELECT * FROM {prefix}layer_replicates"
    return [*statements,
            FINDING_REPLICATES_SQL.format(name=f"{prefix}finding_replicates", stats=stats, findings=findings_select(),
                                          controls=controls, exact_class=EXACT),
            FINDINGS_BY_CLASS_SQL.format(name=f"{prefix}findings_by_class", replicates=f"{prefix}finding_replicates",
                                         controls=controls, jackknife_first=JACKKNIFE_FIRST,
                                         jk_value=jackknife_half_width("value"),
                                         jk_null=jackknife_half_width("null_value"),
                                         jk_diff=jackknife_half_width("value - null_value"),
                                         jk_c_value=jackknife_half_width("c.value", "c.replicate"),
                                         jk_c_diff=jackknife_half_width("f.value - c.value", "c.replicate"),
                                         **OUTCOMES_SQL),
            FINDINGS_SQL.format(name=f"{prefix}findings", by_class=f"{prefix}findings_by_class",
                                layer_summary=f"{prefix}layer_summary", exact=exact_findings(prefix, controls),
                                exact_class=EXACT, verdict=OUTCOMES_SQL["verdict"])]


def exact_findings(prefix: str, controls: str) -> str:
    """The relation of the exact split's findings in a family (its controls' `exact` rows, keyed back to
    the configuration), or an empty one where the family has no controls."""
    if controls == NO_CONTROLS:
        return f"SELECT * FROM {prefix}findings_by_class WHERE false"
    return (f"SELECT * REPLACE (split_part(config_id, '/', 1) AS config_id) FROM {prefix}{CONTROL_PREFIX}findings_by_class "
            f"WHERE split_part(config_id, '/', 2) = '{EXACT}'")


def sensitivity_sql() -> str:
    measures = ", ".join("(" + ", ".join("'" + v.replace("'", "''") + "'" for v in m) + ")"
                         for m in ALTERNATIVE_MEASURES)
    return SENSITIVITY_SQL.format(measures=measures, jk_delta=jackknife_half_width("rr.value - br.value", "rr.replicate"))


DERIVED_VIEWS = ("layer_summary", "layer_replicates", "layer_bands", "finding_replicates", "findings_by_class",
                 "findings")
# the derived relations computed into tables (FINDING_REPLICATES_SQL), per family prefix
DERIVED_TABLES = ("finding_replicates",)
FAMILY_PREFIXES = ("", "sweep_", "conv_", "control_", "conv_control_")
# the positive controls' tables (updatelens.steps.controls): the geometry stage's tables, one per control
CONTROL_TABLES = tuple(t for t in TABLES if t.startswith(CONTROL_PREFIX))
PLAIN_TABLES = tuple(t for t in TABLES if t not in CONTROL_TABLES)


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list[object] | None = None) -> tuple[Any, ...]:
    """The single row of an aggregate query."""
    row = con.execute(sql, params or []).fetchone()
    assert row is not None, sql
    return row


def _drop(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Drop the view or table `name` if there is one (a catalog of an older version may hold as a
    view what is now a table)."""
    if _one(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [name])[0]:
        con.execute(f"DROP TABLE {name}")
    con.execute(f"DROP VIEW IF EXISTS {name}")


def _create_family(con: duckdb.DuckDBPyConnection, present: set[str], prefix: str,
                   controls: str = NO_CONTROLS) -> list[str]:
    """layer_summary, findings_by_class and findings over one family of tables (main or sweep_).
    Where every stored file of a table predates a column the derived views read (results of an older
    version, all stale, while a run recomputes them), the derived views are left out until the
    rerun has written files with it: the per-table views still answer."""
    views = []
    try:
        if "geometry" in present:
            con.execute(layer_summary_sql("functional_summary" in present, prefix))
            views.append(f"{prefix}layer_summary")
        if {"geometry", "functional_summary", "spectra"} <= present:
            replicates = {"geometry_bootstrap", "functional_bootstrap"} <= present
            _drop(con, f"{prefix}finding_replicates")  # a table now: an older catalog's view goes first
            for statement in findings_sql(prefix, replicates, controls):
                con.execute(statement)
            views += [f"{prefix}layer_replicates", f"{prefix}layer_bands"] * replicates + [f"{prefix}finding_replicates",
                                                                   f"{prefix}findings_by_class", f"{prefix}findings"]
    except duckdb.BinderException:
        views = []
    for name in DERIVED_VIEWS:
        if f"{prefix}{name}" not in views:
            _drop(con, f"{prefix}{name}")
    return views


def column_comments(con: duckdb.DuckDBPyConnection, view: str, table: str) -> list[str]:
    """The statements that give each column of a table's view its declared description
    (updatelens.schemas) as a DuckDB comment: `SELECT column_name, comment FROM duckdb_columns() WHERE
    table_name = 'geometry'`, or a SQL client's column list, says what a column means. The joined
    token text is described as in `tokens`."""
    names = [row[0] for row in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?",
                                           [view]).fetchall()]
    return [f"COMMENT ON COLUMN {view}.{name} IS {_sql_string(text)}" for name in names
            if (text := schemas.describe_column(table, name) or schemas.describe_column("tokens", name))]


def _comment(con: duckdb.DuckDBPyConnection, views: dict[str, str]) -> None:
    """Every column comment of `views` (view -> its table) in one transaction: one by one, each
    would commit to the catalog file on its own, many times slower."""
    statements = [st for view, table in views.items() for st in column_comments(con, view, table)]
    con.execute("BEGIN TRANSACTION")
    for statement in statements:
        con.execute(statement)
    con.execute("COMMIT")


def _family_views(con: duckdb.DuckDBPyConnection, good: dict[str, list[str]], tables: tuple[str, ...],
                  prefix: str, hive: str, select: str = "*") -> set[str]:
    """One view per table with verified files (the others dropped); the tables that have one."""
    present = set()
    for table in tables:
        if table in good and _create_view(con, f"{prefix}{table}", good[table],
                                          functools.partial(_parquet_view, f"{prefix}{table}", hive_types=hive,
                                                            select=select)):
            present.add(table)
        else:
            con.execute(f"DROP VIEW IF EXISTS {prefix}{table}")
    return present


def _control_family(con: duckdb.DuckDBPyConnection, files: dict[str, list[str]], present: set[str], prefix: str,
                    hive: str, exclude: str = "") -> tuple[list[str], str]:
    """The positive controls' views of one family (main: prefix "", convergence: "conv_"): one view per
    control table, keyed `<config_id>/<control>` (so the findings render over them unchanged), the
    findings over them (`{prefix}control_findings_by_class`, ...), and the relation of their finding
    replicates for the family's own findings (NO_CONTROLS where there are none)."""
    select = f"* {exclude} REPLACE (config_id || '/' || control AS config_id)"
    made = _family_views(con, files, CONTROL_TABLES, prefix, hive, select)
    family = {t[len(CONTROL_PREFIX):] for t in made}
    for table in ("functional_summary", "functional_bootstrap"):  # no KL is measured on a control
        if table in present:
            con.execute(f"CREATE OR REPLACE VIEW {prefix}{CONTROL_PREFIX}{table} AS SELECT * FROM {prefix}{table} WHERE false")
            family.add(table)
        else:
            con.execute(f"DROP VIEW IF EXISTS {prefix}{CONTROL_PREFIX}{table}")
    views = [f"{prefix}{t}" for t in CONTROL_TABLES if t in made]
    derived = _create_family(con, family, f"{prefix}{CONTROL_PREFIX}") if made else []
    for name in DERIVED_VIEWS:
        if f"{prefix}{CONTROL_PREFIX}{name}" not in derived:
            _drop(con, f"{prefix}{CONTROL_PREFIX}{name}")
    controls = (CONTROL_REPLICATES.format(prefix=prefix) if f"{prefix}{CONTROL_PREFIX}finding_replicates" in derived
                else NO_CONTROLS)
    return views + derived, controls


def _create_view(con: duckdb.DuckDBPyConnection, name: str, files: list[str], sql: Callable[[list[str]], str]) -> bool:
    """Create a view over `files`; False if none is left. DuckDB opens the files when the view is
    created: a run replacing a partition at that moment (its old file moved aside after this process
    verified it) makes the creation fail; the files still in place are then used (the partition being
    replaced shows again once its run commits)."""
    for _ in range(3):
        try:
            con.execute(sql(files))
            return True
        except duckdb.IOException:
            files = [f for f in files if as_root(f).exists()]
            if not files:
                return False
    con.execute(sql(files))
    return True


@dataclass
class Verified:
    """The partition files under a root that verify, per family (main tables, sweeps, convergence
    sizes) and table, and those that do not."""

    main: dict[str, list[str]]
    sweeps: dict[str, list[str]]
    convergence: dict[str, list[str]]
    damaged: list[Damaged]
    missing_text: list[Damaged]  # layers whose per-token views would show NULL text: no verified `tokens`


def _partition_of(file: str) -> tuple[str, int]:
    """(model, layer) of a partition file's url."""
    path = as_root(file)
    return path.parent.parent.name.split("=", 1)[1], int(path.parent.name.split("=", 1)[1])


def missing_text(root: RootLike, good: dict[str, list[str]]) -> list[Damaged]:
    """The (model, layer)s with a per-token table that joins its text (WITH_TEXT) but no verified
    `tokens` partition: their `token` and `context` would be NULL without a word."""
    have = {_partition_of(f) for f in good.get("tokens", [])}
    wanting = sorted({_partition_of(f) for table in WITH_TEXT for f in good.get(table, [])} - have)
    return [Damaged(url(partition_file(root, "tokens", model, layer)), "tokens", model, layer,
                    f"missing: the token text (token, context) of {' and '.join(WITH_TEXT)} is NULL for this layer")
            for model, layer in wanting]


def _hive_value(file: str, key: str) -> str:
    """The value of `key=value` among a file url's directories."""
    return next(part.split("=", 1)[1] for part in file.split("/") if part.startswith(f"{key}="))


def listed_sweeps(files: dict[str, list[str]], runs: list[str]) -> dict[str, list[str]]:
    """The sweep partitions of the (model, configuration)s a finished sweep lists: `runs` are the
    sweep_runs records, written after all of a sweep's tables, so a sweep in progress or cut short
    shows none of its tables."""
    listed = {(_hive_value(r, "model"), _hive_value(r, "config")) for r in runs}
    return {table: [f for f in found if (_hive_value(f, "model"), _hive_value(f, "config")) in listed]
            for table, found in files.items()}


def verify_root(root: RootLike, full: bool = False) -> Verified:
    """Every partition file of every family under the root, checked (storage.integrity; `full`: every
    checksum recomputed, as `updatelens verify` does)."""
    main, damaged = scan(root, TABLES + STUDY_TABLES, full=full)
    sweeps, sweep_damaged = scan(root, SWEEP_TABLES, f"{SWEEPS}/config=*/", full)
    convergence, conv_damaged = scan(root, TABLES, f"{CONVERGENCE}/n_seq=*/", full)
    return Verified(main, sweeps, convergence, damaged + sweep_damaged + conv_damaged, missing_text(root, main))


def create_views(con: duckdb.DuckDBPyConnection, root: RootLike) -> list[str]:
    """(Re)create on `con` the views of every table with verified files; drop the others. Files whose
    Parquet footer does not read are left out and listed in `damaged_partitions`."""
    return _create_views(con, root)[0]


def _create_views(con: duckdb.DuckDBPyConnection, root: RootLike) -> tuple[list[str], list[str]]:
    """The views created, and every file they read."""
    root = as_root(root)
    if not is_local(root):
        con.register_filesystem(root.fs)
    verified = verify_root(root)
    present = _family_views(con, verified.main, PLAIN_TABLES + STUDY_TABLES, "", MAIN_HIVE)
    if "tokens" in present:
        for table in (t for t in WITH_TEXT if t in present):
            _create_view(con, table, verified.main[table], functools.partial(_text_view, table, hive_types=MAIN_HIVE))
    runs = [url(f) for f in sorted(root.glob(sweep_runs_glob()), key=str)] if has_sweep_runs(root) else []
    sweeps = listed_sweeps(verified.sweeps, runs)
    swept = _family_views(con, sweeps, SWEEP_TABLES, "sweep_", SWEEP_HIVE, "* EXCLUDE (config)")
    if runs:  # an explicit file list: the read-only engine opens only listed files
        listed = ", ".join(_sql_string(f) for f in runs)
        con.execute(f"CREATE OR REPLACE VIEW sweep_runs AS SELECT * FROM read_parquet([{listed}], union_by_name = true)")
    else:
        con.execute("DROP VIEW IF EXISTS sweep_runs")
    control_views, controls = _control_family(con, verified.main, present, "", MAIN_HIVE)
    views = [t for t in PLAIN_TABLES + STUDY_TABLES if t in present] + control_views + _create_family(con, present, "", controls)
    views += [f"sweep_{t}" for t in SWEEP_TABLES if t in swept] + _create_family(con, swept, "sweep_")
    conv_files = {t: f for t, f in verified.convergence.items() if t != "activations"}  # results, not states
    converged = _family_views(con, conv_files, PLAIN_TABLES, "conv_", CONV_HIVE, "* EXCLUDE (n_seq)")
    conv_control_views, conv_controls = _control_family(con, conv_files, converged, "conv_", CONV_HIVE, "EXCLUDE (n_seq)")
    views += ([f"conv_{t}" for t in PLAIN_TABLES if t in converged] + conv_control_views
              + _create_family(con, converged, "conv_", conv_controls))
    if "findings" in views:
        con.execute(ACROSS_MODELS_SQL.format(sampled=SAMPLED_SQL if "activations" in views else NO_SAMPLED_SQL,
                                             jackknife_first=JACKKNIFE_FIRST, exact_class=EXACT,
                                             jk_value=jackknife_half_width("value"),
                                             jk_diff=jackknife_half_width("ja.value - jb.value", "ja.replicate")))
        views.append("findings_across_models")
    else:
        con.execute("DROP VIEW IF EXISTS findings_across_models")
    if "conv_findings_by_class" in views and "conv_geometry_bootstrap" in views:
        con.execute(CONVERGENCE_SQL)
        views.append("convergence")
    else:
        con.execute("DROP VIEW IF EXISTS convergence")
    if runs and "sweep_findings" in views:
        con.execute(sensitivity_sql())
        views += ["sweep_runs", "sensitivity"]
    else:
        con.execute("DROP VIEW IF EXISTS sensitivity")
    if {"context_split", "context_split_bootstrap"} <= present:
        con.execute(context_split_summary_sql())
        views.append("context_split_summary")
    else:
        con.execute("DROP VIEW IF EXISTS context_split_summary")
    con.execute(damaged_view_sql(verified.damaged + verified.missing_text))
    made_controls = {t for t in CONTROL_TABLES if t in control_views}
    families = (("", present | made_controls, TABLES + STUDY_TABLES), ("sweep_", swept, SWEEP_TABLES),
                ("conv_", converged, PLAIN_TABLES))
    _comment(con, {f"{prefix}{t}": t for prefix, made, tables in families for t in tables if t in made})
    read = [f for family in (verified.main, sweeps, conv_files) for files in family.values() for f in files]
    return [*views, "damaged_partitions"], read + runs


def catalog_error(db_path: Path) -> str | None:
    """Why the catalog file cannot be used (None: absent, in use by another process, or a DuckDB
    database holding views only, as the catalog does). It holds no data: a damaged or foreign one is
    moved aside and rebuilt (`refresh`)."""
    if not db_path.exists():
        return None
    try:
        with duckdb.connect(str(db_path), read_only=True) as con:
            tables = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name NOT IN "
                                 f"({', '.join(_sql_string(n) for n in _derived_table_names())})").fetchone()
    except duckdb.Error as exc:
        message = str(exc).splitlines()[0]
        if "lock" in message.lower():  # open in another process (a `duckdb` shell): busy, not damaged
            return None
        return f"not a readable DuckDB database ({message})"
    if tables and tables[0]:
        return (f"holds {tables[0]} tables of its own: not an UpdateLens catalog, which holds views and the "
                f"tables it derives ({', '.join(_derived_table_names())})")
    return None


def _derived_table_names() -> list[str]:
    return [f"{prefix}{name}" for prefix in FAMILY_PREFIXES for name in DERIVED_TABLES]


def _set_aside(root: RootLike, db_path: Path, reason: str) -> Path:
    """Move a damaged or foreign catalog (and its write-ahead log) to the quarantine; never deleted."""
    target = local_path(as_root(root)) / QUARANTINE / time.strftime("%Y%m%dT%H%M%S") / db_path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(db_path, target)
    wal = db_path.with_name(db_path.name + ".wal")
    if wal.exists():
        os.replace(wal, target.with_name(wal.name))
    warnings.warn(f"the catalog {db_path} was {reason}; moved it to {target} and rebuilt it", stacklevel=3)
    return target


def refresh(root: RootLike, db_path: Path | None = None, wait: bool = True) -> list[str]:
    """Rebuild the catalog file's views; returns the view names (object store: checked in memory).
    The new catalog is built in a file of its own and renamed over the old one: a reader with the
    old one open keeps reading it, and no reader's lock on it can make a writer's refresh fail.
    A damaged or foreign catalog file is set aside first (it holds only views and derived tables).
    Beside it, the record of what was verified (`VERIFIED_SUFFIX`): the stored files' fingerprint
    taken before verifying, the files the views read and the views' definitions, so that a query
    finding the same files unchanged reads the catalog without verifying them again. `wait=False`:
    BlockingIOError at once when another process is refreshing it."""
    db_path = db_path or catalog_path(root)
    if db_path is None:
        with duckdb.connect() as con:
            return create_views(con, root)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    # One refresh at a time (each builds the whole catalog; the last to finish is the current one).
    with open(db_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        verified = _verified_path(db_path)
        verified.unlink(missing_ok=True)  # the record never outlives the views it describes
        if reason := catalog_error(db_path):
            _set_aside(root, db_path, reason)
        fingerprint = root_fingerprint(root)  # before verifying: a file changed meanwhile does not match later
        building = db_path.with_name(f"{db_path.name}.{os.getpid()}.building")
        # only a refresh holding the lock builds: any other building file is a killed refresh's
        for stale in db_path.parent.glob(f"{glob.escape(db_path.name)}.*.building*"):
            stale.unlink(missing_ok=True)
        try:
            with duckdb.connect(str(building)) as con:
                views, readable = _create_views(con, root)
            with duckdb.connect(str(building), read_only=True) as con:  # the definitions as a reader reads them back
                definitions = _view_digest(con)
        except BaseException:  # a full disk, an interrupt: no half-built catalog is left behind
            for part in (building, building.with_name(building.name + ".wal")):
                part.unlink(missing_ok=True)
            raise
        db_path.with_name(db_path.name + ".wal").unlink(missing_ok=True)  # an old log would replay onto it
        os.replace(building, db_path)
        record = {"code_version": CODE_VERSION, "root": root_identity(root), "fingerprint": fingerprint,
                  "views": definitions, "readable": readable}
        tmp = verified.with_name(verified.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, verified)
        return views


# ---- queries without verifying again what has not changed ----------------------------------------
VERIFIED_SUFFIX = ".verified.json"
# under a local root, what the fingerprint leaves out: what is not a stored result
NOT_RESULTS = frozenset({QUARANTINE, STAGING, LOCKS, DAGSTER_DIR, "_notebook", "reports", "bench"})


def _verified_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + VERIFIED_SUFFIX)


def root_fingerprint(root: RootLike) -> str:
    """SHA-256 of (path, size, modification time) of every file under a local root's result folders
    (the partitions, their manifests, stray files, sweep records): any file written, replaced,
    touched, added or removed changes it; it reads no file's contents."""
    top = local_path(as_root(root))
    entries = []
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath == str(top):
            dirnames[:] = [d for d in dirnames if d not in NOT_RESULTS]
            continue  # the catalog's own files
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            entries.append(f"{os.path.relpath(path, top)}\t{st.st_size}\t{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()


def root_identity(root: RootLike) -> str:
    """Which folder a local root is: its real path and its inode. A copy (`cp -a` keeps every file's
    size and time, so the fingerprint alone would match) or a moved root is another folder: its
    catalog, whose views name the files it was built over, is verified again and rebuilt over its
    own files before it serves a query."""
    top = local_path(as_root(root))
    st = os.stat(top)
    return f"{os.path.realpath(top)}\t{st.st_dev}\t{st.st_ino}"


def _view_digest(con: duckdb.DuckDBPyConnection) -> str:
    """SHA-256 of every view's definition and of every table's name and rows (the derived tables: a
    row changed by a plain DuckDB client after the refresh changes it)."""
    views = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
    names = [row[0] for row in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
    rows = [[name, *_one(con, f"SELECT count(*), bit_xor(hash(t)) FROM {name} t")] for name in names]
    return hashlib.sha256(json.dumps([views, rows], default=str).encode()).hexdigest()


def _verified_catalog(root: RootLike) -> tuple[duckdb.DuckDBPyConnection, list[str]] | None:
    """A read-only connection to the catalog file and the files its views read, when nothing under the
    root changed since `refresh` verified it (the same folder, fingerprint and code version, the
    views as written); None otherwise (the caller verifies)."""
    db_path = catalog_path(root)
    if db_path is None or not db_path.exists():
        return None
    try:
        record = json.loads(_verified_path(db_path).read_text())
    except (OSError, ValueError):
        return None
    if (record.get("code_version") != CODE_VERSION or record.get("root") != root_identity(root)
            or record.get("fingerprint") != root_fingerprint(root)):
        return None
    try:
        con = duckdb.connect(str(db_path), read_only=True)
    except duckdb.Error:  # in use by a writer, or damaged
        return None
    try:
        if _view_digest(con) == record.get("views"):
            return con, list(record["readable"])
    except duckdb.Error:
        pass
    con.close()
    return None


def _refreshed(root: RootLike) -> bool:
    """For a reader that found the catalog out of date (files changed, or written by another code
    version): rebuild it now, so that the next query reads it without verifying again. False where
    that cannot be done at once (an object store, another process refreshing it or holding it open
    for writing, a root this user cannot write): the reader then verifies in memory."""
    if catalog_path(root) is None:
        return False
    try:
        refresh(root, wait=False)
    except (OSError, duckdb.Error):  # BlockingIOError is an OSError
        return False
    return True


def connect(root: RootLike, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection with the catalog's views. `read_only` on a root unchanged since the last refresh
    (`_verified_catalog`, the catalog refreshed first when it is not: `_refreshed`): the catalog file
    itself, read-only, without verifying again; otherwise an in-memory connection whose views are made
    over the files verified now (never blocked by a writer's file lock).
    `read_only` (a local root): the engine may then open only the verified files the views read,
    and its settings are locked, so no statement can write a file, attach a database, install or
    load an extension, or lift these limits."""
    cached = _verified_catalog(root) if read_only else None
    if cached is None and read_only and _refreshed(root):
        cached = _verified_catalog(root)
    if cached is not None:
        con, readable = cached
    else:
        con = duckdb.connect()
        _, readable = _create_views(con, root)
    if read_only and is_local(as_root(root)):
        con.execute(f"SET allowed_paths = [{', '.join(_sql_string(f) for f in readable)}]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


class ReadOnlyError(ValueError):
    """A statement that could write (COPY, CREATE, ATTACH, ...) where only reading was allowed."""


def _explained(con: duckdb.DuckDBPyConnection, text: str) -> list[duckdb.Statement]:
    """The statements an EXPLAIN [ANALYZE] [(options)] statement wraps: the first suffix of its text,
    from one of its tokens on, that parses ([] when none does)."""
    for position, _ in duckdb.tokenize(text)[1:]:
        try:
            return con.extract_statements(text[position:])
        except duckdb.Error:
            continue
    return []


def refuse_writes(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """ReadOnlyError unless every statement of `sql` is a SELECT (DESCRIBE, SHOW, SUMMARIZE and
    PRAGMA show_* parse as SELECT) or an EXPLAIN of statements that all are, however nested or
    commented: EXPLAIN ANALYZE executes what it wraps."""
    for statement in con.extract_statements(sql):
        kind = statement.type.name
        if kind == "EXPLAIN":
            inner = _explained(con, statement.query)
            if not inner:
                raise ReadOnlyError("read-only: an EXPLAIN whose statement cannot be read is not allowed")
            refuse_writes(con, ";".join(st.query for st in inner))
        elif kind != "SELECT":
            raise ReadOnlyError(f"read-only: {kind} statements are not allowed (updatelens sql --write allows them)")


class QueryTimeout(Exception):
    """A query ran past its time limit and was interrupted."""


def fetch(root: RootLike, sql: str, params: list[object] | None = None, write: bool = False,
          timeout_s: float | None = None) -> tuple[list[str], list[tuple[object, ...]]]:
    """`query` as column names and rows, without polars (what `updatelens sql` prints: its import is
    most of a small query's time). The query runs in a worker thread while this one waits, so a
    Ctrl-C (KeyboardInterrupt, raised here) or `timeout_s` (QueryTimeout) stops it through DuckDB's
    interrupt, whether or not DuckDB itself looks at the signal."""
    import threading
    import time

    with connect(root, read_only=not write) as con:
        if not write:
            refuse_writes(con, sql)
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                rel = con.execute(sql, params) if params else con.execute(sql)
                columns = [d[0] for d in rel.description] if rel.description else []
                outcome["rows"] = (columns, rel.fetchall() if columns else [])
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
                outcome["error"] = exc

        worker = threading.Thread(target=work, name="updatelens-query", daemon=True)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.05)
                if deadline is not None and time.monotonic() > deadline and worker.is_alive():
                    outcome["expired"] = True
                    con.interrupt()
                    worker.join()
        except KeyboardInterrupt:
            con.interrupt()
            worker.join()
            raise
        error = outcome.get("error")
        if error is None:
            return outcome["rows"]
        if isinstance(error, duckdb.InterruptException) and outcome.get("expired"):
            raise QueryTimeout(f"the query ran past its limit of {timeout_s:g} s and was stopped") from error
        raise error


def query(root: RootLike, sql: str, params: list[object] | None = None, write: bool = False) -> pl.DataFrame:
    """Run SQL over the stored tables, with `$1`.. bound to `params`; returns a polars frame (empty
    for statements without rows). Unless `write`, only reading statements run: a COPY ... TO, CREATE,
    ATTACH, INSTALL or SET is refused (ReadOnlyError) before anything executes, and the engine
    itself is limited to reading the verified files (`connect(read_only=True)`)."""
    with connect(root, read_only=not write) as con:
        if not write:
            refuse_writes(con, sql)
        rel = con.sql(sql, params=params) if params else con.sql(sql)
        if rel is not None:
            return rel.pl()
    import polars as pl

    return pl.DataFrame()
