"""The storage layer on an object store: moto's S3 server on 127.0.0.1, reached through fsspec."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from updatelens.storage import catalog
from updatelens.storage.integrity import partition_error
from updatelens.storage.layout import (
    STAGING,
    clean_abandoned_staging,
    delete_partition,
    has_files,
    partition_file,
    publish_dir,
    read_partition,
    write_partition,
)
from updatelens.storage.location import as_root, is_local, url
from tests import cluster
from updatelens.errors import ConfigError, UpdateLensError
from updatelens.preflight import check_data_root


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
    def version(names: list[str]):  # noqa: ANN202
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
