"""The method's SQL: the views that turn the stored tables into per-layer statistics, resamples,
findings with their nulls and controls, verdicts, the sensitivity to the conventions and the
convergence with the sample size. Rendered from the engine's declarations (updatelens.findings:
the statistics and the findings; updatelens.verdicts: the rule); storage.catalog registers them over
the verified files of a root.

Over 600 lines: these are the SQL texts of one family of views, which read one another
(layer_summary -> finding_replicates -> findings_by_class -> findings); split apart they would be
read in several files to follow one query.
"""

from __future__ import annotations

from updatelens.findings import (
    EXACT,
    FINDINGS,
    FUNCTIONAL_STATISTICS,
    GEOMETRY_STATISTIC_DEFS,
    GEOMETRY_STATISTICS,
    JACKKNIFE_FIRST,
    RANK_DEFS,
    RANK_STATISTICS,
    RESAMPLED_FUNCTIONAL,
    SPLIT_STATISTICS,
    STATISTICS,
    Finding,
    FunctionalStatistic,
    aggregate_sql,
)
from updatelens.schemas import CONTROL_PREFIX
from updatelens.verdicts import (
    CONTROL_WORDS,
    NULL_WORDS,
    difference_outcome_sql,
    threshold_outcome_sql,
    verdict_sql,
)


def sql_string(value: object) -> str:
    """A SQL string literal (quotes doubled), for view text that cannot take parameters."""
    return "'" + str(value).replace("'", "''") + "'"


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

# The functional statistics, each read from its variant's row of `functional_summary` (one declaration:
# findings.FUNCTIONAL_STATISTICS)
def _functional_pivot(stat: FunctionalStatistic) -> str:
    later = " AND n_later > 0" if stat.later_only else ""
    return f"max(CASE WHEN variant = '{stat.variant}'{later} THEN {stat.column} END) AS {stat.name}"


LAYER_SUMMARY_FUNCTIONAL = """
SELECT model, layer, fn_class, config_id,
       {statistics}
FROM {{functional_summary}}
GROUP BY model, layer, fn_class, config_id
""".format(statistics=",\n       ".join(_functional_pivot(stat) for stat in FUNCTIONAL_STATISTICS))

FUNCTIONAL_COLUMNS = tuple(stat.name for stat in FUNCTIONAL_STATISTICS)

# Findings measured under another convention of docs/method.md than the main one:
# (finding id, the finding it re-measures, the convention, its setting here, the main setting).
ALTERNATIVE_MEASURES = (
    ("1 map", "1", "alignment form", "map: cos(y, T(x))", "update: cos(y - x, T(x) - x)"),
    ("2 angle vs tok", "2 angle", "angle reference", "against Δ_tok", "against Δ_full"),
    ("4 norm", "4", "error measure", "‖r‖", "relative error"),
    ("6 inner", "6", "edge layers", "without the two first and two last", "every layer"),
    ("3 centred", "3", "spectra", "centred (less the mean update)", "uncentred"),
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
       {columns}, {rank_columns}
FROM {layer_summary} ls LEFT JOIN (
    SELECT model, layer, config_id, fn_class, {ranks}
    FROM {spectra} GROUP BY model, layer, config_id, fn_class
) r USING (model, layer, config_id, fn_class)
"""

LAYER_REPLICATES_SQL = """
CREATE OR REPLACE VIEW {name} AS
SELECT g.model, g.config_id, g.fn_class, g.layer, g.replicate, g.model_layers,
       {geometry_columns}, {functional_columns},
       {rank_columns}
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

BAND_STATISTICS: tuple[str, ...] = (*GEOMETRY_STATISTICS, *RESAMPLED_FUNCTIONAL, *RANK_STATISTICS)

# A table, not a view: every finding on every resample is computed once, when the catalog is refreshed
# from the verified files, instead of in every query that reads
# the findings (the catalog's record of what was verified holds a digest of its rows: `_view_digest`).
FINDING_REPLICATES_SQL = """
CREATE OR REPLACE TABLE {name} AS
WITH stats AS ({stats}),
b AS (
    SELECT stats.*,
           max(model_layers) OVER (PARTITION BY model, config_id) AS n_layers,
           -- finding 6's null (Finding.shift_null): the depth labels of the analysed layers shifted round by
           -- an offset of 1 to n - 1 places, the offsets taken in turn over the replicates (replicate b:
           -- 1 + b mod (n - 1)), so every shift is drawn equally often. A circular shift keeps neighbouring
           -- layers together (their statistics are correlated), which a free permutation would scatter, so
           -- the null keeps the depth profile's smoothness
           list_sort(list(layer) OVER w)[
               ((row_number() OVER (w ORDER BY layer) - 1
                 + 1 + abs(replicate) % greatest(count(*) OVER w - 1, 1)) % count(*) OVER w) + 1] AS perm_layer,
           count(*) OVER w AS n_analysed
    FROM stats
    WINDOW w AS (PARTITION BY model, config_id, fn_class, replicate)
), f AS (
{findings}
),
-- the point estimate under every shift 0 .. n - 1 (0: the real depths), for the circular-shift test's p
shifted AS (
    SELECT s.* REPLACE (list_sort(list(layer) OVER w)[
               ((row_number() OVER (w ORDER BY layer) - 1 + shift) % count(*) OVER w) + 1] AS perm_layer)
    FROM (SELECT *, unnest(range(n_analysed)) AS shift FROM b WHERE replicate = -1) s
    WINDOW w AS (PARTITION BY model, config_id, fn_class, shift)
),
shift_p AS (
{shift_p}
)
-- a null measured by fitting (Finding.null_target): the same finding on the controls stage's null target,
-- replicate by replicate (the same resamples of the same documents)
SELECT f.* REPLACE (CASE WHEN f.null_target <> '' AND f.fn_class <> '{exact_class}' THEN n.value ELSE f.null_value END
                    AS null_value),
       sp.null_p
FROM f LEFT JOIN ({controls}) n
     ON n.control = f.null_target AND n.model = f.model AND n.config_id = f.config_id AND n.fn_class = f.fn_class
        AND n.finding = f.finding AND n.replicate = f.replicate
LEFT JOIN shift_p sp
     ON sp.model = f.model AND sp.config_id = f.config_id AND sp.fn_class = f.fn_class AND sp.finding = f.finding
        AND f.replicate = -1
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
           max(null_p) FILTER (WHERE replicate = -1) AS null_p,
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
       ci_lo, ci_hi, null_value, null_ci_lo, null_ci_hi, diff_ci_lo, diff_ci_hi, null_p, n_resamples, interval,
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
    constants = (f"{sql_string(f.id)} AS finding, {sql_string(f.claim)} AS statement, "
                 f"{sql_string(f.measure)} AS measure, {sql_string(f.threshold)} AS threshold, "
                 f"{sql_string(f.op)} AS op, CAST({f.bound!r} AS DOUBLE) AS bound, "
                 f"{sql_string(f.source)} AS threshold_source, {sql_string(f.null_source)} AS null_source, "
                 f"{sql_string(f.control_role)} AS control_role, {sql_string(f.interval)} AS interval, "
                 f"{sql_string(f.null_target)} AS null_target")
    covered = f"({f.coverage})"
    note = (f"CASE WHEN NOT {covered} THEN {sql_string(f.coverage_note)} || ' (layers analysed: ' || "
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


def shift_p_select() -> str:
    """The circular-shift test of each finding whose null shifts the depths (Finding.shift_null), over
    `shifted` (the point estimate's layers under every shift, 0 the identity): per (model, config, class)
    `null_p`, the share of the n shifts whose null value is at least the real value on the claimed side
    (so at least 1 / n: the identity is one of them). Empty where no finding shifts."""
    parts = []
    for f in FINDINGS:
        if not f.shift_null:
            continue
        if f.scope != "class":
            raise ValueError(f"finding {f.id!r}: a shift null is enumerated per class")
        side = ">=" if f.op == ">=" else "<="
        parts.append(
            f"    SELECT model, config_id, fn_class, {sql_string(f.id)} AS finding,\n"
            f"           avg(CASE WHEN shifted_value {side} real_value THEN 1.0 ELSE 0.0 END) AS null_p\n"
            f"    FROM (SELECT model, config_id, fn_class, shift,\n"
            f"                 CASE WHEN {f.coverage} THEN {f.null} END AS shifted_value,\n"
            f"                 CASE WHEN {f.coverage} THEN {f.value} END AS real_value\n"
            f"          FROM shifted GROUP BY model, config_id, fn_class, shift)\n"
            f"    GROUP BY model, config_id, fn_class HAVING count(real_value) = count(*)")
    if not parts:
        return ("    SELECT NULL::VARCHAR AS model, NULL::VARCHAR AS config_id, NULL::VARCHAR AS fn_class, "
                "NULL::VARCHAR AS finding, NULL::DOUBLE AS null_p WHERE false")
    return "\n    UNION ALL\n".join(parts)


def findings_sql(prefix: str = "", with_replicates: bool = False, controls: str = NO_CONTROLS) -> list[str]:
    """The findings views of one family; with its bootstrap tables, the `layer_replicates` view too.
    `controls`: the relation of the family's positive controls' finding replicates (none: empty)."""
    columns = ", ".join(f"ls.{c}" for c in STATISTICS)
    ranks = ", ".join(f"any_value(CASE WHEN which = '{which}' THEN effective_rank{'_centred' if centred else ''} END) "
                      f"AS {name}" for name, which, centred in RANK_DEFS)
    stats = POINT_STATS_SQL.format(columns=columns, layer_summary=f"{prefix}layer_summary", spectra=f"{prefix}spectra",
                                   rank_columns=", ".join(f"r.{c}" for c in RANK_STATISTICS), ranks=ranks)
    statements = []
    if with_replicates:
        statements.append(LAYER_REPLICATES_SQL.format(name=f"{prefix}layer_replicates",
                                                      geometry_columns=", ".join(f"g.{c}" for c in GEOMETRY_STATISTICS),
                                                      functional_columns=", ".join(f"f.{c}" for c in RESAMPLED_FUNCTIONAL),
                                                      geometry_bootstrap=f"{prefix}geometry_bootstrap",
                                                      functional_bootstrap=f"{prefix}functional_bootstrap",
                                                      rank_columns=", ".join(f"g.{c}" for c in RANK_STATISTICS)))
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
                                          shift_p=shift_p_select(),
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
