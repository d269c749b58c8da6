"""Build a model's report, and the comparison across models, from stored results only.

A report is a folder `<data root>/reports/<model slug>/` with `index.html` (self-contained: the
figures are inlined, so the file can be mailed or archived alone) and the same figures as PNG
beside it. It is written whole into a staging folder and swapped into place, so a reader never
sees a half-written report. Nothing is recomputed: every number comes from the catalog's views.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl
from upath import UPath

from updatelens.errors import UpdateLensError
from updatelens.findings import FINDINGS
from updatelens.reports import figures as fig
from updatelens.reports.html import figure_section, html_table, page
from updatelens.reports.pngs import save_pngs
from updatelens.stages import TABLES
from updatelens.storage import catalog
from updatelens.storage.integrity import incomplete_layers, mixed_layers
from updatelens.storage.layout import publish_dir
from updatelens.storage.location import RootLike, as_root
from updatelens.views import findings_sql

REPORTS = "reports"
COMPARISON = "_comparison"  # not a valid model slug, so it never collides with one
# Every figure of a model report, in the order the report shows them, with its caption.
CONVERGENCE_CAPTION = ("Each finding against the number of tokens in the sample (nested samples: the first n "
                       "windows of the corpus), one line per class with its 95% bootstrap band over sequences.")
CONTEXT_HEADS_CAPTION = ("Per head, the share of a along the head's context restored alone (the block with that head "
                         "attending as in the model and every other to itself and the first position): <a_h, a> / "
                         "||a||^2 over the layer's tokens. The MLP follows attention, so the shares need not add up to "
                         "1; the rest is what the heads add only together. Per source distance, the context restored "
                         "nearest first (up to 1, 4, 16 positions back, then all): each bin's share of what it adds "
                         "to the nearer ones; these add up to 1. Dots: the heads' mean attention mass on the bin.")
CONTEXT_SPLIT_CAPTION = ("Per layer, the exact split of the update by the self-and-first block: the share of "
                         "‖Δ_full‖ that is the token's own update and the share the context adds (medians over "
                         "tokens), and the cosine of the full update with the token's own, against finding 1's 0.9; "
                         "bands: 95% bootstrap intervals over documents.")
MODEL_FIGURES: dict[str, str] = {
    "layer_curves": "Per-layer curves, one line per function class: relative error, alignment in update and map "
                    "form, share of residual angles above 60°, projection energy of Δ_full, Δ_tok and r on the "
                    "top-16 tokenwise directions, mean KL with the residual removed, Spearman(relative error, KL), "
                    "the median ratio KL(remove r) / KL(random move of the same norm) against its null 1, "
                    "and effective ranks; shaded: the 95% band of each statistic over the bootstrap resamples of "
                    "the documents (view layer_bands; the mean KL has none; the ranks' from their jackknife over "
                    "documents, with jackknife_groups > 0); dashed with crosses: the statistic's null (the same "
                    "measure on a residual of the same length in a random direction; for the Spearman, the random "
                    "control's), with its band.",
    "angle_histograms": "Distribution of the angle between the full update and the residual, for an early, a "
                        "middle and a late layer.",
    "error_vs_kl": "Per-token relative error against the KL caused by removing the residual at that token "
                   "(the exact single-position effect where the architecture has it, else every position "
                   "patched at once: config patch_mode), early, middle and late layers.",
    "energy_curves": "Cumulative singular-value energy of Δ_full, Δ_tok and r (uncentred), early, middle and "
                     "late layers: a curve that rises fast is low-dimensional.",
    "controls": "Left: mean KL with the residual removed, against the controls: a random direction of the same "
                "norm as r, and the residual kept with a cruder tokenwise part. Right: on the tokens whose effect on "
                "the rest of the sequence was measured (later_positions per sequence, one position's r removed), "
                "the mean KL at that position and the mean KL per later position over the later_horizon positions "
                "after it, beside the same with the position moved as far in a random direction of the residuals' "
                "shape (95% bands over documents), and the Spearman correlation of the KL at the position with the "
                "later one across those tokens (right axis).",
}
COMPARISON_FIGURES: dict[str, str] = {
    "comparison_curves": "Per-layer curves of every materialized model against normalised depth, each model on "
                         "the class with its lowest median relative error; shaded: the 95% band over the resamples.",
}


class ReportError(UpdateLensError):
    """Nothing (or not enough) is stored to build the requested report."""


@dataclass
class Report:
    title: str
    directory: UPath
    figures: dict[str, UPath]
    findings: pl.DataFrame
    sensitivity: pl.DataFrame | None = None
    config_id: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def index(self) -> UPath:
        return self.directory / "index.html"



# What a layer's missing or damaged partition of each table leaves out of the report (the views read
# only verified files; the findings aggregate layer_summary, built from geometry and functional_summary).
LEFT_OUT: dict[str, str] = {
    "activations": "the analysis tables of the layer are still shown (they were computed before it went)",
    "tokens": "the token text (token, context) of its residuals and functional_metrics is NULL; its figures and "
              "findings are still included",
    "local_fits": "the analysis tables of the layer are still shown (they were computed before it went)",
    "residuals": "the analysis tables of the layer are still shown (they were computed before it went)",
    "geometry": "the layer is left out of every per-layer figure and every finding",
    "spectra": "the layer is left out of the spectra and of finding 3 (effective ranks)",
    "geometry_bootstrap": "the layer is left out of the findings' intervals",
    "functional_metrics": "the layer is left out of the error-against-KL figure",
    "functional_summary": "the layer has no KL or Spearman figures: finding 4 and the control curves leave it out",
    "functional_bootstrap": "the layer is left out of finding 4's interval",
    "control_geometry": "the layer's positive controls are left out of the findings' control columns",
    "control_spectra": "the layer's positive controls are left out of finding 3's control column",
    "control_geometry_bootstrap": "the layer is left out of the controls' intervals",
    "context_split": "the layer is left out of the exact split's figure and table",
    "context_split_bootstrap": "the layer's exact split has no interval",
    "context_heads": "the layer is left out of the heads' heat map and the distance profile",
}

def reports_root(root: RootLike) -> UPath:
    return as_root(root) / REPORTS


# Rows already read, by (SQL, parameters): a command that builds several reports (`updatelens report`: each
# model's, then the comparison) passes one, so it reads each model's summary, bands and findings once and
# its reports show the same rows.
Reads = dict[tuple[str, tuple[object, ...]], pl.DataFrame]


def _frame(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[object] | None = None,
           reads: Reads | None = None) -> pl.DataFrame:
    if reads is None:
        return con.execute(sql, list(params or [])).pl()
    key = (sql, tuple(params or ()))
    if key not in reads:
        reads[key] = con.execute(sql, list(params or [])).pl()
    return reads[key]


def _views(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {row[0] for row in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


# ---- model report -------------------------------------------------------------------------------
# one model and configuration's rows, as both reports read them
SUMMARY_SQL = "SELECT * FROM layer_summary WHERE model = ? AND config_id = ? ORDER BY layer, fn_class"
BANDS_SQL = "SELECT * FROM layer_bands WHERE model = ? AND config_id = ?"
FINDINGS_SQL = "SELECT * FROM findings WHERE model = ? AND config_id = ? ORDER BY finding"


def _main_config(con: duckdb.DuckDBPyConnection, model: str, preferred: str | None = None,
                 reads: Reads | None = None) -> tuple[str, list[str]]:
    """The configuration the report shows: `preferred` (the deployment's, i.e. the one just run) where
    it has stored layers, else the one covering most layers (partitions can hold another after a
    partial rerun); a note names the others."""
    counts = _frame(con, "SELECT config_id, count(DISTINCT layer) AS n FROM layer_summary WHERE model = ? "
                         "GROUP BY config_id ORDER BY n DESC, config_id", [model], reads)
    if counts.is_empty():
        raise ReportError(f"no results for model {model!r} are stored; materialize it first "
                          f"(`updatelens run --model {model}`)")
    if preferred is not None and preferred in counts["config_id"].to_list():
        counts = pl.concat([counts.filter(pl.col("config_id") == preferred),
                            counts.filter(pl.col("config_id") != preferred)])
    notes = []
    if len(counts) > 1:
        others = ", ".join(f"{r['config_id']} ({r['n']} layers)" for r in counts.slice(1).to_dicts())
        notes.append(f"Some layers hold results of other configurations ({others}); this report shows "
                     f"config {counts['config_id'][0]} ({counts['n'][0]} layers) only.")
    return str(counts["config_id"][0]), notes


def sensitivity_pivot(sensitivity: pl.DataFrame) -> pl.DataFrame:
    """finding x (convention: setting) with the value, its verdict, the paired interval of its change
    from the baseline, and a mark when the verdict flips (differs, and the change separates)."""
    if sensitivity.is_empty():
        return sensitivity
    frame = sensitivity.with_columns(
        column=pl.col("convention") + pl.lit(": ") + pl.col("setting"),
        cell=pl.col("value").round(3).cast(pl.String).fill_null("—")
        + pl.lit(" ") + pl.col("verdict").fill_null("no interval")
        + pl.when(pl.col("convention") == "baseline").then(pl.lit("")).otherwise(
            pl.lit("; Δ ") + pl.col("delta").round(3).cast(pl.String).fill_null("—") + _interval("delta_ci_lo", "delta_ci_hi"))
        + pl.when(pl.col("flips")).then(pl.lit(" (flips)")).otherwise(pl.lit("")),
    )
    order = frame.sort(["convention", "setting"])["column"].unique(maintain_order=True).to_list()
    baseline = [c for c in order if c.startswith("baseline")]
    pivot = frame.pivot(on="column", index="finding", values="cell", aggregate_function="first").sort("finding")
    return pivot.select(["finding", *baseline, *[c for c in order if c not in baseline]])


AGAINST_EXACT = ("cos_res_ctx_median", "res_share_ctx_mean", "cos_tok_ctl_median")


def _context_sources(heads: pl.DataFrame, model: str, staging: Path) -> str:
    """The report's part on where a comes from: the heat map and distance profile, and per layer the top
    heads, the heads-together remainder and the distance shares."""
    if heads.is_empty():
        return ""
    rows = []
    for layer in heads["layer"].unique().sort().to_list():
        mine = heads.filter(pl.col("layer") == layer)
        per_head = mine.filter(pl.col("kind") == "head").sort("share", descending=True)
        top = ", ".join(f"{r['source']}: {r['share']:.2f} [{r['share_lo']:.2f}, {r['share_hi']:.2f}]"
                        for r in per_head.head(3).iter_rows(named=True))
        together = mine.filter(pl.col("kind") == "together")["share"]
        dist = {r["source"]: r["share"] for r in mine.filter(pl.col("kind") == "distance").iter_rows(named=True)}
        rows.append({"layer": layer, "top heads: share [95%]": top,
                     "heads only together": float(together[0]) if len(together) else None,
                     **{f"{label} back": dist.get(label) for label in dist}})
    return ("<h3>Where the context part comes from</h3><p>" + html.escape(CONTEXT_HEADS_CAPTION) + " SQL: "
            f"<code>SELECT * FROM context_heads WHERE model = '{html.escape(model)}'</code>; per token, the "
            "activations' <code>ctx_head_dot</code>, <code>attn_mass</code> and <code>top_source_pos</code>.</p>"
            + figure_section("context_heads", CONTEXT_HEADS_CAPTION, staging / "context_heads.png")
            + html_table(pl.DataFrame(rows), ()))


def _against_exact(summary: pl.DataFrame, model: str) -> str:
    """The fitted classes' split against the exact one, per layer (layer_summary), where y_ctl was captured."""
    if not set(AGAINST_EXACT) <= set(summary.columns):
        return ""
    rows = summary.filter(pl.col("cos_res_ctx_median").is_not_null())
    if rows.is_empty():
        return ""
    table = rows.select("layer", "fn_class", *(pl.col(c).round(3) for c in AGAINST_EXACT)).sort("fn_class", "layer")
    return ("<h3>The fits against the exact split</h3><p>Is the local fits' residual r the context part a, or "
            "estimation error? Per layer and class, the median over tokens of cos(r, a), the mean share of "
            "||r||<sup>2</sup> that lies along a (cos<sup>2</sup>), and the median cos(Δ_tok, Δ_ctl) (is the fitted "
            "tokenwise update the token's own?). A residual that is the context part has both near 1; pure "
            "estimation error, near 0. Bands: <code>SELECT * FROM layer_bands WHERE model = '"
            + html.escape(model) + "'</code>.</p>" + html_table(table, ()))


def report_problems(report: Report, captions: dict[str, str]) -> list[str]:
    """What the written page lacks: a figure's PNG, or its inlining in index.html, and a findings row
    for every declared finding (updatelens.findings). Empty when the report is complete."""
    page = report.index.read_text(encoding="utf-8")
    missing = [name for name in captions if not report.figures[name].exists() or f"alt='{name}'" not in page]
    present = set(report.findings["finding"].to_list()) if "finding" in report.findings.columns else set()
    absent = [f.id for f in FINDINGS if f.id not in present or f"<td>{f.id}</td>" not in page]
    return ([f"figures missing from the page: {', '.join(missing)}"] if missing else []) + \
        ([f"findings without a row: {', '.join(absent)}"] if absent else [])


def build_model_report(root: RootLike, model: str, config_id: str | None = None, reads: Reads | None = None) -> Report:
    """Regenerate `<root>/reports/<model>/` from the stored tables, showing configuration `config_id`
    where it is stored (else the one covering most layers); raises ReportError if none is. `reads`:
    rows read before from the same unchanged root (see Reads)."""
    root = as_root(root)
    with catalog.connect(root, read_only=True) as con:
        views = _views(con)
        missing = {"layer_summary", "findings", "functional_metrics", "spectra"} - views
        if missing:
            raise ReportError(f"cannot build a report for {model!r}: the catalog at {root} lacks {sorted(missing)}; "
                              f"materialize all five stages first (`updatelens run --model {model}`)")
        config_id, notes = _main_config(con, model, config_id, reads)
        where, params = "model = ? AND config_id = ?", [model, config_id]
        summary = _frame(con, SUMMARY_SQL, params, reads)
        layers = sorted(summary["layer"].unique().to_list())
        picks = fig.depth_layers(layers)
        in_picks = f"layer IN ({', '.join(str(p) for p in picks)})"
        ranks = _frame(con, f"SELECT DISTINCT layer, fn_class, which, effective_rank FROM spectra WHERE {where}", params)
        bands = (_frame(con, BANDS_SQL, params, reads)
                 if "layer_bands" in views else pl.DataFrame())
        angles = _frame(con, f"SELECT layer, fn_class, angle_full_res FROM geometry WHERE {where} AND {in_picks} "
                             f"ORDER BY layer, fn_class, seq, pos", params)  # the order of drawing: fixed
        points = _frame(con, f"SELECT layer, fn_class, rel_err, kl FROM functional_metrics WHERE {where} AND {in_picks} "
                             f"AND variant = 'patch' ORDER BY layer, fn_class, seq, pos", params)
        spectra = _frame(con, f"SELECT layer, fn_class, which, idx, cum_energy FROM spectra WHERE {where} AND {in_picks} "
                              f"ORDER BY layer, fn_class, which, idx", params)
        findings = _frame(con, FINDINGS_SQL, params, reads)
        split = (_frame(con, f"SELECT * FROM context_split_summary WHERE {where} ORDER BY layer", params)
                 if "context_split_summary" in views else pl.DataFrame())
        heads = (_frame(con, f"SELECT * FROM context_heads WHERE {where} ORDER BY layer, kind, idx", params)
                 if "context_heads" in views else pl.DataFrame())
        converged = (_frame(con, "SELECT * FROM convergence WHERE model = ?", [model])
                     if "convergence" in views else pl.DataFrame())
        sensitivity, swept_layers = None, ""
        if "sensitivity" in views:
            sensitivity = _frame(con, "SELECT * FROM sensitivity WHERE model = ?", [model])
            swept = _frame(con, "SELECT any_value(layers) AS layers FROM sweep_runs WHERE model = ?", [model])
            swept_layers = str(swept["layers"][0] or "")
        prov = _frame(con, f"SELECT model_revision, weights, corpus, corpus_slice, code_version, config_json FROM geometry "
                           f"WHERE {where} LIMIT 1", params).to_dicts()[0]
        damaged = _frame(con, "SELECT table_name, layer, reason FROM damaged_partitions WHERE model = ? "
                              "ORDER BY layer, table_name", [model])
    depth = summary["model_layers"].drop_nulls().to_list()
    n_layers = max(depth) if depth else layers[-1] + 1  # the model's depth, not the highest layer analysed
    if len(layers) < n_layers:
        notes.append(f"Only layers {', '.join(map(str, layers))} are stored; curves skip the others.")
    # a layer with a table missing or damaged is not presented as complete: say which, what it leaves
    # out of this report, and what to run
    problems = {(row["layer"], row["table_name"]): row["reason"] for row in damaged.iter_rows(named=True)}
    for _, layer, absent in (i for i in incomplete_layers(root, TABLES) if i[0] == model):
        for table in absent:
            problems.setdefault((layer, table), "missing")
    for _, layer, runs in (m for m in mixed_layers(root, TABLES) if m[0] == model):
        configs = ", ".join(f"{config} ({len(tables)} tables)" for config, tables in runs.items())
        notes.append(f"Layer {layer}: its tables come from different runs ({configs}), as a run with other settings "
                     f"leaves them when it stops midway; `updatelens run` recomputes the layer.")
    for (layer, table), reason in sorted(problems.items()):
        what = "missing" if reason.startswith("missing") else f"damaged ({reason})"
        left_out = LEFT_OUT.get(table, "it is left out")
        notes.append(f"Layer {layer}: its {table} partition is {what}; {left_out}. `updatelens verify --repair`, "
                     f"then `updatelens run`, recompute it.")
    title = f"UpdateLens report: {model}"
    drawings = {
        "layer_curves": lambda: fig.layer_curves(summary, ranks, f"{model}, config {config_id}", bands),
        "angle_histograms": lambda: fig.angle_histograms(angles, picks, f"{model}: residual angles"),
        "error_vs_kl": lambda: fig.error_vs_kl(points, picks, f"{model}: error vs output perturbation"),
        "energy_curves": lambda: fig.energy_curves(spectra, picks, f"{model}: singular-value energy"),
        "controls": lambda: fig.controls(summary, f"{model}: is it the residual's direction or only its size?", bands),
    }
    if not split.is_empty():
        drawings["context_split"] = lambda: fig.context_split(split, f"{model}: what attention to the context adds")
    if not heads.is_empty():
        drawings["context_heads"] = lambda: fig.context_heads(heads, f"{model}: where the context part comes from")
    if not converged.is_empty():
        drawings["convergence"] = lambda: fig.convergence(converged, f"{model}: findings against the sample size "
                                                                     f"(95% bootstrap intervals over sequences)")
    summary_cols = ["layer", "fn_class", "n_tokens", "rel_err_median", "cos_full_tok_median", "cos_full_tok_map_median",
                    "frac_res_angle_gt60", "proj_full_m16", "proj_tok_m16", "proj_res_m16", "m90_tok", "kl_mean",
                    "spearman_relerr_kl", "kl_mean_random_control", "kl_mean_crude_control", "kl_mean_context",
                    "spearman_ctx_kl", "kl_ratio_context_random", "kl_ratio_random",
                    "kl_later_mean", "kl_later_random_mean", "later_ratio_median", "spearman_kl_later"]
    config = json.loads(prov["config_json"])

    def fill(staging: Path) -> None:
        save_pngs({staging / f"{name}.png": draw() for name, draw in drawings.items()})
        sections = [
            "<h2>Provenance</h2>" + html_table(pl.DataFrame({
                "model": [model], "revision": [prov["model_revision"]], "weights": [prov["weights"]],
                "corpus": [prov["corpus"]],
                "corpus slice": [prov["corpus_slice"]], "config id": [config_id], "code version": [prov["code_version"]],
                "layers": [f"{len(layers)} of {n_layers}"]})),
            "".join(f"<p><i>{html.escape(n)}</i></p>" for n in notes),
            "<h2>Findings</h2><p>Each of the paper's findings (docs/method.md in the repository) measured on this "
            "model, on the class with "
            "the lowest median relative error and, where the model has attention, on the exact split (class "
            "<code>exact</code>: the self-and-first output in the place of a fit, no estimator), with the threshold "
            "that decides whether it holds, its 95% bootstrap "
            "interval (<code>ci_lo</code>, <code>ci_hi</code>), and its null: what the same measure gives where "
            "the claimed structure is absent (<code>null_source</code>), with its own interval, and its tokenwise "
            "control: the same measure when the truth is tokenwise by construction (the block with each token "
            "attending to itself and the window's first position, or a linear map fitted without the token's "
            "document). The verdict: "
            "<b>holds</b> when it clears the threshold and beats the null (the control's outcome beside it), "
            "<b>estimator-limited</b> when it does not clear and the control shows the estimator cannot show "
            "the structure at this sample size (the control does not clear either, or the real value cannot be "
            "told from it), <b>no control</b> when it does not clear and no control was measured to tell, "
            "<b>opposite</b> when the value is beyond its null on the wrong side of the claim, "
            "<b>fails</b> when the whole interval misses the threshold, <b>undecided</b> when it straddles it, "
            "<b>indistinct</b> when it clears the threshold but not the null: noise would pass too. SQL: "
            f"<code>SELECT * FROM findings WHERE model = '{html.escape(model)}'</code> (view definition below).</p>"
            + html_table(findings_summary(findings))
            + "<details><summary>How each finding is measured, its null and its threshold</summary>"
            + html_table(findings.select("finding", "statement", "measure", "null_source", "threshold_source",
                                         "control_role", "layers", "note"), ()) + "</details>",
        ]
        if not split.is_empty():
            sections.append(
                "<h2>What attention to the context adds</h2><p>Every window starts with one fixed token, so block l "
                "run with each token attending to itself and that first position is exactly tokenwise, and each "
                "update splits with no estimator: y = y_ctl(x) + a, Δ_full = Δ_ctl + a, a being what attention to "
                "the rest of the context adds. Per layer, the medians over tokens with 95% bootstrap bands over "
                "documents. SQL: <code>SELECT * FROM context_split_summary WHERE model = '"
                + html.escape(model) + "'</code>; per token: <code>context_split</code>.</p>"
                + figure_section("context_split", CONTEXT_SPLIT_CAPTION, staging / "context_split.png")
                + html_table(split.select(["layer", "n_tokens", *[c for c in split.columns if c.endswith("_median")]]),
                             ())
                + _against_exact(summary, model)
                + _context_sources(heads, model, staging))
        if sensitivity is not None and not sensitivity.is_empty():
            sections.append(
                "<h2>Sensitivity to the conventions</h2><p>Each finding re-measured with one convention changed "
                f"(a convention sweep over layers {html.escape(swept_layers)}, without controls): its value, its "
                "verdict, and Δ, its change from the sweep's own baseline with the 95% interval of the change "
                "(paired resamples of the same documents); <b>flips</b> marks a verdict that differs from the "
                "baseline's where the change's interval excludes zero. SQL: <code>SELECT * "
                f"FROM sensitivity WHERE model = '{html.escape(model)}'</code>.</p>"
                + html_table(sensitivity_pivot(sensitivity), ()))
        if not converged.is_empty():
            sections.append(
                "<h2>Convergence with the sample size</h2><p>Each finding on nested samples of growing size "
                "(<code>updatelens converge</code>), per class, with its 95% bootstrap band; the dashed line is the "
                "threshold. SQL: <code>SELECT * FROM convergence WHERE model = '" + html.escape(model) + "'</code>.</p>"
                + figure_section("convergence", CONVERGENCE_CAPTION, staging / "convergence.png")
                + html_table(converged.select(["finding", "fn_class", "n_tokens", "value", "ci_lo", "ci_hi",
                                               "verdict", "threshold", "layers"]), ()))
        sections.append("<h2>Figures</h2>" + "".join(
            figure_section(name, caption, staging / f"{name}.png") for name, caption in MODEL_FIGURES.items()))
        sections.append("<h2>Per-layer summary</h2><p>SQL view <code>layer_summary</code>.</p>"
                        + html_table(summary.select([c for c in summary_cols if c in summary.columns])))
        sections.append("<h2>Configuration</h2><pre>" + html.escape(json.dumps(config, indent=1)) + "</pre>"
                        "<h2>How the findings are derived</h2><pre>"
                        + html.escape("\n".join(findings_sql())) + "</pre>")
        (staging / "index.html").write_text(page(title, sections), encoding="utf-8")

    directory = publish_dir(root, reports_root(root) / model, fill)
    return Report(title=title, directory=directory,
                  figures={name: directory / f"{name}.png" for name in MODEL_FIGURES},
                  findings=findings, sensitivity=sensitivity, config_id=config_id, notes=notes)


def findings_summary(findings: pl.DataFrame) -> pl.DataFrame:
    """The findings table of a report: one narrow row per finding (value, null and tokenwise control
    each with its interval, where each comparison lands, the verdict); the long texts go to a fold."""
    def with_interval(value: str, lo: str, hi: str) -> pl.Expr:
        return pl.col(value).round(3).cast(pl.String).fill_null("—") + _interval(lo, hi)

    verdict = pl.col("verdict").fill_null(
        pl.when(pl.col("note").is_not_null()).then(pl.lit("not measured")).otherwise(pl.lit("no interval")))
    return findings.select(
        "finding", pl.col("fn_class").alias("class"),
        with_interval("value", "ci_lo", "ci_hi").alias("value [95%]"), "threshold",
        (with_interval("null_value", "null_ci_lo", "null_ci_hi") + _shift_p()).alias("null [95%]"),
        pl.col("null_outcome").alias("vs null"),
        (pl.col("control").fill_null("—") + pl.lit(" ") + with_interval("control_value", "control_ci_lo", "control_ci_hi")
         ).alias("tokenwise control [95%]"),
        pl.col("control_outcome").alias("vs control"), verdict.alias("verdict"))


def _shift_p() -> pl.Expr:
    """'; p over all shifts 0.033' where the null was enumerated (Finding.shift_null), else nothing."""
    p = pl.col("null_p")
    return pl.when(p.is_not_null()).then(pl.lit("; p over all shifts ") + p.round(3).cast(pl.String)).otherwise(pl.lit(""))


# ---- comparison ---------------------------------------------------------------------------------
def _interval(lo: str, hi: str) -> pl.Expr:
    return pl.when(pl.col(lo).is_not_null()).then(
        pl.lit(" [") + pl.col(lo).round(3).cast(pl.String) + pl.lit(", ") + pl.col(hi).round(3).cast(pl.String)
        + pl.lit("]")).otherwise(pl.lit(""))


def findings_pivot(findings: pl.DataFrame) -> pl.DataFrame:
    """finding x model: the value with its interval, the null with its interval, the positive control
    with its interval (where the finding has one), and the verdict."""
    verdict = pl.col("verdict").fill_null(
        pl.when(pl.col("note").is_not_null()).then(pl.lit("not measured")).otherwise(pl.lit("no interval")))
    control = pl.lit("")
    if "control_value" in findings.columns:
        control = pl.when(pl.col("control_value").is_not_null()).then(
            pl.lit("; ") + pl.col("control") + pl.lit(" ") + pl.col("control_value").round(3).cast(pl.String)
            + _interval("control_ci_lo", "control_ci_hi")).otherwise(pl.lit(""))
    cells = findings.with_columns(
        cell=pl.col("value").round(3).cast(pl.String).fill_null("—") + _interval("ci_lo", "ci_hi")
        + pl.lit("; null ") + pl.col("null_value").round(3).cast(pl.String).fill_null("—")
        + _interval("null_ci_lo", "null_ci_hi") + control + pl.lit(": ") + verdict)
    thresholds = findings.group_by("finding").agg(pl.col("threshold").first(), pl.col("statement").first())
    pivot = cells.pivot(on="model", index="finding", values="cell", aggregate_function="first")
    return thresholds.join(pivot, on="finding").sort("finding")


CONTEXT_ACROSS_CAPTION = ("Left: per model, the median ||a|| / ||Δ_full|| (what attention to the context adds, "
                          "relative to the update) and cos(Δ_full, Δ_ctl) (finding 1 on the exact split; 0.9 dotted) "
                          "against normalised depth, with 95% bands over documents. Right: the share of a added by the "
                          "previous token (solid) and by sources more than 16 positions back (dashed).")


def _context_across(con: duckdb.DuckDBPyConnection, views: set[str], model: str, config_id: str) -> pl.DataFrame:
    """One model's exact split per layer (`context_split_summary`) with its distance shares
    (`context_heads`: share_d1, share_far), on normalised depth; empty where it has none."""
    if "context_split_summary" not in views:
        return pl.DataFrame()
    split = _frame(con, "SELECT s.*, (SELECT any_value(model_layers) FROM context_split c WHERE c.model = s.model) "
                        "AS model_layers FROM context_split_summary s WHERE model = ? AND config_id = ?",
                   [model, config_id])
    if split.is_empty():
        return split
    if "context_heads" in views:
        far = _frame(con, "SELECT layer, max(CASE WHEN source = '1' THEN share END) AS share_d1, "
                          "max(CASE WHEN source = '>16' THEN share END) AS share_far FROM context_heads "
                          "WHERE model = ? AND config_id = ? AND kind = 'distance' GROUP BY layer", [model, config_id])
        split = split.join(far, on="layer", how="left")
    return split.with_columns(depth=pl.col("layer") / pl.max_horizontal(pl.col("model_layers") - 1, pl.lit(1)))


def build_comparison(root: RootLike, reads: Reads | None = None) -> Report:
    """`<root>/reports/_comparison/`: every model with results, side by side on normalised depth.
    `reads`: rows read before from the same unchanged root (see Reads)."""
    root = as_root(root)
    with catalog.connect(root, read_only=True) as con:
        if "findings" not in _views(con):
            raise ReportError(f"no complete results are stored under {root}; materialize a model first")
        models = _frame(con, "SELECT DISTINCT model FROM layer_summary ORDER BY model")["model"].to_list()
        views = _views(con)
        has_bands = "layer_bands" in views
        parts, finding_parts, band_parts, context_parts = [], [], [], []
        for model in models:
            config_id, _ = _main_config(con, model, reads=reads)
            context_parts.append(_context_across(con, views, model, config_id))
            findings = _frame(con, FINDINGS_SQL, [model, config_id], reads).filter(pl.col("estimator") != "exact")
            if findings.is_empty():
                continue
            best = str(findings["fn_class"][0])
            parts.append(_frame(con, SUMMARY_SQL, [model, config_id], reads).filter(pl.col("fn_class") == best))
            finding_parts.append(findings)
            if has_bands:
                band_parts.append(_frame(con, BANDS_SQL, [model, config_id], reads).filter(pl.col("fn_class") == best))
        shown = [f"{f['model'][0]}/{f['config_id'][0]}" for f in finding_parts]  # each model's main config
        across = pl.DataFrame()  # with one model shown there is no pair to compare
        if len(shown) > 1:
            across = _frame(con, "SELECT finding, model_a, model_b, value_a, value_b, diff, diff_ci_lo, diff_ci_hi, "
                                 "n_resamples, resampling, model_a || '/' || config_a AS key_a, "
                                 "model_b || '/' || config_b AS key_b "
                                 "FROM findings_across_models ORDER BY finding, model_a, model_b")
            across = across.filter(pl.col("key_a").is_in(shown) & pl.col("key_b").is_in(shown)).drop(["key_a", "key_b"])
    if not parts:
        raise ReportError(f"no model under {root} has findings yet (all five stages are needed)")
    summary = pl.concat(parts, how="diagonal_relaxed").with_columns(  # the model's real depth, whatever was analysed
        depth=pl.col("layer") / pl.max_horizontal(pl.col("model_layers") - 1, pl.lit(1)))
    findings = pl.concat(finding_parts, how="diagonal_relaxed")
    depths = summary.select("model", "layer", "depth").unique()
    bands = (pl.concat(band_parts, how="diagonal_relaxed").join(depths, on=["model", "layer"])
             if band_parts else pl.DataFrame())
    title = f"UpdateLens comparison: {len(parts)} model(s)"
    context = pl.concat([c for c in context_parts if not c.is_empty()], how="diagonal_relaxed") \
        if any(not c.is_empty() for c in context_parts) else pl.DataFrame()

    def fill(staging: Path) -> None:
        figures = {staging / "comparison_curves.png": fig.comparison_curves(summary, "per-layer curves on normalised depth",
                                                                            bands)}
        if not context.is_empty():
            figures[staging / "context_across_models.png"] = fig.context_across_models(
                context, "what attention to the context adds, on normalised depth")
        save_pngs(figures)
        sections = [
            "<h2>Findings by model</h2><p>Each finding per model, on its best class: value [95% interval]; its null "
            "[interval]; its positive control [interval], where the finding has one: verdict (holds, fails, "
            "undecided, indistinct from its null, opposite to the claim, or estimator-limited), coloured as in "
            "the model reports. SQL: "
            "<code>SELECT * FROM findings</code>.</p>" + html_table(findings_pivot(findings), tuple(models)),
            "<h2>Figures</h2>" + "".join(figure_section(name, caption, staging / f"{name}.png")
                                         for name, caption in COMPARISON_FIGURES.items()),
            "<h2>Models</h2><p>Each model's configuration, the class its findings are read on, and the weights it "
            "ran with (a quantized file's type, dequantized).</p>"
            + html_table(findings.group_by("model", "config_id", "fn_class", "weights").agg().sort("model")),
        ]
        if not context.is_empty():
            sections.append("<h2>What attention to the context adds</h2><p>Per model (attention models; Mamba has no "
                            "such split), the exact split on normalised depth: the median ||a|| / ||Δ_full|| and "
                            "cos(Δ_full, Δ_ctl) with their 95% bands over documents, and the share of a that the "
                            "previous token and the sources more than 16 positions back add (the context restored "
                            "nearest first). SQL: <code>SELECT * FROM context_split_summary</code>, <code>SELECT * "
                            "FROM context_heads WHERE kind = 'distance'</code>.</p>"
                            + figure_section("context_across_models", CONTEXT_ACROSS_CAPTION,
                                              staging / "context_across_models.png"))
        if not across.is_empty():
            sections.insert(1, "<h2>Model against model</h2><p>Each finding of one model minus the other's, with the "
                               "95% interval of the difference: resample by resample where both models sampled the "
                               "same documents (a paired bootstrap), from independent draws where they did not "
                               "(column resampling); finding 3's from its jackknife over documents, paired group by "
                               "group or, with different documents, the two half-widths in quadrature. The paper's "
                               "size claims read here: finding 4's Spearman higher in the larger model (diff &gt; 0 "
                               "with the larger as model_a), finding 5's gap smaller in the smaller one. "
                               "SQL: <code>SELECT * FROM findings_across_models</code>.</p>"
                               + html_table(across, ()))
        (staging / "index.html").write_text(page(title, sections), encoding="utf-8")

    directory = publish_dir(root, reports_root(root) / COMPARISON, fill)
    return Report(title=title, directory=directory,
                  figures={name: directory / f"{name}.png" for name in COMPARISON_FIGURES}, findings=findings)
