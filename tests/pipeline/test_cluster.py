"""Scale-out: the whole pipeline for a tiny model on a local cluster (Redis broker, two Celery
workers running Dagster's celery executor, results in an S3-compatible server), equal to the
plain local run and queried by DuckDB from the object store."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg
import duckdb
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from tests import cluster
from tests.zoo import N_LAYERS
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.assets.routing import CPU_QUEUE, GPU_QUEUE
from updatelens.findings import FINDINGS
from updatelens.orchestration.distributed import materialize_layers_distributed
from updatelens.orchestration.runner import check_verdicts, dagster_yaml, materialize_model
from updatelens.stages import TABLES
from updatelens.storage import catalog

pytestmark = pytest.mark.needs_tool(("redis-server",), ".ci/run installs Debian's redis-server")

MODEL = "tiny-llama"
SETTINGS = dict(n_seq=6, seq_len=16, k=8, rank=2, classes=["diagonal", "lowrank"])
MODEL_STEPS = {"activations", "functional_metrics"}
LIGHT_STEPS = {"local_fits", "residuals", "geometry", "controls"}
# The last layer: one cluster run (a step process per stage and layer is what costs here; a run per
# layer is the same path again)
LAYERS = [N_LAYERS - 1]
# Sort keys that identify a row in each table (the rest are measured values).
ROW_KEYS = ("model", "layer", "fn_class", "variant", "which", "seq", "pos", "component", "replicate", "idx")


def _table(con: duckdb.DuckDBPyConnection, table: str) -> pl.DataFrame:
    frame = con.sql(f"SELECT * FROM {table}").pl()
    return frame.sort([c for c in ROW_KEYS if c in frame.columns])


def test_pipeline_on_local_cluster_equals_local_run(zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    analysis = AnalysisSettings(**SETTINGS)
    local = UpdateLensResource(data_root=str(tmp_path / "local"), registry=str(zoo), analysis=analysis)
    start = time.perf_counter()
    result = materialize_model(MODEL, local, dg.DagsterInstance.ephemeral(), layers=LAYERS, log_level="WARNING")
    local_wall = time.perf_counter() - start
    assert result.success
    local_checks = sorted((name, passed) for name, passed, _ in check_verdicts(result))

    work = tmp_path / "cluster"
    work.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(dagster_yaml(1))
    with cluster.redis_server(work) as redis, cluster.s3_server(work) as endpoint:
        cluster.create_bucket(endpoint, "lens")
        env = {
            "DAGSTER_HOME": str(home), "UPDATELENS_PROFILE": "celery",
            "UPDATELENS_CELERY_BROKER": f"{redis}/0", "UPDATELENS_CELERY_BACKEND": f"{redis}/1",
            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "UPDATELENS_LOCK_DIR": str(work / "locks"),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        worker_env = dict(os.environ)
        remote = UpdateLensResource(data_root="s3://lens/results", registry=str(zoo), analysis=analysis)
        with cluster.celery_worker("gpu-worker", [GPU_QUEUE], worker_env, work), \
                cluster.celery_worker("cpu-worker", [CPU_QUEUE], worker_env, work):
            start = time.perf_counter()
            with dg.DagsterInstance.get() as instance:
                runs = materialize_layers_distributed(MODEL, remote, instance, layers=LAYERS, max_runs=len(LAYERS),
                                                      log_level="WARNING")
            cluster_wall = time.perf_counter() - start
            # a stale stage and its readers alone: only their steps run on the workers
            with dg.DagsterInstance.get() as instance:
                again = materialize_layers_distributed(MODEL, remote, instance, layers=LAYERS, log_level="WARNING",
                                                       stages={layer: ["geometry", "controls"] for layer in LAYERS})
            assert all(r.success for r in again), [r.failure for r in again]
            assert [sorted(r.workers) for r in again] == [["controls", "geometry"]] * len(LAYERS)

        # one run per (model, layer); every step succeeded, with the same check verdicts as locally
        assert [r.layer for r in runs] == LAYERS
        for run in runs:
            assert run.success, run.failure
        # the local run checks all layers at once: a check passes there iff it passed on every layer
        cluster_checks = {name: all(p for r in runs for n, p, _ in r.checks if n == name)
                          for name, _ in local_checks}
        assert sorted(cluster_checks.items()) == local_checks
        # each step ran in a Celery worker of its queue: model steps on the gpu worker, light on the cpu one
        for run in runs:
            assert {step: host.split("@")[0] for step, host in run.workers.items()} == {
                **{step: "gpu-worker" for step in MODEL_STEPS}, **{step: "cpu-worker" for step in LIGHT_STEPS}}

        # the results live in the bucket, and DuckDB reads them from there: equal to the local run
        # one connection per root: each verifies its files once (a query of its own would verify
        # the whole bucket again, minutes against the S3 test server)
        with catalog.connect(remote.root) as in_bucket, catalog.connect(local.root) as on_disk:
            for table in TABLES:
                assert_frame_equal(_table(in_bucket, table), _table(on_disk, table),
                                   check_exact=False, rel_tol=1e-4, abs_tol=1e-5)
            # one row per finding on the best class, and beside it the exact split's row: the same rows as the local run
            query = "SELECT finding, estimator = 'exact' AS exact, value FROM findings ORDER BY finding, exact"
            assert_frame_equal(in_bucket.sql(query).pl(), on_disk.sql(query).pl(),
                               check_exact=False, rel_tol=1e-4, abs_tol=1e-5)
            assert in_bucket.sql(query).pl().filter(~pl.col("exact")).height == len(FINDINGS)
        assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()
    print(f"\nlocal in-process run {local_wall:.1f} s; local cluster (2 celery workers, S3) {cluster_wall:.1f} s")
