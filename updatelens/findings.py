"""The paper's findings, declared once: the claim, how UpdateLens measures it, the threshold that
decides whether it holds, and where that threshold comes from.

Each measure is a SQL aggregate over the per-layer statistics of one (model, config, class,
bootstrap replicate) — the columns of the `layer_summary` view (and the effective ranks of
`spectra`), with `layer` and `n_layers` — so a reader sees how every figure is derived.
`storage.catalog` renders these into the `findings_by_class` and `findings` views; the reports
and the sensitivity view read them from there. Findings 5 and 6 of the paper compare models
(small against large, Mamba against Transformers); per model, UpdateLens measures what one model
can show: the diagonal class against the low-rank one, the middle layers against the outer ones.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a measure may read: these per-layer statistics (one row per layer of a class), the effective
# ranks of the singular spectra of Δ_full, Δ_tok and r (rank_full, rank_tok, rank_res), `layer` and
# `n_layers`.
STATISTICS: tuple[str, ...] = ("rel_err_median", "cos_full_tok_median", "cos_full_tok_map_median",
                               "frac_res_angle_gt60", "frac_res_tok_angle_gt60", "proj_res_m16",
                               "spearman_relerr_kl", "spearman_normres_kl")


@dataclass(frozen=True)
class Finding:
    id: str  # '1', '2 angle', ...: the paper's number, then what distinguishes the measure
    claim: str  # the paper's statement
    measure: str  # the measure in words
    value: str  # SQL aggregate over the rows of one class's layers (scope "class") or of all classes ("model")
    op: str  # '>=' or '<=': the finding holds when value op bound
    bound: float
    source: str  # where the bound comes from
    scope: str = "class"  # "model": the value compares classes and is the same for each of them

    @property
    def threshold(self) -> str:
        return f"{self.op} {self.bound:g}"


FINDINGS: tuple[Finding, ...] = (
    Finding("1", "the full update is aligned with the tokenwise update",
            "median over layers of median cos(Δ_full, Δ_tok), update form", "median(cos_full_tok_median)", ">=", 0.9,
            "the paper says 'almost perfectly aligned (cosine near 1)'; 0.9 (about 26°) is UpdateLens's reading"),
    Finding("1 map", "the full update is aligned with the tokenwise update",
            "median over layers of median cos(y, T(x)), map form", "median(cos_full_tok_map_median)", ">=", 0.9,
            "as finding 1, under the map-form convention"),
    Finding("2 angle", "the residual deviates by large angles",
            "mean over layers of the share of tokens with angle(Δ_full, r) > 60°", "avg(frac_res_angle_gt60)",
            ">=", 0.5, "the paper says 'many tokens above 60 degrees'; 'many' read as at least half"),
    Finding("2 angle vs tok", "the residual deviates by large angles",
            "mean over layers of the share of tokens with angle(Δ_tok, r) > 60°", "avg(frac_res_tok_angle_gt60)",
            ">=", 0.5, "as finding 2 angle, with the angle measured against Δ_tok"),
    Finding("2 projection", "the residual projects little onto the tokenwise subspace",
            "mean over layers of the projection energy of r on the top-16 tokenwise directions", "avg(proj_res_m16)",
            "<=", 0.25, "the paper says 'weakly aligned'; a quarter of r's energy is UpdateLens's reading"),
    Finding("3", "full and tokenwise updates are low-dimensional, the residual is not",
            "mean effective rank of Δ_full and Δ_tok over that of r (the larger of the two ratios)",
            "greatest(avg(rank_full), avg(rank_tok)) / avg(rank_res)", "<=", 0.5,
            "the paper gives no figure; at most half the residual's effective rank is UpdateLens's reading"),
    Finding("4", "approximation error predicts output perturbation",
            "median over layers of Spearman(relative error, KL)", "median(spearman_relerr_kl)", ">=", 0.7,
            "the paper: 'Spearman often above 0.7'"),
    Finding("4 norm", "approximation error predicts output perturbation",
            "median over layers of Spearman(||r||, KL)", "median(spearman_normres_kl)", ">=", 0.7,
            "as finding 4, with the error measured as ||r||"),
    Finding("5", "a diagonal map serves about as well as a low-rank one",
            "median relative error of diagonal minus that of lowrank",
            "median(rel_err_median) FILTER (WHERE fn_class = 'diagonal') "
            "- median(rel_err_median) FILTER (WHERE fn_class = 'lowrank')", "<=", 0.05,
            "the paper: small models are 'well served by diagonal maps'; within 0.05 of low rank's median error "
            "is UpdateLens's reading", scope="model"),
    Finding("6", "middle layers have larger residuals",
            "mean median relative error of the middle third of layers minus the outer thirds",
            "avg(CASE WHEN layer >= n_layers / 3 AND layer < 2 * n_layers / 3 THEN rel_err_median END) "
            "- avg(CASE WHEN layer < n_layers / 3 OR layer >= 2 * n_layers / 3 THEN rel_err_median END)", ">=", 0.0,
            "the paper: 'middle layers have larger residuals'; any positive gap"),
)

BY_ID: dict[str, Finding] = {f.id: f for f in FINDINGS}
