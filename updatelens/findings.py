"""The paper's findings, declared once: the claim, how UpdateLens measures it, the threshold that
decides whether it holds, and where that threshold comes from.

Each measure is a SQL aggregate over the per-layer statistics of one (model, config, class,
bootstrap replicate) — the columns of the `layer_summary` view (and the effective ranks of
`spectra`), with `layer` and `n_layers` — so a reader sees how every figure is derived.
`storage.catalog` renders these into the `findings_by_class` and `findings` views; the reports
and the sensitivity view read them from there.

Each finding also declares its null: the same aggregate where the structure the paper claims is
absent (the same fits on a target with no tokenwise relation, a residual of the same length in a random
direction of the layer's shape, shifted depths, the identity map). A
finding `holds` only when its bootstrap interval clears the threshold and the interval of its
difference from the null (resample by resample) excludes zero on the claimed side; when it clears
the threshold but not the null it is `indistinct`: the measure cannot tell the claim from noise.
Findings 5 and 6 of the paper compare models (small against large, Mamba against Transformers);
per model, UpdateLens measures what one model can show: the diagonal class against the low-rank one,
the middle layers against the outer ones.
"""

from __future__ import annotations

from dataclasses import dataclass

# The per-layer geometry statistics of the findings, as `layer_summary` defines them: (statistic,
# per-token column, how it aggregates). The `_null` ones are the same measures on the random-direction
# residual of the same length (geometry.null_metrics); the
# bootstrap (updatelens.bootstrap) recomputes them on every resample.
GEOMETRY_STATISTIC_DEFS: tuple[tuple[str, str, str], ...] = (
    ("rel_err_median", "rel_err", "median"),
    ("cos_full_tok_median", "cos_full_tok", "median"),
    ("cos_full_tok_map_median", "cos_full_tok_map", "median"),
    ("frac_res_angle_gt60", "angle_full_res", "share_gt60"),
    ("frac_res_tok_angle_gt60", "angle_tok_res", "share_gt60"),
    ("proj_res_m16", "proj_res_m16", "mean"),
    ("cos_full_tok_median_null", "cos_full_tok_null", "median"),
    ("cos_full_tok_map_median_null", "cos_full_tok_map_null", "median"),
    ("frac_res_angle_gt60_null", "angle_full_res_null", "share_gt60"),
    ("frac_res_tok_angle_gt60_null", "angle_tok_res_null", "share_gt60"),
    ("proj_res_m16_null", "proj_null_m16", "mean"),
    # the estimator against the exact split (NaN where no self-and-first output was captured)
    ("cos_res_ctx_median", "cos_res_ctx", "median"),
    ("res_share_ctx_mean", "res_share_ctx", "mean"),
    ("cos_tok_ctl_median", "cos_tok_ctl", "median"),
)
GEOMETRY_STATISTICS: tuple[str, ...] = tuple(name for name, _, _ in GEOMETRY_STATISTIC_DEFS)
ANGLE_GT = 60  # degrees: `share_gt60` is the share of tokens whose angle exceeds it (the paper's "> 60°")


def aggregate_sql(column: str, how: str) -> str:
    """The SQL aggregate of one GEOMETRY_STATISTIC_DEFS entry over a layer's token rows: the point
    estimate the bootstrap (`bootstrap.geometry_replicates`) recomputes with resample weights."""
    if how == "median":
        return f"median({column})"
    if how == "share_gt60":
        return f"avg(CASE WHEN {column} > {ANGLE_GT} THEN 1.0 ELSE 0.0 END)"
    if how == "mean":
        return f"avg({column})"
    raise ValueError(f"unknown aggregate {how!r} for {column!r}: median, share_gt60 or mean")
TOKEN_STATISTICS: tuple[str, ...] = tuple(dict.fromkeys(column for _, column, _ in GEOMETRY_STATISTIC_DEFS))


# The per-layer functional statistics: each read from one row of `functional_summary` (the patch variant
# that measured it: `patch` removes r, `random` moves the state as far in a random direction of the
# residuals' shape, `crude` uses a cruder tokenwise part, `context` removes the exact split's context part a,
# `context_random` moves it as far at random) and one of its columns; `later_only`: only where that row
# measured the later positions (n_later > 0); `resampled`: `functional_bootstrap` recomputes it (a column of
# the same name) on every bootstrap resample, so it has an interval and a finding may read it.
@dataclass(frozen=True)
class FunctionalStatistic:
    name: str
    variant: str
    column: str
    later_only: bool = False
    resampled: bool = False


FUNCTIONAL_STATISTICS: tuple[FunctionalStatistic, ...] = (
    FunctionalStatistic("kl_mean", "patch", "kl_mean"),
    FunctionalStatistic("kl_median", "patch", "kl_median"),
    FunctionalStatistic("spearman_relerr_kl", "patch", "spearman_relerr_kl", resampled=True),
    FunctionalStatistic("spearman_normres_kl", "patch", "spearman_normres_kl", resampled=True),
    FunctionalStatistic("kl_mean_random_control", "random", "kl_mean"),
    FunctionalStatistic("kl_mean_crude_control", "crude", "kl_mean"),
    FunctionalStatistic("kl_mean_context", "context", "kl_mean"),
    FunctionalStatistic("spearman_ctx_kl", "context", "spearman_normres_kl"),
    FunctionalStatistic("spearman_ctx_ratio_kl", "context", "spearman_relerr_kl"),
    FunctionalStatistic("kl_mean_context_random", "context_random", "kl_mean"),
    FunctionalStatistic("kl_ratio_context_random", "context", "kl_ratio_random"),
    # finding 4's nulls: the same Spearman with the KL of the random control
    FunctionalStatistic("spearman_relerr_kl_null", "random", "spearman_relerr_kl", resampled=True),
    FunctionalStatistic("spearman_normres_kl_null", "random", "spearman_normres_kl", resampled=True),
    FunctionalStatistic("kl_ratio_random", "patch", "kl_ratio_random", resampled=True),
    FunctionalStatistic("kl_later_mean", "patch", "kl_later_mean", later_only=True, resampled=True),
    FunctionalStatistic("kl_at_mean_on_later", "patch", "kl_at_mean_on_later", later_only=True),
    FunctionalStatistic("spearman_kl_later", "patch", "spearman_kl_later", later_only=True),
    FunctionalStatistic("kl_later_random_mean", "patch", "kl_later_random_mean", later_only=True, resampled=True),
    FunctionalStatistic("later_ratio_median", "patch", "later_ratio_median", later_only=True, resampled=True),
)
RESAMPLED_FUNCTIONAL: tuple[str, ...] = tuple(s.name for s in FUNCTIONAL_STATISTICS if s.resampled)

# What a finding's measure may read (one row per layer of a class, on the point estimate and on every
# resample): the geometry statistics, the resampled functional ones, the effective ranks of the singular
# spectra of Δ_full, Δ_tok and r and of the null's Δ_full and r, each also centred (RANK_STATISTICS),
# `layer`, `n_layers` (the model's depth, whatever was analysed) and `perm_layer` (the analysed layers'
# depths shifted round, one shift per resample: Finding.shift_null). The `_null` statistics are the same
# measures where the claimed structure is absent.
STATISTICS: tuple[str, ...] = (*GEOMETRY_STATISTICS, *RESAMPLED_FUNCTIONAL)


# The effective ranks the findings read, one per (spectrum, centring): (statistic, the spectra's `which`,
# centred). Uncentred, as the paper's SVD of the stacked updates: the layer's mean update fills the first
# singular value. Centred: the same rows less their mean (on each replicate, its weighted mean), so the
# rank counts the directions the updates vary in. Point estimates from `spectra` (`effective_rank`,
# `effective_rank_centred`), intervals from the jackknife replicates of `geometry_bootstrap`.
RANK_DEFS: tuple[tuple[str, str, bool], ...] = tuple(
    (f"rank_{which}{'_centred' if centred else ''}", which, centred)
    for centred in (False, True) for which in ("full", "tok", "res", "full_null", "res_null"))
RANK_STATISTICS: tuple[str, ...] = tuple(name for name, _, _ in RANK_DEFS)


# The exact split's per-layer statistics (updatelens.steps.context_split), declared as the geometry's are:
# (statistic, per-token column of `context_split`, aggregate), on every bootstrap resample too.
SPLIT_STATISTICS: tuple[tuple[str, str, str], ...] = (
    ("ctl_ratio_median", "ctl_ratio", "median"),
    ("ctx_ratio_median", "ctx_ratio", "median"),
    ("cos_full_ctl_median", "cos_full_ctl", "median"),
    ("cos_ctx_full_median", "cos_ctx_full", "median"),
    ("cos_ctx_ctl_median", "cos_ctx_ctl", "median"),
)


# The exact split measured as an estimator (updatelens.steps.controls.exact_tables): its class, and its rows'
# `estimator` in the `findings` view beside the best fitted class's
EXACT = "exact"

# Jackknife replicate g of the effective ranks is stored as replicate JACKKNIFE_FIRST - g (-2, -3, ...), beside
# the bootstrap's 0 .. bootstrap-1 and the point estimate's -1 (the engine writes them, the catalog reads them)
JACKKNIFE_FIRST = -2

# Aggregates over layers need this many analysed layers (fewer: the finding is NULL, with a note).
MIN_LAYERS = 2
OVER_LAYERS = f"count(DISTINCT layer) >= {MIN_LAYERS}"
OVER_LAYERS_NOTE = (f"not measured: it aggregates over layers and needs at least {MIN_LAYERS} analysed layers "
                    f"(with one, an aggregate over layers is that layer's value)")
MIDDLE = "{layer} >= n_layers / 3 AND {layer} < 2 * n_layers / 3"


@dataclass(frozen=True)
class Finding:
    id: str  # '1', '2 angle', ...: the paper's number, then what distinguishes the measure
    claim: str  # the paper's statement
    measure: str  # the measure in words
    value: str  # SQL aggregate over the rows of one class's layers (scope "class") or of all classes ("model")
    op: str  # '>=' or '<=': the finding holds when value op bound, and value op its null (beyond it)
    bound: float
    source: str  # where the bound comes from
    null: str  # the same aggregate where the claimed structure is absent (docs/method.md, "Nulls")
    null_source: str  # what the null is, in words
    scope: str = "class"  # "model": the value compares classes and is the same for each of them
    coverage: str = OVER_LAYERS  # SQL condition on the analysed layers under which the value is measured
    coverage_note: str = OVER_LAYERS_NOTE
    # what the positive controls (targets tokenwise by construction, docs/method.md) are to this finding:
    # "positive": the claim says the layer is tokenwise, so a tokenwise target must show it: where the
    #   control misses the threshold, or the real value cannot be told from the control's, the estimator
    #   cannot show the structure at this sample size (`estimator-limited`);
    # "floor": the claim is about the residual, which a tokenwise target does not have: its value is
    #   what the estimator's own error gives, and a real value that cannot be told from it says
    #   nothing about the layer (`estimator-limited`);
    # "reference": shown beside the value, not part of the verdict;
    # "none": no control measures it (a KL needs patched passes the controls do not make).
    control_role: str = "floor"
    # the null measured by fitting: the controls stage's target (updatelens.steps.controls) whose value of
    # this same finding, resample by resample, is a fitted class's null (the `null` expression then serves
    # the exact split, which has no fits)
    null_target: str = ""
    # how the 95% intervals are read from the replicates: "percentile" (the 2.5% and 97.5% quantiles of
    # the bootstrap resamples) or "jackknife" (point +- t * the delete-a-group jackknife's standard error
    # over documents: for effective ranks, which a resample drawn with replacement biases low)
    interval: str = "percentile"
    # the null relabels the analysed layers' depths by a circular shift (`perm_layer`): every one of the
    # n - 1 non-trivial shifts can be enumerated, so the resamples take them in turn (resample b: shift
    # 1 + b mod (n - 1)) and `null_p` is the exact share of all n shifts, the identity included, whose
    # value is at least the real one's on the claimed side (the circular-shift test's p)
    shift_null: bool = False

    @property
    def threshold(self) -> str:
        return f"{self.op} {self.bound:g}"


RANDOM_DIRECTION = ("u a random unit vector per token drawn in the shape of the layer's updates (the direction of a "
                    "draw of N(0, Σ), Σ the second moment of Δ_full), so r keeps its length and stays in the "
                    "directions the stream uses, but loses its own direction")
UNRELATED = ("the same finding by the same fits (classes, neighbours) on the null target: each x paired with the "
             "update of a token of another document (x + Δ_other), which keeps the layer's updates, their mean and "
             "shape, and has no relation to x: what the estimator reports when there is nothing tokenwise to find "
             "(the controls stage's `unrelated` target)")
EXACT_NULL = ("; on the exact split (estimator `exact`, no fits), each token's Δ_full against the tokenwise update "
              "of a token of another document")
MIDDLE_GAP = ("avg(CASE WHEN {m} THEN rel_err_median END) - avg(CASE WHEN NOT ({m}) THEN rel_err_median END)")
EDGE = "({layer} < 2 OR {layer} >= n_layers - 2)"  # the two first and two last layers of the model
INNER_GAP = ("avg(CASE WHEN {m} THEN rel_err_median END) "
             "- avg(CASE WHEN NOT ({m}) AND NOT {edge} THEN rel_err_median END)")

FINDINGS: tuple[Finding, ...] = (
    Finding("1", "the full update is aligned with the tokenwise update",
            "median over layers of median cos(Δ_full, Δ_tok), update form", "median(cos_full_tok_median)", ">=", 0.9,
            "the paper says 'almost perfectly aligned (cosine near 1)'; 0.9 (about 26°) is UpdateLens's reading",
            "median(cos_full_tok_median_null)", UNRELATED + EXACT_NULL, control_role="positive",
            null_target="unrelated"),
    Finding("1 map", "the full update is aligned with the tokenwise update",
            "median over layers of median cos(y, T(x)), map form", "median(cos_full_tok_map_median)", ">=", 0.9,
            "as finding 1, under the map-form convention",
            "median(cos_full_tok_map_median_null)", UNRELATED + EXACT_NULL.replace("Δ_full", "y"), control_role="positive",
            null_target="unrelated"),
    Finding("2 angle", "the residual deviates by large angles",
            "mean over layers of the share of tokens with angle(Δ_full, r) > 60°", "avg(frac_res_angle_gt60)",
            ">=", 0.5, "the paper says 'many tokens above 60 degrees'; 'many' read as at least half",
            "avg(frac_res_angle_gt60_null)", f"the share with angle(Δ_tok + ‖r‖u, ‖r‖u) > 60°, {RANDOM_DIRECTION}"),
    Finding("2 angle vs tok", "the residual deviates by large angles",
            "mean over layers of the share of tokens with angle(Δ_tok, r) > 60°", "avg(frac_res_tok_angle_gt60)",
            ">=", 0.5, "as finding 2 angle, with the angle measured against Δ_tok",
            "avg(frac_res_tok_angle_gt60_null)",
            f"the share with angle(Δ_tok, u) > 60°, {RANDOM_DIRECTION}"),
    Finding("2 projection", "the residual projects little onto the tokenwise subspace",
            "mean over layers of the projection energy of r on the top-16 tokenwise directions", "avg(proj_res_m16)",
            "<=", 0.25, "the paper says 'weakly aligned'; a quarter of r's energy is UpdateLens's reading",
            "avg(proj_res_m16_null)", f"the projection energy of u on the same 16 directions, "
                                      f"{RANDOM_DIRECTION}"),
    Finding("3", "full and tokenwise updates are low-dimensional, the residual is not",
            "mean effective rank of Δ_full and Δ_tok over that of r (the larger of the two ratios)",
            "greatest(avg(rank_full), avg(rank_tok)) / avg(rank_res)", "<=", 0.5,
            "the paper gives no figure; at most half the residual's effective rank is UpdateLens's reading",
            "greatest(avg(rank_full_null), avg(rank_tok)) / avg(rank_res_null)",
            f"the same ratio with r replaced by ‖r‖u, a residual of the same energy per token in the shape of "
            f"the layer's updates ({RANDOM_DIRECTION})",
            interval="jackknife"),
    Finding("3 centred", "full and tokenwise updates are low-dimensional, the residual is not",
            "as finding 3, on the centred spectra (each of Δ_full, Δ_tok and r less its mean over the tokens): the "
            "layer's mean update, which fills the first singular value of an uncentred spectrum, left out",
            "greatest(avg(rank_full_centred), avg(rank_tok_centred)) / avg(rank_res_centred)", "<=", 0.5,
            "as finding 3",
            "greatest(avg(rank_full_null_centred), avg(rank_tok_centred)) / avg(rank_res_null_centred)",
            "as finding 3's null, on the centred spectra", interval="jackknife"),
    Finding("4", "approximation error predicts output perturbation",
            "median over layers of Spearman(relative error, KL at the patched position)", "median(spearman_relerr_kl)", ">=", 0.7,
            "the paper: 'Spearman often above 0.7'",
            "median(spearman_relerr_kl_null)",
            "Spearman(relative error, KL) of the random control: the output moved as far as T(x) moves it, in a "
            "random direction drawn in the residuals' shape (the controls' class only)", control_role="none"),
    Finding("4 norm", "approximation error predicts output perturbation",
            "median over layers of Spearman(||r||, KL)", "median(spearman_normres_kl)", ">=", 0.7,
            "as finding 4, with the error measured as ||r||",
            "median(spearman_normres_kl_null)", "as finding 4's null, with the error measured as ||r||",
            control_role="none"),
    Finding("4 direction", "approximation error predicts output perturbation",
            "median over layers of the median over tokens of the paired ratio KL(remove r) / KL(move the state "
            "as far in a random direction drawn in the residuals' shape), both at the patched position: how much "
            "more the residual's direction moves the output than its size alone", "median(kl_ratio_random)", ">=", 1.0,
            "the method's random-direction control: the error predicts the output through the residual's "
            "direction, not only its size, when removing r moves the output more than a random move of the same "
            "length; any ratio above 1",
            "1.0", "the ratio of the random control to itself: a residual whose direction carries nothing moves "
                   "the output as a random direction of its length does",
            control_role="none"),
    Finding("5", "a diagonal map serves about as well as a low-rank one",
            "median relative error of diagonal minus that of lowrank",
            "median(rel_err_median) FILTER (WHERE fn_class = 'diagonal') "
            "- median(rel_err_median) FILTER (WHERE fn_class = 'lowrank')", "<=", 0.05,
            "the paper: small models are 'well served by diagonal maps'; within 0.05 of low rank's median error "
            "is UpdateLens's reading",
            "1.0 - median(rel_err_median) FILTER (WHERE fn_class = 'lowrank')",
            "the identity map (no tokenwise update: relative error 1) in place of the diagonal one", scope="model",
            control_role="reference"),
    Finding("6", "middle layers have larger residuals",
            "mean median relative error of the middle third of the model's layers minus the outer thirds",
            MIDDLE_GAP.format(m=MIDDLE.format(layer="layer")), ">=", 0.0,
            "the paper: 'middle layers have larger residuals'; any positive gap",
            MIDDLE_GAP.format(m=MIDDLE.format(layer="perm_layer")),
            "the same gap with the analysed layers' depths shifted round by an offset of 1 to n - 1 places, each "
            "offset in turn over the resamples: neighbouring layers stay together; `null_p` is the share of all n "
            "shifts (the identity included) whose gap is at least the real one",
            shift_null=True,
            coverage=(f"count(DISTINCT layer) FILTER (WHERE {MIDDLE.format(layer='layer')}) >= 2 AND "
                      f"count(DISTINCT layer) FILTER (WHERE NOT ({MIDDLE.format(layer='layer')})) >= 2"),
            coverage_note="not measured: it needs at least 2 analysed layers in the middle third of the model's "
                          "depth and 2 in the outer thirds"),
    Finding("6 inner", "middle layers have larger residuals",
            "as finding 6 without the two first and two last layers of the model (their residuals are the "
            "most extreme: how much of the gap they carry)",
            INNER_GAP.format(m=MIDDLE.format(layer="layer"), edge=EDGE.format(layer="layer")), ">=", 0.0,
            "as finding 6", INNER_GAP.format(m=MIDDLE.format(layer="perm_layer"), edge=EDGE.format(layer="perm_layer")),
            "as finding 6's null, on the same inner layers", shift_null=True,
            coverage=(f"count(DISTINCT layer) FILTER (WHERE {MIDDLE.format(layer='layer')}) >= 2 AND "
                      f"count(DISTINCT layer) FILTER (WHERE NOT ({MIDDLE.format(layer='layer')}) "
                      f"AND NOT ({EDGE.format(layer='layer')})) >= 2"),
            coverage_note="not measured: it needs at least 2 analysed layers in the middle third and 2 in the outer "
                          "thirds besides the two first and two last layers"),
)

BY_ID: dict[str, Finding] = {f.id: f for f in FINDINGS}
