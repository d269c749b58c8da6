"""The paper's questions over the catalog, interactively: a marimo notebook.

    updatelens notebook [--data-root DIR]     opens it in the browser (marimo edit)
    python -m updatelens.reports.notebook     runs every cell headless (what the tests do)

It reads the stored results only (no model is loaded), from $UPDATELENS_DATA or ./data.
"""

import marimo

app = marimo.App(width="medium", app_title="UpdateLens")


@app.cell
def _():
    import os

    import altair as alt
    import marimo as mo
    import polars as pl

    from updatelens.storage import catalog

    root = os.environ.get("UPDATELENS_DATA", "data")
    views = set(catalog.query(root, "SELECT table_name FROM information_schema.tables")["table_name"])
    if "layer_summary" not in views:
        raise SystemExit(f"no results under {root}: run `updatelens run` first (or set UPDATELENS_DATA)")
    models = catalog.query(root, "SELECT DISTINCT model FROM layer_summary ORDER BY model")["model"].to_list()
    return alt, catalog, mo, models, pl, root, views


@app.cell
def _(mo, models):
    model = mo.ui.dropdown(models, value=models[0], label="model")
    model  # noqa: B018 - a cell's last expression is what marimo shows
    return (model,)


@app.cell
def _(catalog, mo, model, root):
    findings = catalog.query(root, "SELECT finding, fn_class, round(value, 3) AS value, round(ci_lo, 3) AS ci_lo, "
                                   "round(ci_hi, 3) AS ci_hi, threshold, round(null_value, 3) AS null, "
                                   "round(null_ci_lo, 3) AS null_lo, round(null_ci_hi, 3) AS null_hi, null_outcome, "
                                   "control, round(control_value, 3) AS control_value, "
                                   "round(control_ci_lo, 3) AS control_lo, round(control_ci_hi, 3) AS control_hi, "
                                   "control_outcome, verdict, measure, null_source "
                                   "FROM findings WHERE model = $1 ORDER BY finding", [model.value])
    mo.vstack([mo.md("## Do the paper's claims hold?\nEach finding on the best class, with its 95 % "
                     "bootstrap interval, its null (what the same measure gives without the claimed structure) and "
                     "its positive control (the same measure when the truth is tokenwise by construction). "
                     "`estimator-limited`: a tokenwise target gives the same, so the estimator cannot show the "
                     "structure at this sample size; `opposite`: beyond the null on the wrong side of the claim; "
                     "`undecided`: the interval straddles the threshold; `indistinct`: it clears the threshold "
                     "but not the null."),
               mo.ui.table(findings, selection=None)])
    return (findings,)


@app.cell
def _(alt, catalog, mo, model, root):
    summary = catalog.query(root, "SELECT layer, fn_class, rel_err_median, cos_full_tok_median, frac_res_angle_gt60, "
                                  "kl_mean, spearman_relerr_kl FROM layer_summary WHERE model = $1 ORDER BY layer",
                            [model.value])
    long = summary.unpivot(index=["layer", "fn_class"], variable_name="measure", value_name="value")
    curves = (alt.Chart(long).mark_line(point=True)
              .encode(x="layer:Q", y=alt.Y("value:Q", title=None), color="fn_class:N",
                      tooltip=["layer", "fn_class", "measure", alt.Tooltip("value:Q", format=".3f")])
              .properties(width=260, height=160).facet(facet="measure:N", columns=3)
              .resolve_scale(y="independent"))
    mo.vstack([mo.md("## Layer curves\nHover a point for its value."), mo.ui.altair_chart(curves)])
    return (summary,)


@app.cell
def _(mo, summary):
    layers = sorted(set(summary["layer"].to_list()))
    layer = mo.ui.slider(steps=layers, value=layers[len(layers) // 2], label="layer")
    fn_class = mo.ui.dropdown(sorted(set(summary["fn_class"].to_list())), label="class",
                              value=sorted(set(summary["fn_class"].to_list()))[-1])
    mo.hstack([layer, fn_class])
    return fn_class, layer


@app.cell
def _(alt, catalog, fn_class, layer, mo, model, pl, root):
    tokens = catalog.query(root, "SELECT seq, pos, token, context, rel_err, kl FROM functional_metrics "
                                 "WHERE model = $1 AND layer = $2 AND fn_class = $3 AND variant = 'patch'",
                           [model.value, layer.value, fn_class.value])
    tokens = tokens.with_columns(pl.col("kl").clip(lower_bound=1e-9).alias("kl (floored at 1e-9)"))
    scatter = (alt.Chart(tokens).mark_circle(size=18, opacity=0.5)
               .encode(x=alt.X("rel_err:Q", title="relative error ‖r‖/‖Δ_full‖"),
                       y=alt.Y("kl (floored at 1e-9):Q", scale=alt.Scale(type="log"), title="KL (nats)"),
                       tooltip=["token", "context", alt.Tooltip("kl:Q", format=".2e"),
                                alt.Tooltip("rel_err:Q", format=".3f"), "seq", "pos"])
               .properties(width=560, height=320))
    top = tokens.sort("kl", descending=True).head(10).select("token", "context", "kl", "rel_err")
    mo.vstack([mo.md(f"## Error against KL at layer {layer.value}\nHover a token to read it in context."),
               mo.ui.altair_chart(scatter), mo.md("Tokens whose residual matters most:"), mo.ui.table(top, selection=None)])
    return (tokens,)


@app.cell
def _(catalog, mo, model, root, views):
    if "sensitivity" in views:
        sens = catalog.query(root, "SELECT finding, convention, setting, round(value, 3) AS value, verdict, "
                                   "round(delta, 3) AS delta, round(delta_ci_lo, 3) AS delta_lo, "
                                   "round(delta_ci_hi, 3) AS delta_hi, flips FROM sensitivity WHERE model = $1 "
                                   "ORDER BY finding, convention, setting", [model.value])
        body = mo.ui.table(sens, selection=None)
    else:
        body = mo.md("No convention sweep yet: `updatelens sweep --model <model>` makes one.")
    mo.vstack([mo.md("## How the findings move with the conventions"), body])
    return


if __name__ == "__main__":
    app.run()
