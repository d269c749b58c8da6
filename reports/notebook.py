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
    from updatelens.reports.build import findings_summary
    from updatelens.reports.html import TABLE_STYLE, html_table

    config = catalog.query(root, "SELECT config_id, count(DISTINCT layer) AS n FROM layer_summary WHERE model = $1 "
                                 "GROUP BY config_id ORDER BY n DESC, config_id LIMIT 1", [model.value])["config_id"][0]
    findings = catalog.query(root, "SELECT * FROM findings WHERE model = $1 AND config_id = $2 ORDER BY finding",
                             [model.value, config])
    weights = findings["weights"][0] if len(findings) else "unknown"
    findings_html = f"<style>{TABLE_STYLE}</style>" + html_table(findings_summary(findings))
    mo.vstack([mo.md(f"## Do the paper's claims hold?\nConfiguration `{config}`; the model ran with {weights}. "
                     "Each finding on the best class (and on the exact split, class `exact`), with its 95 % interval "
                     "over documents, its null (what the "
                     "same measure gives without the claimed structure) and its positive control (the same "
                     "measure when the truth is tokenwise by construction). `estimator-limited`: the value does not "
                     "clear and a tokenwise target does not either, so the estimator cannot show the structure at "
                     "this sample size; `no control`: it does not clear and no control was measured to tell; "
                     "`opposite`: beyond the null on the wrong side of the claim; `undecided`: the interval "
                     "straddles the threshold; `indistinct`: it clears the threshold but not the null. Colours as "
                     "in the reports."),
               mo.Html(findings_html)])
    return config, findings, findings_html


@app.cell
def _(alt, catalog, config, mo, model, pl, root, views):
    # (column of layer_summary, readable title, log scale): the report's per-layer panels
    _panels = (("rel_err_median", "relative error ‖r‖ / ‖Δ_full‖ (median)", False),
               ("cos_full_tok_median", "alignment cos(Δ_full, Δ_tok) (median)", False),
              ("frac_res_angle_gt60", "share of residual angles above 60°", False),
              ("proj_res_m16", "energy of r on the top-16 tokenwise directions", False),
              ("kl_mean", "mean KL with r removed (nats, log scale)", True),
              ("spearman_relerr_kl", "Spearman(relative error, KL)", False),
              ("kl_ratio_random", "KL(remove r) / KL(random move, same norm) (log)", True))
    summary = catalog.query(root, "SELECT * FROM layer_summary WHERE model = $1 AND config_id = $2 ORDER BY layer",
                            [model.value, config])
    _bands = (catalog.query(root, "SELECT * FROM layer_bands WHERE model = $1 AND config_id = $2", [model.value, config])
             if "layer_bands" in views else pl.DataFrame({"layer": [], "fn_class": []}))
    _charts = []
    for _column, _title, _log in _panels:
        if _column not in summary.columns or summary[_column].null_count() == len(summary):
            continue
        _rows = summary.select("layer", "fn_class", pl.col(_column).alias("value"))
        _null = f"{_column}_null"
        if _null in summary.columns:
            _rows = _rows.with_columns(summary[_null].alias("null"))
        for _name, _source in (("lo", f"{_column}_lo"), ("hi", f"{_column}_hi"), ("null_lo", f"{_null}_lo"),
                             ("null_hi", f"{_null}_hi")):
            if _source in _bands.columns:
                _rows = _rows.join(_bands.select("layer", "fn_class", pl.col(_source).alias(_name)),
                                 on=["layer", "fn_class"], how="left")
        _scale = alt.Scale(type="log") if _log else alt.Scale(zero=False)
        _base = alt.Chart(_rows).encode(x=alt.X("layer:Q"), color=alt.Color("fn_class:N", title="class"))
        _layers = [_base.mark_line(point=True).encode(
            y=alt.Y("value:Q", title=None, scale=_scale),
            tooltip=["layer", "fn_class", alt.Tooltip("value:Q", format=".3g")])]
        if "lo" in _rows.columns:  # the 95 % band over the resamples
            _layers.insert(0, _base.mark_area(opacity=0.2).encode(y="lo:Q", y2="hi:Q"))
        if "null" in _rows.columns:  # the same measure without the claimed structure, dashed
            _layers.append(_base.mark_line(strokeDash=[4, 3], opacity=0.7).encode(y="null:Q"))
            if "null_lo" in _rows.columns:
                _layers.insert(0, _base.mark_area(opacity=0.08).encode(y="null_lo:Q", y2="null_hi:Q"))
        if _column == "kl_ratio_random":  # its null: 1
            _layers.append(alt.Chart(pl.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[4, 3], color="gray")
                          .encode(y="y:Q"))
        _charts.append(alt.layer(*_layers).properties(title=_title, width=260, height=160))
    curves = alt.concat(*_charts, columns=3)
    mo.vstack([mo.md("## Layer curves\nShaded: the 95 % band over the document resamples; dashed: the "
                     "statistic's null (the same measure on a residual of the same length in a random direction; "
                     "for the Spearman, the random control's; for the KL ratio, 1), with its band. Hover a point "
                     "for its value."), curves])
    return curves, summary


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
    top = tokens.sort("kl", descending=True).head(10).select(
        "token", "context", pl.col("kl").round_sig_figs(3).alias("KL (nats)"),
        pl.col("rel_err").round(3).alias("relative error"))
    mo.vstack([mo.md(f"## Error against KL at layer {layer.value}\nHover a token to read it in context."),
               mo.ui.altair_chart(scatter), mo.md("Tokens whose residual matters most:"), mo.ui.table(top, selection=None)])
    return (tokens,)


@app.cell
def _(alt, catalog, layer, mo, model, pl, root, views):
    if {"context_heads", "context_split"} <= views:
        _heads = catalog.query(root, "SELECT kind, source, share, share_lo, share_hi, mass FROM context_heads "
                                     "WHERE model = $1 AND layer = $2 ORDER BY kind DESC, idx", [model.value, layer.value])
        _split = catalog.query(
            root, "SELECT s.seq, s.pos, t.token, t.context, s.ctx_ratio, a.top_source_pos, a.top_source_weight "
                  "FROM context_split s JOIN tokens t USING (model, layer, seq, pos) "
                  "JOIN activations a USING (model, layer, seq, pos) WHERE s.model = $1 AND s.layer = $2",
            [model.value, layer.value])
        _text = {(r["seq"], r["pos"]): r["token"] for r in catalog.query(
            root, "SELECT seq, pos, token FROM tokens WHERE model = $1 AND layer = $2",
            [model.value, layer.value]).iter_rows(named=True)}
        _split = _split.with_columns(pl.Series("sources", [
            ", ".join(f"{_text.get((r['seq'], p), '?')!r} ({w:.2f})" for p, w in
                      zip(r["top_source_pos"] or [], r["top_source_weight"] or []) if p >= 0)
            for r in _split.iter_rows(named=True)]))
        _bars = (alt.Chart(_heads.filter(pl.col("kind") != "distance")).mark_bar()
                 .encode(x=alt.X("source:N", title="head", sort=None), y=alt.Y("share:Q", title="share of a"),
                         tooltip=["source", alt.Tooltip("share:Q", format=".3f"), alt.Tooltip("share_lo:Q", format=".3f"),
                                  alt.Tooltip("share_hi:Q", format=".3f"), alt.Tooltip("mass:Q", format=".3f")])
                 .properties(width=260, height=220))
        _far = (alt.Chart(_heads.filter(pl.col("kind") == "distance")).mark_bar()
                .encode(x=alt.X("source:N", title="positions back", sort=None), y=alt.Y("share:Q", title="share of a"),
                        tooltip=["source", alt.Tooltip("share:Q", format=".3f"), alt.Tooltip("mass:Q", format=".3f")])
                .properties(width=200, height=220))
        _tokens = (alt.Chart(_split).mark_circle(size=16, opacity=0.5)
                   .encode(x=alt.X("pos:Q", title="position"), y=alt.Y("ctx_ratio:Q", title="‖a‖ / ‖Δ_full‖"),
                           tooltip=["token", "context", "sources", alt.Tooltip("ctx_ratio:Q", format=".3f"), "seq", "pos"])
                   .properties(width=560, height=260))
        _body = mo.vstack([mo.ui.altair_chart(_bars | _far),
                           mo.md("Per token: hover to read it, its context and the three sources it attends to most "
                                 "(averaged over heads, the first position and itself aside)."),
                           mo.ui.altair_chart(_tokens)])
    else:
        _body = mo.md("No exact split here (an attention model's activations hold it).")
    mo.vstack([mo.md(f"## Where the context part comes from at layer {layer.value}\nPer head, the share of a = y - "
                     "y_ctl along the head's context restored alone (the rest: what heads add only together, row "
                     "'all heads'); per source distance, what each distance adds to the nearer ones."), _body])
    return


@app.cell
def _(catalog, mo, model, root, views):
    if "calibration" in views:
        _calibration = catalog.query(
            root, "SELECT layer, n_tokens, k, fn_class, target, round(cos_full_tok_median, 3) AS cos, "
                  "round(cos_lo, 3) AS cos_lo, round(cos_hi, 3) AS cos_hi, round(rel_err_median, 3) AS rel_err, "
                  "finding_1 FROM calibration WHERE model = $1 ORDER BY layer, n_tokens, k, fn_class, target",
            [model.value])
        _body = mo.ui.table(_calibration, selection=None) if len(_calibration) else mo.md(
            f"No calibration study of {model.value} yet: `updatelens calibrate --model {model.value}` makes one.")
    else:
        _body = mo.md("No calibration study yet: `updatelens calibrate` makes one.")
    mo.vstack([mo.md("## What the estimator can see\nThe calibration study: finding 1's cosine for the real layer "
                     "and for targets tokenwise by construction (self_first, linear) as the sample grows. Where "
                     "the tokenwise target does not clear 0.9, the estimator cannot show the structure at that "
                     "size."), _body])
    return


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
