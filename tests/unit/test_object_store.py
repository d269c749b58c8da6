"""The storage layer on an object store: moto's S3 server on 127.0.0.1, reached through fsspec."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from tests import cluster
from tests.rows import declared_rows
from updatelens.errors import ConfigError, UpdateLensError
from updatelens.preflight import check_data_root
from updatelens.storage import catalog
from updatelens.storage.integrity import partition_error, quarantine
from updatelens.storage.layout import (
    STAGING,
    delete_partition,
    has_files,
    partition_file,
    publish_dir,
    read_partition,
    write_partition,
)
from updatelens.storage.location import as_root, is_local, url
from updatelens.storage.staging import clean_abandoned_staging
from updatelens.storage.store import Store


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with cluster.s3_server(tmp_path_factory.mktemp("moto")) as url_:
        cluster.create_bucket(url_, "lens")
        yield url_


@pytest.fixture
def root(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_ENDPOINT_URL": endpoint,
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    return f"s3://lens/{uuid.uuid4().hex}"  # a fresh prefix per test


def table(n: int, value: float, layer: int = 0) -> pa.Table:
    return pa.table({"model": ["m"] * n, "layer": pa.array([layer] * n, pa.int32()), "v": [value] * n})


def spectra(n: int, value: float, layer: int = 0) -> pa.Table:
    """Rows of a real table (the store validates its schema): `sigma` is the value."""
    return declared_rows("spectra", n, model="m", layer=layer, sigma=value)


def keys(root: str) -> list[str]:
    path = as_root(root)
    path.fs.invalidate_cache()
    return sorted(k[len(path.path) + 1:] for k in path.fs.find(path.path))


def test_roots_are_local_paths_or_urls(tmp_path: Path) -> None:
    assert is_local(tmp_path) and is_local(f"file://{tmp_path}")
    assert not is_local("s3://bucket/prefix")
    assert url(as_root("s3://bucket/prefix") / "geometry") == "s3://bucket/prefix/geometry"
    with pytest.raises(ConfigError, match="no filesystem for nosuch://"):
        as_root("nosuch://bucket/x")


def test_a_rewrite_replaces_the_object_whole_and_leaves_no_temporary_key(root: str) -> None:
    write_partition(root, "geometry", "m", 0, table(5, 1.0))
    write_partition(root, "geometry", "m", 0, table(3, 2.0))
    assert read_partition(root, "geometry", "m", 0)["v"].to_pylist() == [2.0] * 3
    # no _staging key left; the manifest, committed after its file, lists it and it verifies
    assert keys(root) == ["geometry/model=m/layer=0/manifest.json", "geometry/model=m/layer=0/part-0.parquet"]
    assert partition_error(partition_file(root, "geometry", "m", 0)) is None
    assert has_files(root, "geometry") and not has_files(root, "spectra")
    delete_partition(root, "geometry", "m", 0)
    assert not partition_file(root, "geometry", "m", 0).exists()


def test_a_failed_write_leaves_the_old_object(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    write_partition(root, "geometry", "m", 0, table(2, 1.0))

    def boom(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("updatelens.storage.layout._write_parquet", boom)
    with pytest.raises(OSError, match="disk full"):
        write_partition(root, "geometry", "m", 0, table(9, 9.0))
    assert read_partition(root, "geometry", "m", 0)["v"].to_pylist() == [1.0, 1.0]
    assert keys(root) == ["geometry/model=m/layer=0/manifest.json", "geometry/model=m/layer=0/part-0.parquet"]


def test_a_failed_commit_removes_its_temporary_keys(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = as_root(root).fs

    def copy_fails(*a: object, **k: object) -> None:
        raise OSError("connection reset")

    monkeypatch.setattr(fs, "copy", copy_fails)
    with pytest.raises(OSError, match="connection reset"):
        write_partition(root, "geometry", "m", 0, table(2, 1.0))
    assert keys(root) == []


def test_a_published_folder_drops_files_the_new_version_lacks(root: str) -> None:
    def version(names: list[str]):
        def fill(staging: Path) -> None:
            for name in names:
                (staging / name).write_text(name)
        return fill

    final = as_root(root) / "reports" / "m"
    publish_dir(root, final, version(["index.html", "a.png", "b.png"]))
    publish_dir(root, final, version(["index.html", "a.png"]))
    assert keys(root) == ["reports/m/a.png", "reports/m/index.html"]


def test_abandoned_staging_keys_are_removed(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = as_root(root).fs
    fs.pipe_file((as_root(root) / STAGING / "123-dead" / "part-0.parquet").path, b"half")
    assert clean_abandoned_staging(root) == []  # fresh: it may belong to a live writer
    monkeypatch.setattr("updatelens.storage.layout.STALE_STAGING_S", -1.0)
    assert clean_abandoned_staging(root) == ["123-dead"]
    assert keys(root) == []


def test_duckdb_reads_the_tables_from_the_object_store(root: str) -> None:
    for layer in range(3):
        write_partition(root, "activations", "m", layer, table(2, float(layer), layer))
    assert catalog.catalog_path(root) is None  # no catalog file on an object store: views in memory
    assert catalog.refresh(root) == ["activations", "damaged_partitions"]
    got = catalog.query(root, "SELECT layer, sum(v) AS s, count(*) AS n FROM activations GROUP BY layer ORDER BY layer")
    assert got.to_dicts() == [{"layer": 0, "s": 0.0, "n": 2}, {"layer": 1, "s": 2.0, "n": 2},
                              {"layer": 2, "s": 4.0, "n": 2}]


def test_an_unreachable_bucket_is_refused_before_any_work(root: str) -> None:
    check_data_root(as_root(root))  # the bucket exists: fine
    with pytest.raises(UpdateLensError, match="not writable.*credentials and the endpoint"):
        check_data_root(as_root("s3://no-such-bucket/x"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_store_opened_once_writes_reads_locks_and_queries_its_partitions(where: str, root: str, tmp_path: Path) -> None:
    store = Store.open(tmp_path / "data" if where == "local" else root)
    part = store.partition("residuals", "m", 3)
    assert not part.exists() and not store.has_files("residuals")
    with pytest.raises(FileNotFoundError, match="residuals for model=m layer=3 is not materialized"):
        part.read()
    rows = declared_rows("residuals", 4, model="m", layer=3, seq=[0, 0, 1, 2], norm_res=[1.0, 2.0, 3.0, 4.0])
    with part.writer() as sink:
        assert not part.exists()  # nothing visible until the block exits
        sink.write(rows.slice(0, 2))
        sink.write(rows.slice(2))
    assert part.exists() and store.has_model("residuals", "m") and partition_error(part.file) is None
    assert part.read(["norm_res"])["norm_res"].to_pylist() == [1.0, 2.0, 3.0, 4.0]
    assert [len(p) for p in part.parts()] == [2, 2]  # one row group per write
    assert part.seqs(1, 3)["norm_res"].to_pylist() == [3.0, 4.0]
    with store.lock("m", [3]), store.lock("m"):
        assert store.query("SELECT sum(norm_res) AS s FROM residuals WHERE layer = 3")["s"][0] == 10.0
    part.delete()
    assert not part.exists()


def test_a_damaged_object_is_left_out_listed_and_quarantined_not_deleted(root: str) -> None:
    """On an object store as locally: a corrupted partition object is found by verification, the
    views serve the other partitions, `quarantine` moves it (and its manifest) under _quarantine/,
    and a rewrite of the partition verifies again."""
    store = Store.open(root)
    for layer in (0, 1):
        store.partition("spectra", "m", layer).write(spectra(3, float(layer), layer))
    damaged = store.partition("spectra", "m", 1)
    fs = as_root(root).fs
    body = fs.cat_file(damaged.file.path)
    fs.pipe_file(damaged.file.path, body[: len(body) // 2])  # what a partial upload by another tool leaves
    found = store.damaged()
    assert [(d.table, d.layer) for d in found] == [("spectra", 1)] and "bytes" in found[0].reason
    assert store.query("SELECT DISTINCT layer FROM spectra")["layer"].to_list() == [0]
    assert store.query("SELECT table_name, layer FROM damaged_partitions").rows() == [("spectra", 1)]
    moved = quarantine(root, found[0].path)
    assert not damaged.exists() and fs.cat_file(moved.path) == body[: len(body) // 2]
    assert any(k.startswith("_quarantine/") and k.endswith("layer=1/manifest.json") for k in keys(root))
    damaged.write(spectra(3, 1.0, 1))
    assert store.damaged() == [] and store.query("SELECT count(*) AS n FROM spectra")["n"][0] == 6


def test_a_run_replacing_a_damaged_object_keeps_it_in_quarantine(root: str) -> None:
    part = Store.open(root).partition("spectra", "m", 0)
    part.write(spectra(3, 1.0))
    fs = as_root(root).fs
    fs.pipe_file(part.file.path, b"PAR1 not a parquet file")
    with pytest.warns(UserWarning, match="replaced a damaged partition file"):
        part.write(spectra(3, 2.0))
    assert partition_error(part.file) is None and part.read(["sigma"])["sigma"].to_pylist() == [2.0] * 3
    kept = [k for k in keys(root) if k.startswith("_quarantine/") and k.endswith("part-0.parquet")]
    assert len(kept) == 1 and fs.cat_file(f"{as_root(root).path}/{kept[0]}") == b"PAR1 not a parquet file"
