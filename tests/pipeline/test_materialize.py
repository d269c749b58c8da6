"""The pipeline materialized in-process for tiny GPT-2, Llama and Mamba models."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import duckdb
import numpy as np
import pytest

from tests.zoo import N_LAYERS
from updatelens.assets.common import StaleInputError
from updatelens.assets.partitions import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG, layer_key
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.findings import FINDINGS
from updatelens.orchestration.definitions import ASSETS
from updatelens.orchestration.runner import failure_message, materialize_model
from updatelens.stages import TABLES
from updatelens.storage import catalog
from updatelens.storage.layout import partition_file
from updatelens.tables import to_matrix

# One worker runs this module (make test: --dist loadgroup), so the three models are materialized once.
pytestmark = pytest.mark.xdist_group("materialize")

MODELS = ["tiny-gpt2", "tiny-llama", "tiny-mamba"]
CLASSES = ["diagonal", "psd_diagonal", "lowrank", "orthogonal", "global_linear", "mlp"]
N_SEQ, SEQ_LEN = 6, 16
SETTINGS = dict(n_seq=N_SEQ, seq_len=SEQ_LEN, k=8, rank=2, classes=CLASSES, mlp_steps=30)
LAYER_SUMMARY_COLUMNS = {"model", "layer", "fn_class", "n_tokens", "rel_err_median", "cos_full_tok_median",
                         "cos_full_tok_map_median", "frac_res_angle_gt60", "proj_tok_m16", "proj_res_m16",
                         "kl_mean", "spearman_relerr_kl"}


@pytest.fixture(scope="session")  # a worker that leaves this module and comes back keeps it
def run(zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[UpdateLensResource, dg.DagsterInstance]:
    root = tmp_path_factory.mktemp("data")
    lens = UpdateLensResource(data_root=str(root), registry=str(zoo), analysis=AnalysisSettings(**SETTINGS))
    instance = dg.DagsterInstance.ephemeral()
    for model in MODELS:
        result = materialize_model(model, lens, instance)
        assert result.success
    return lens, instance


def test_parquet_files_exist_for_every_table_model_and_layer(run) -> None:
    lens, _ = run
    for table in TABLES:
        for model in MODELS:
            for layer in range(N_LAYERS):
                assert partition_file(lens.root, table, model, layer).exists(), (table, model, layer)


def test_every_view_is_queryable_from_the_catalog_file(run) -> None:
    lens, _ = run
    kept = N_SEQ * (SEQ_LEN - 1)
    expected = {
        "activations": len(MODELS) * N_LAYERS * N_SEQ * SEQ_LEN,
        "tokens": len(MODELS) * N_LAYERS * N_SEQ * SEQ_LEN,
        "local_fits": len(MODELS) * N_LAYERS * len(CLASSES) * kept,
        "residuals": len(MODELS) * N_LAYERS * len(CLASSES) * kept,
        "geometry": len(MODELS) * N_LAYERS * len(CLASSES) * kept,
        # one patch per class + random + crude controls, on kept tokens
        "functional_metrics": len(MODELS) * N_LAYERS * (len(CLASSES) + 2) * kept,
        "functional_summary": len(MODELS) * N_LAYERS * (len(CLASSES) + 2),
        "layer_summary": len(MODELS) * N_LAYERS * len(CLASSES),
    }
    with duckdb.connect(str(catalog.catalog_path(lens.root)), read_only=True) as con:
        for view, n in expected.items():
            assert con.sql(f"SELECT count(*) FROM {view}").fetchone()[0] == n, view
        assert con.sql("SELECT count(*) FROM spectra").fetchone()[0] > 0
        # per finding and model on the best class; and on the exact split where the model has attention (not Mamba):
        # its geometric findings (the KL of finding 4 and the class comparison of 5 are not measured on it)
        assert con.sql("SELECT count(*) FROM findings WHERE estimator <> 'exact'").fetchone()[0] == len(MODELS) * len(FINDINGS)
        exact = con.sql("SELECT model, count(*) FROM findings WHERE estimator = 'exact' GROUP BY model").fetchall()
        assert sorted(exact) == [(m, len(FINDINGS) - 4) for m in MODELS if "mamba" not in m], exact
        columns = {row[0] for row in con.sql("DESCRIBE layer_summary").fetchall()}
        assert LAYER_SUMMARY_COLUMNS <= columns
        bad = con.sql("SELECT count(*) FROM layer_summary WHERE n_tokens <> ? OR kl_mean IS NULL "
                      "OR rel_err_median < 0", params=[kept]).fetchone()[0]
        assert bad == 0
        d = con.sql("SELECT DISTINCT len(x) FROM activations").fetchall()
        assert d == [(32,)]


def test_a_query_answers_with_the_tokens_text(run, zoo: Path) -> None:
    """The tokens with the largest KL at a layer, as text: `functional_metrics` (and `residuals`)
    carry each token's decoded text and its left context, joined from `tokens`."""
    from updatelens.models import load_model
    from updatelens.registry import get_model

    lens, _ = run
    top = catalog.query(lens.root, "SELECT token_id, token, context, kl FROM functional_metrics "
                                   "WHERE model = 'tiny-gpt2' AND layer = 1 AND variant = 'patch' "
                                   "AND fn_class = 'lowrank' ORDER BY kl DESC LIMIT 5")
    assert len(top) == 5 and top["token"].null_count() == 0
    tokenizer = load_model(get_model("tiny-gpt2", zoo)).tokenizer
    for token_id, token, context in top.select("token_id", "token", "context").iter_rows():
        assert token == tokenizer.decode([token_id]) and context.endswith(token)
    unmatched = catalog.query(lens.root, "SELECT count(*) AS n FROM residuals WHERE token IS NULL")["n"][0]
    assert unmatched == 0


def test_the_run_log_shows_the_progress_of_capture_fits_and_patched_passes(run) -> None:
    _, instance = run
    messages = [entry.user_message for run_ in instance.get_runs() for entry in instance.all_logs(run_.run_id)]
    for expected in (f"tiny-gpt2: capture: {N_SEQ * N_LAYERS}/{N_SEQ * N_LAYERS} seq x block (100%)",
                     "tiny-llama layer 1: fit lowrank: ",
                     f"tiny-mamba: patched passes: {N_SEQ * N_LAYERS}/{N_SEQ * N_LAYERS} seq x layer (100%)"):
        assert any(expected in m for m in messages), expected


def test_the_notebook_runs_headless_over_the_catalog(run) -> None:
    """Every cell of the exploration notebook (findings, layer curves, error against KL with the
    token text, sensitivity) executes against the stored results."""
    import os
    import subprocess
    import sys

    lens, _ = run
    env = {**os.environ, "UPDATELENS_DATA": str(lens.root)}
    done = subprocess.run([sys.executable, "-m", "updatelens.reports.notebook"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_notebooks_layer_curves_carry_bands_nulls_and_log_kl(run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer curves as the reports draw them: a 95 % band under each curve, the null dashed, the KL on
    a log axis, readable titles; the findings table coloured by verdict as in the reports."""
    from updatelens.reports.notebook import app

    lens, _ = run
    monkeypatch.setenv("UPDATELENS_DATA", str(lens.root))
    _, defs = app.run()
    spec = defs["curves"].to_dict()
    panels = {p["title"]: p["layer"] for p in spec["concat"]}
    assert "mean KL with r removed (nats, log scale)" in panels and "rel_err_median" not in panels
    for title, layers in panels.items():
        marks = [(layer["mark"]["type"], layer["mark"].get("strokeDash")) for layer in layers]
        if not title.startswith("mean KL"):  # the mean KL has no resamples (as in the reports)
            assert ("area", None) in marks, title  # the band over the resamples
    assert any(layer["encoding"]["y"].get("scale", {}).get("type") == "log"
               for layer in panels["mean KL with r removed (nats, log scale)"])
    nulls = {t for t, layers in panels.items() if any(layer["mark"].get("strokeDash") for layer in layers)}
    assert {"alignment cos(Δ_full, Δ_tok) (median)", "Spearman(relative error, KL)"} <= nulls
    assert 'class="' in defs["findings_html"] and "td.estimator-limited" in defs["findings_html"]


@pytest.mark.needs_tool(("chromium", "chromium-browser"), "apt-get install chromium")
def test_the_served_notebook_opens_with_its_answers(run, tmp_path: Path) -> None:
    """`updatelens notebook` serves the app: in a headless browser, without a click, the page shows the
    findings table (with verdicts) and the charts; nothing is written into the repository. Stopping
    `updatelens notebook` with SIGTERM stops its marimo server too."""
    import os
    import signal
    import subprocess
    import sys

    from tests.browser import open_page
    from tests.pipeline.test_webserver import REPO, free_port, group_left, kill_group
    from updatelens.verdicts import VERDICTS

    lens, _ = run
    port = free_port()
    before = set(REPO.glob("reports/__marimo__/**/*"))
    proc = subprocess.Popen([sys.executable, "-m", "updatelens.orchestration.cli", "notebook", "--headless",
                             "--port", str(port), "--data-root", str(lens.root)],
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with open_page(f"http://127.0.0.1:{port}/", tmp_path / "profile", height=2400) as page:
            wanted = ("claims hold", "verdict", "vs control", "2 projection", "Layer curves", "Error against KL",
                      "ran with", "What the estimator can see")
            page.wait_for(lambda t: all(w in t for w in wanted), 180)
            # the layer curves and the error-against-KL plot drawn
            page.wait_for(lambda _: page.count("canvas, svg.marks") >= 2, 60)
            # the verdicts coloured as in the reports (the reports' table style reaches the notebook)
            verdict_cells = ", ".join(f'td[class="{v}"]' for v in VERDICTS)
            colours = page.styles(verdict_cells, "backgroundColor")
            assert colours and all(c not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)") for c in colours), colours
            page.screenshot(tmp_path / "notebook.png")
        proc.send_signal(signal.SIGTERM)  # to `updatelens notebook` alone: it passes the signal on to marimo
        proc.wait(timeout=30)
        assert not group_left(proc), "the marimo server kept running after `updatelens notebook` was stopped"
    finally:
        kill_group(proc, timeout=30)
    assert set(REPO.glob("reports/__marimo__/**/*")) == before  # the app writes nothing beside the notebook


def test_materializations_name_their_views_and_carry_column_schemas_and_a_partition_table(run) -> None:
    _, instance = run
    meta = instance.get_latest_materialization_event(dg.AssetKey("geometry")).asset_materialization.metadata
    assert meta["dagster/table_name"].value == "geometry"
    assert meta["duckdb_views"].value == "geometry, spectra, geometry_bootstrap"
    columns = {c.name: c for c in meta["dagster/column_schema"].schema.columns}
    assert {"seq", "pos", "fn_class", "angle_full_res"} <= set(columns)
    # every column described, from the declared schema
    assert all(c.description for c in columns.values()), [n for n, c in columns.items() if not c.description]
    assert columns["angle_full_res"].description == "angle(Δ_full, r) in degrees"
    partitions = meta["partitions_of_this_run"]
    assert isinstance(partitions, dg.TableMetadataValue)
    assert [r.data["partition"] for r in partitions.records] == [f"tiny-mamba:{layer:02d}" for layer in range(N_LAYERS)]
    tokens = instance.get_latest_materialization_event(dg.AssetKey("activations")).asset_materialization.metadata
    assert tokens["duckdb_views"].value == "activations, tokens"
    # each partition's own figures, observed on that partition
    seen = instance.fetch_observations(dg.AssetKey("residuals"), limit=100).records
    mine = [r.asset_observation for r in seen if r.asset_observation.partition == "tiny-mamba:01"]
    assert mine and mine[-1].metadata["rows_residuals"].value == len(CLASSES) * N_SEQ * (SEQ_LEN - 1)
    assert isinstance(mine[-1].metadata["rel_err_median_lowrank"].value, float)
    # paths within the data root, so a moved or copied root keeps them right
    assert mine[-1].metadata["parquet_path"].value == "residuals/model=tiny-mamba/layer=1/part-0.parquet"
    assert meta["parquet_path"].value == "geometry"  # several partitions: the table's folder
    # the geometry partition's page carries its figures, not only row counts
    geometry = [r.asset_observation for r in instance.fetch_observations(dg.AssetKey("geometry"), limit=100).records
                if r.asset_observation.partition == "tiny-mamba:01"]
    figures = geometry[-1].metadata
    assert -1 <= figures["cos_full_tok_median_lowrank"].value <= 1 and 0 <= figures["share_angle_gt60_lowrank"].value <= 1
    assert figures["effective_rank_res_lowrank"].value >= 1
    # each check evaluated on each partition, after the partition's materialization
    key = dg.AssetCheckKey(dg.AssetKey("residuals"), "residuals_match_fits")
    history = instance.event_log_storage.get_asset_check_execution_history(key, limit=100)
    assert {r.partition for r in history} >= {f"tiny-mamba:{layer:02d}" for layer in range(N_LAYERS)}
    materialized = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey("residuals"),
                                                                         asset_partitions=["tiny-mamba:01"]), limit=1)
    evaluated = next(r for r in history if r.partition == "tiny-mamba:01").event
    assert evaluated.timestamp >= materialized.records[0].timestamp


def test_every_column_of_every_table_view_has_its_description_in_duckdb(run) -> None:
    lens, _ = run
    with duckdb.connect(str(catalog.catalog_path(lens.root)), read_only=True) as con:
        rows = con.execute("SELECT table_name, column_name, comment FROM duckdb_columns() "
                           f"WHERE table_name IN ({', '.join(repr(t) for t in TABLES)})").fetchall()
    assert {t for t, _, _ in rows} == set(TABLES)
    assert [(t, c) for t, c, comment in rows if not comment] == []
    assert ("functional_metrics", "token", "the token's text") in rows  # the joined text too


def test_every_row_records_its_configuration(run) -> None:
    lens, _ = run
    cfg = lens.config()
    for view in ("activations", "local_fits", "residuals", "geometry", "functional_metrics"):
        frame = catalog.query(lens.root, f"SELECT DISTINCT model, config_id, k, rank, dtype, code_version, "
                                         f"model_revision, corpus_slice, weights FROM {view}")
        assert sorted(frame["model"].to_list()) == MODELS, view
        # the tiny models are checkpoints saved in float32 and run in float32 (a GGUF says its quantization)
        assert set(frame["weights"]) == {"float32 checkpoint run in float32"}, view
        assert set(frame["config_id"]) == {cfg.config_id}
        assert set(frame["k"]) == {8} and set(frame["rank"]) == {2} and set(frame["dtype"]) == {"float64"}
        # every window starts with the token that separates documents (the tiny models' tokenizer: EOS, id 2)
        assert set(frame["corpus_slice"]) == {f"wiki-embedded[w0:{N_SEQ},len{SEQ_LEN},per_doc1,first2]"}


def test_rerun_of_one_partition_replaces_only_it(run) -> None:
    lens, instance = run
    target = partition_file(lens.root, "geometry", "tiny-llama", 1)
    other = partition_file(lens.root, "geometry", "tiny-llama", 2)
    before_target, before_other = target.stat().st_mtime_ns, other.stat().st_mtime_ns
    result = dg.materialize(ASSETS, instance=instance, resources={"lens": lens},
                            partition_key=layer_key("tiny-llama", 1))
    assert result.success
    assert target.stat().st_mtime_ns > before_target
    assert other.stat().st_mtime_ns == before_other
    n = catalog.query(lens.root, "SELECT count(*) AS n FROM geometry WHERE model='tiny-llama' AND layer=1")["n"][0]
    assert n == len(CLASSES) * N_SEQ * (SEQ_LEN - 1)


def test_downstream_refuses_inputs_made_under_another_config(run) -> None:
    lens, instance = run
    other = UpdateLensResource(data_root=lens.data_root, registry=lens.registry,
                               analysis=AnalysisSettings(**{**SETTINGS, "k": 7}))
    with pytest.raises(StaleInputError, match="rematerialize the upstream"):
        dg.materialize([a for a in ASSETS if a.key.to_user_string() == "local_fits"], instance=instance,
                       resources={"lens": other}, partition_key=layer_key("tiny-gpt2", 0))


def test_a_model_key_range_runs_as_one_run(run) -> None:
    _, instance = run
    records = instance.get_run_records()
    range_runs = [r for r in records if ASSET_PARTITION_RANGE_START_TAG in r.dagster_run.tags]
    assert {r.dagster_run.tags[ASSET_PARTITION_RANGE_END_TAG] for r in range_runs} >= {
        layer_key(m, N_LAYERS - 1) for m in MODELS}


def test_updatelens_sql_prints_a_table(run, capsys: pytest.CaptureFixture) -> None:
    from updatelens.orchestration.cli import main

    lens, _ = run
    code = main(["sql", "SELECT model, count(*) AS n_rows FROM layer_summary GROUP BY model ORDER BY model",
                 "--data-root", lens.data_root])
    out = capsys.readouterr().out
    assert code == 0
    assert "tiny-gpt2" in out and "tiny-mamba" in out and str(N_LAYERS * len(CLASSES)) in out
    assert main(["sql", "SELECT * FROM no_such_view", "--data-root", lens.data_root]) == 2
    assert "no_such_view" in capsys.readouterr().err


def test_updatelens_sql_is_read_only_unless_asked(run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """COPY ... TO (and any other writing statement) is refused before it runs; --write allows it."""
    from updatelens.orchestration.cli import main

    lens, _ = run
    target = tmp_path / "out.csv"
    copy = f"COPY (SELECT model FROM layer_summary) TO '{target}'"
    assert main(["sql", copy, "--data-root", lens.data_root]) == 2
    assert "read-only: COPY" in capsys.readouterr().err and not target.exists()
    assert main(["sql", "SELECT 1; CREATE TABLE t AS SELECT 1", "--data-root", lens.data_root]) == 2
    assert "CREATE" in capsys.readouterr().err
    assert main(["sql", "DESCRIBE layer_summary", "--data-root", lens.data_root]) == 0
    assert main(["sql", copy, "--data-root", lens.data_root, "--write"]) == 0 and target.exists()


def test_reports_build_from_stored_results_with_every_figure(run) -> None:
    from PIL import Image

    from updatelens.assets.reports import _check_report
    from updatelens.orchestration.runner import materialize_reports
    from updatelens.reports.build import COMPARISON, COMPARISON_FIGURES, MODEL_FIGURES, build_model_report, reports_root
    from updatelens.verdicts import VERDICTS

    lens, instance = run
    results = materialize_reports(MODELS, lens, instance)
    assert all(r.success for r in results)
    findings = catalog.query(lens.root, "SELECT model, finding FROM findings")
    for model, result in zip(MODELS, results):
        folder = reports_root(lens.root) / model
        page = (folder / "index.html").read_text(encoding="utf-8")
        for name in MODEL_FIGURES:
            with Image.open(folder / f"{name}.png") as image:
                assert image.width > 400 and image.height > 200, name
            assert f"<img alt='{name}' src='data:image/png;base64," in page, name  # inlined: self-contained
        assert "src='http" not in page and "href='http" not in page
        for finding in findings.filter(findings["model"] == model)["finding"].to_list():
            assert f"<td>{finding}</td>" in page
        materialization = result.asset_materializations_for_node("report")[0]
        assert {f"figure_{name}" for name in MODEL_FIGURES} <= set(materialization.metadata)
        assert materialization.metadata["report"].value == str(folder / "index.html")
        assert all(e.passed for e in result.get_asset_check_evaluations())
    # the check fails on a page that lost a figure and a finding's row, and names both
    built = build_model_report(lens.root, MODELS[0])
    built.index.write_text(built.index.read_text(encoding="utf-8").replace("alt='controls'", "alt=''")
                           .replace("<td>3</td>", "<td></td>"), encoding="utf-8")
    damaged = _check_report(built, MODEL_FIGURES)
    assert not damaged.passed and damaged.description == ("figures missing from the page: controls; "
                                                          "findings without a row: 3")
    page = (reports_root(lens.root) / COMPARISON / "index.html").read_text(encoding="utf-8")
    assert all(m in page for m in MODELS)
    assert any(f'<td class="{verdict}">' in page for verdict in VERDICTS)  # coloured as in the model reports
    assert all(f"<img alt='{name}'" in page for name in COMPARISON_FIGURES)
    assert not list((lens.root / "_staging").glob("*"))  # written whole, staging cleaned


def test_convention_sweep_is_stored_side_by_side_and_replaced_whole(run) -> None:
    from updatelens.config import AnalysisConfig
    from updatelens.orchestration.runner import materialize_reports, materialize_sweep
    from updatelens.storage.layout import sweep_root

    lens, instance = run  # the session's root may hold other models' sweeps (the queries name tiny-llama)
    grid = '{"k": [6], "exclusion": ["self"], "classes": [["diagonal", "lowrank"]]}'
    result = materialize_sweep("tiny-llama", lens, instance, {"grid": grid, "layers": [0, 2]})
    assert result.success
    base = AnalysisConfig.from_dict({**AnalysisConfig().to_dict(), **SETTINGS}).replace(controls=())
    expected = {base.config_id, base.replace(k=6).config_id, base.replace(exclusion="self").config_id,
                base.replace(classes=("diagonal", "lowrank")).config_id}
    runs = catalog.query(lens.root, "SELECT config_id, convention, setting, layers FROM sweep_runs WHERE model = 'tiny-llama'")
    assert set(runs["config_id"]) == expected and set(runs["layers"]) == {"0,2"}
    for config_id in expected:
        assert (sweep_root(lens.root, config_id) / "geometry" / "model=tiny-llama" / "layer=2").exists()
    per_config = catalog.query(lens.root, "SELECT config_id, count(DISTINCT layer) AS n, min(k) AS k "
                                          "FROM sweep_layer_summary WHERE model = 'tiny-llama' GROUP BY config_id")
    assert set(per_config["n"]) == {2}
    assert dict(zip(per_config["config_id"], per_config["k"]))[base.replace(k=6).config_id] == 6
    sens = catalog.query(lens.root, "SELECT * FROM sensitivity WHERE model = 'tiny-llama'")
    conventions = set(zip(sens["convention"], sens["setting"]))
    assert {("baseline", "default"), ("k", "6"), ("exclusion", "self"), ("alignment form", "map: cos(y, T(x))"),
            ("class", "mlp")} <= conventions
    assert sens.filter(sens["convention"] == "baseline")["delta"].abs().max() == 0
    # every setting resampled on the same documents: intervals, verdicts and the paired change's interval
    k6 = sens.filter((sens["convention"] == "k") & (sens["finding"] == "1")).to_dicts()[0]
    assert k6["ci_lo"] is not None and k6["ci_lo"] <= k6["ci_hi"] and k6["verdict"] is not None
    assert k6["delta_ci_lo"] <= k6["delta_ci_hi"] and k6["separates"] == (k6["delta_ci_lo"] > 0 or k6["delta_ci_hi"] < 0)
    # the main tables are untouched by a sweep
    assert set(catalog.query(lens.root, "SELECT DISTINCT config_id FROM geometry")["config_id"]) == {lens.config().config_id}
    # the report now carries the sensitivity table
    assert materialize_reports(["tiny-llama"], lens, instance, comparison=False)[0].success
    from updatelens.reports.build import reports_root

    assert "Sensitivity to the conventions" in (reports_root(lens.root) / "tiny-llama" / "index.html").read_text()
    # a rerun with another grid replaces the model's sweep whole
    assert materialize_sweep("tiny-llama", lens, instance, {"grid": '{"rank": [1]}', "layers": [1]}).success
    runs = catalog.query(lens.root, "SELECT config_id, layers FROM sweep_runs WHERE model = 'tiny-llama'")
    assert set(runs["config_id"]) == {base.config_id, base.replace(rank=1).config_id}
    assert set(catalog.query(lens.root, "SELECT DISTINCT layer FROM sweep_geometry WHERE model = 'tiny-llama'")["layer"]) == {1}


def test_a_sweep_rerun_cut_short_leaves_the_previous_sweep_served(run, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep is computed out of sight (sweeps/_next/...) and swapped in whole: a rerun that fails
    after storing its fits and geometry leaves the previous sweep's tables and records served, none of
    its own, and nothing of it under the root."""
    import updatelens.assets.sweep as sweep_asset
    from updatelens.orchestration.runner import materialize_sweep

    lens, instance = run
    assert materialize_sweep("tiny-gpt2", lens, instance, {"grid": '{"k": [6]}', "layers": [1]}).success
    before = catalog.query(lens.root, "SELECT * FROM sensitivity WHERE model = 'tiny-gpt2' ORDER BY ALL")
    configs = catalog.query(lens.root, "SELECT DISTINCT config_id FROM sweep_geometry WHERE model = 'tiny-gpt2'")
    stored_before = sorted(str(p) for p in (lens.root / "sweeps").glob("config=*/*/model=tiny-gpt2/layer=*"))
    assert len(before) and len(configs) == 2  # the baseline and k=6

    def planted(*args, **kwargs):
        raise RuntimeError("planted: the patched passes fail")

    monkeypatch.setattr(sweep_asset, "stream_functional", planted)
    result = materialize_sweep("tiny-gpt2", lens, instance, {"grid": '{"k": [5]}', "layers": [1]}, raise_on_error=False)
    assert not result.success
    after = catalog.query(lens.root, "SELECT * FROM sensitivity WHERE model = 'tiny-gpt2' ORDER BY ALL")
    assert after.equals(before)  # the previous sweep, whole
    assert sorted(str(p) for p in (lens.root / "sweeps").glob("config=*/*/model=tiny-gpt2/layer=*")) == stored_before
    assert not list((lens.root / "sweeps").glob("_next/*"))  # its staged tables went with it


def test_report_figures_draw_the_bands_of_the_stored_resamples(run, monkeypatch) -> None:
    """layer_bands, a view over the resamples, reaches the figures that shade the 95% bands."""
    from updatelens.reports import figures
    from updatelens.reports.build import build_model_report

    lens, _ = run
    seen = {}
    drawn = figures.layer_curves

    def layer_curves(summary, ranks, title, bands=None):
        seen["bands"] = bands
        return drawn(summary, ranks, title, bands)

    monkeypatch.setattr(figures, "layer_curves", layer_curves)
    build_model_report(lens.root, MODELS[0])
    bands = seen["bands"]
    assert not bands.is_empty() and bands["rel_err_median_lo"].is_not_null().all()
    assert (bands["rel_err_median_lo"] <= bands["rel_err_median_hi"]).all()


def test_updatelens_report_regenerates_without_recomputing(run, monkeypatch, tmp_path: Path, capsys) -> None:
    from updatelens.orchestration.cli import main
    from updatelens.reports.build import reports_root

    lens, _ = run
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    index = reports_root(lens.root) / "tiny-gpt2" / "index.html"
    geometry_mtime = partition_file(lens.root, "geometry", "tiny-gpt2", 0).stat().st_mtime_ns
    assert main(["report", "--model", "tiny-gpt2", "--data-root", lens.data_root]) == 0
    out = capsys.readouterr().out
    assert f"report: {index}" in out and "2 projection" in out
    assert partition_file(lens.root, "geometry", "tiny-gpt2", 0).stat().st_mtime_ns == geometry_mtime
    assert main(["report", "--model", "no-such-model", "--data-root", lens.data_root]) == 2
    assert "no results for model 'no-such-model'" in capsys.readouterr().err
    # a light path: in a fresh interpreter the report imports neither torch, transformers, GX nor Dagster
    from tests.unit.test_light_paths import heavy_imports

    assert heavy_imports("from updatelens.orchestration.cli import main\n"
                         f"assert main(['report', '--model', 'tiny-gpt2', '--data-root', {lens.data_root!r}]) == 0") == []


def test_converge_job_analyses_each_sample_size_and_fills_the_convergence_view(zoo: Path, tmp_path: Path) -> None:
    """The Dagster job `converge`: two nested sizes of one tiny model, each a data root of its own with
    every layer asked for; the view lists every finding at both sizes; a second launch finds them up to date."""
    from updatelens.orchestration.convergence import converge_job

    lens = UpdateLensResource(data_root=str(tmp_path), registry=str(zoo),
                              analysis=AnalysisSettings(**{**SETTINGS, "classes": ["diagonal"], "bootstrap": 20}))
    config = {"ops": {"converge_sizes": {"config": {"model": "tiny-llama", "tokens": [4 * SEQ_LEN, 8 * SEQ_LEN],
                                                    "layers": [0, 1], "preset": ""}}}}  # the lens's settings
    instance = dg.DagsterInstance.ephemeral()
    result = converge_job.execute_in_process(run_config=config, resources={"lens": lens}, instance=instance)
    assert result.success
    rows = catalog.query(lens.root, "SELECT finding, n_tokens, layers FROM convergence WHERE model = 'tiny-llama'")
    assert set(rows["n_tokens"]) == {4 * SEQ_LEN, 8 * SEQ_LEN}
    assert rows.group_by("n_tokens").len()["len"].n_unique() == 1  # the same findings at each size
    output = next(e for e in result.all_events if e.event_type_value == "STEP_OUTPUT")
    table = output.step_output_data.metadata["convergence"]  # the op shows the view as a table
    assert isinstance(table, dg.TableMetadataValue) and len(table.records) == len(rows)
    # the sizes' stage runs live with their own roots: this instance holds the converge run alone
    assert len(instance.get_run_records()) == 1
    assert instance.get_latest_materialization_event(dg.AssetKey("geometry")) is None
    from updatelens.orchestration.runner import root_dagster_home
    from updatelens.storage.layout import convergence_root

    for n_seq in (4, 8):
        with dg.DagsterInstance.from_config(str(root_dagster_home(convergence_root(tmp_path, n_seq)))) as size:
            assert size.get_run_records() and size.get_latest_materialization_event(dg.AssetKey("geometry"))
    again = converge_job.execute_in_process(run_config=config, resources={"lens": lens}, instance=instance)
    assert again.success and len(instance.get_run_records()) == 2  # no stage run: up to date
    bad = {"ops": {"converge_sizes": {"config": {"model": "tiny-llama", "tokens": [SEQ_LEN + 1], "preset": ""}}}}
    failed = converge_job.execute_in_process(run_config=bad, resources={"lens": lens}, instance=instance,
                                             raise_on_error=False)
    assert not failed.success and "multiple of seq_len" in failure_message(failed)


def read_only(root: Path, *command: str) -> list[str]:
    """`command` run with `root` mounted read-only (a bind mount in a user and mount namespace of its own,
    so no privilege is needed and nothing outside the command sees it)."""
    mount = f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && exec \"$@\""
    return ["unshare", "-rm", "sh", "-c", mount, "sh", *command]


@pytest.mark.needs_tool(("unshare",), "apt-get install util-linux")
def test_a_read_only_root_gets_one_line_from_every_command(run, tmp_path: Path) -> None:
    """Every command on a root it cannot write: the reading ones answer (sql on a refreshed catalog), the
    writing ones (a report, a repair) say so in one line and exit 2, never a traceback."""
    import os
    import shutil
    import subprocess
    import sys

    lens, _ = run
    root = tmp_path / "copy"
    shutil.copytree(lens.root, root, symlinks=True)
    cli = [sys.executable, "-m", "updatelens.orchestration.cli"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # the copy re-verifies on first use: done while it is writable, as a user would after copying
    assert subprocess.run([*cli, "verify", "--data-root", str(root)], env=env, capture_output=True).returncode == 0
    probe = subprocess.run(read_only(root, "touch", str(root / "probe")), capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.strip()}")
    outcomes = {}
    for command in (["sql", "SELECT count(*) AS n FROM findings"], ["verify"], ["verify", "--repair"], ["report"]):
        done = subprocess.run(read_only(root, *cli, *command, "--data-root", str(root)), env=env,
                              capture_output=True, text=True, timeout=300)
        assert "Traceback" not in done.stderr, (command, done.stderr[-3000:])
        outcomes[command[0] + (" " + command[1] if command[1:2] == ["--repair"] else "")] = done
        if done.returncode:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2 and len(lines) == 1 and "read-only" in lines[0], (command, done.stderr)
    assert outcomes["sql"].returncode == 0 and "n" in outcomes["sql"].stdout  # reading needs no write
    assert outcomes["report"].returncode == 2  # a report is written under the root


def test_the_fits_are_set_against_the_exact_split_where_it_was_captured(run) -> None:
    """The geometry holds cos(r, a), its square and cos(Δ_tok, Δ_ctl) on every row of the models with
    an attention mask (the self-and-first output captured) and on none of Mamba's; on the exact split
    measured as an estimator (r = a), cos(r, a) is 1 wherever a is not zero."""
    lens, _ = run
    counts = catalog.query(lens.root, "SELECT model, count(cos_res_ctx) AS n, count(*) AS total FROM geometry "
                                      "GROUP BY model ORDER BY model").rows()
    assert [(m, n == total, n == 0) for m, n, total in counts] == [
        ("tiny-gpt2", True, False), ("tiny-llama", True, False), ("tiny-mamba", False, True)]
    exact = catalog.query(lens.root, "SELECT min(c.cos_res_ctx) AS lo, max(abs(c.res_share_ctx - 1)) AS off "
                                     "FROM control_geometry c JOIN context_split s USING (model, layer, seq, pos) "
                                     "WHERE c.control = 'exact' AND s.ctx_ratio > 1e-6").row(0)
    assert exact[0] == pytest.approx(1.0, abs=1e-9) and exact[1] < 1e-9
    summary = catalog.query(lens.root, "SELECT count(cos_res_ctx_median) AS n FROM layer_summary "
                                       "WHERE model = 'tiny-llama'").item()
    assert summary == N_LAYERS * len(CLASSES)


def test_mamba_s_linear_control_is_one_map_fitted_on_windows_outside_the_sample(run) -> None:
    """Mamba has no self-and-first block, so the linear control stands in: the activations carry
    y_lin = x + xB on every row, B one map of the layer (x -> y_lin - x is exactly linear across all the
    sample's documents), fitted on the windows after the sample (B is the held-out windows' ridge map,
    recomputed here); the attention models make no linear control (y_lin null)."""
    from updatelens.linear_control import linear_outputs
    from updatelens.steps.activations import held_out_maps

    lens, _ = run
    made = catalog.query(lens.root, "SELECT model, count(y_lin) = count(*) AS every, count(y_lin) = 0 AS none "
                                    "FROM activations GROUP BY model ORDER BY model").rows()
    assert made == [("tiny-gpt2", False, True), ("tiny-llama", False, True), ("tiny-mamba", True, False)]
    layer = 1
    rows = lens.store.partition("activations", "tiny-mamba", layer).read(["x", "y_lin"])
    x, y_lin = to_matrix(rows["x"]), to_matrix(rows["y_lin"])
    lm = lens.load("tiny-mamba")
    sample = lens.sample(lm)
    held = lens.held_out_sample(lm, sample)
    assert not set(held.doc_index.tolist()) & set(sample.doc_index.tolist())  # other documents only
    b = held_out_maps(lm, held, [layer], lens.config())[layer]
    np.testing.assert_allclose(y_lin, linear_outputs(x, b), rtol=1e-5, atol=1e-5)
    controls = catalog.query(lens.root, "SELECT DISTINCT control FROM control_geometry WHERE model = 'tiny-mamba' "
                                        "ORDER BY control")["control"].to_list()
    assert controls == ["linear", "unrelated"]
