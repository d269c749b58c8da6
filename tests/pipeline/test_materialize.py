"""All five assets materialized in-process for tiny GPT-2, Llama and Mamba models."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import duckdb
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.common import StaleInputError
from orchestration.definitions import ASSETS
from orchestration.partitions import layer_key
from orchestration.resources import AnalysisSettings, UpdateLensResource
from orchestration.runner import materialize_model
from storage import catalog
from storage.layout import TABLES, partition_file
from tests.zoo import N_LAYERS

MODELS = ["tiny-gpt2", "tiny-llama", "tiny-mamba"]
CLASSES = ["diagonal", "psd_diagonal", "lowrank", "orthogonal", "global_linear", "mlp"]
N_SEQ, SEQ_LEN = 6, 16
SETTINGS = dict(n_seq=N_SEQ, seq_len=SEQ_LEN, k=8, rank=2, classes=CLASSES, mlp_steps=30)
LAYER_SUMMARY_COLUMNS = {"model", "layer", "fn_class", "n_tokens", "rel_err_median", "cos_full_tok_median",
                         "cos_full_tok_map_median", "frac_res_angle_gt60", "proj_tok_m16", "proj_res_m16",
                         "kl_mean", "spearman_relerr_kl"}


@pytest.fixture(scope="module")
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
        assert con.sql("SELECT count(*) FROM findings").fetchone()[0] == len(MODELS) * 8  # 8 rows per model
        columns = {row[0] for row in con.sql("DESCRIBE layer_summary").fetchall()}
        assert LAYER_SUMMARY_COLUMNS <= columns
        bad = con.sql("SELECT count(*) FROM layer_summary WHERE n_tokens <> ? OR kl_mean IS NULL "
                      "OR rel_err_median < 0", params=[kept]).fetchone()[0]
        assert bad == 0
        d = con.sql("SELECT DISTINCT len(x) FROM activations").fetchall()
        assert d == [(32,)]


def test_every_row_records_its_configuration(run) -> None:
    lens, _ = run
    cfg = lens.config()
    for view in ("activations", "local_fits", "residuals", "geometry", "functional_metrics"):
        frame = catalog.query(lens.root, f"SELECT DISTINCT model, config_id, k, rank, dtype, code_version, "
                                         f"model_revision, corpus_slice FROM {view}")
        assert sorted(frame["model"].to_list()) == MODELS, view
        assert set(frame["config_id"]) == {cfg.config_id}
        assert set(frame["k"]) == {8} and set(frame["rank"]) == {2} and set(frame["dtype"]) == {"float64"}
        assert set(frame["corpus_slice"]) == {f"wiki-embedded[w0:{N_SEQ},len{SEQ_LEN}]"}


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
    from orchestration.cli import main

    lens, _ = run
    code = main(["sql", "SELECT model, count(*) AS n_rows FROM layer_summary GROUP BY model ORDER BY model",
                 "--data-root", lens.data_root])
    out = capsys.readouterr().out
    assert code == 0
    assert "tiny-gpt2" in out and "tiny-mamba" in out and str(N_LAYERS * len(CLASSES)) in out
    assert main(["sql", "SELECT * FROM no_such_view", "--data-root", lens.data_root]) == 2
    assert "no_such_view" in capsys.readouterr().err
