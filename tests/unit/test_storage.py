from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from updatelens.storage import catalog
from updatelens.storage.integrity import MANIFEST, partition_error, read_manifest
from updatelens.storage.layout import STAGING, partition_file, read_partition, write_partition


def table(n: int, value: float) -> pa.Table:
    return pa.table({"model": ["m"] * n, "layer": pa.array([0] * n, pa.int32()), "v": [value] * n})


def test_rewrite_replaces_a_partition_whole_and_leaves_no_staging(tmp_path: Path) -> None:
    write_partition(tmp_path, "geometry", "m", 0, table(5, 1.0))
    write_partition(tmp_path, "geometry", "m", 0, table(3, 2.0))
    got = read_partition(tmp_path, "geometry", "m", 0)
    assert got["v"].to_pylist() == [2.0] * 3
    folder = tmp_path / "geometry" / "model=m" / "layer=0"
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "part-0.parquet"]  # the file and its manifest
    assert read_manifest(partition_file(tmp_path, "geometry", "m", 0))["rows"] == 3
    assert partition_error(partition_file(tmp_path, "geometry", "m", 0)) is None
    assert not any((tmp_path / STAGING).iterdir())


def test_failed_write_leaves_the_old_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_partition(tmp_path, "geometry", "m", 0, table(2, 1.0))

    def boom(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("updatelens.storage.layout._write_parquet", boom)
    with pytest.raises(OSError, match="disk full"):
        write_partition(tmp_path, "geometry", "m", 0, table(9, 9.0))
    assert read_partition(tmp_path, "geometry", "m", 0)["v"].to_pylist() == [1.0, 1.0]
    assert not any((tmp_path / STAGING).iterdir())


def test_missing_partition_names_the_upstream(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="materialize the upstream"):
        read_partition(tmp_path, "activations", "m", 3)


def test_catalog_views_read_hive_partitions(tmp_path: Path) -> None:
    write_partition(tmp_path, "activations", "a", 0, table(2, 1.0).set_column(0, "model", pa.array(["a"] * 2)))
    write_partition(tmp_path, "activations", "b", 1, table(3, 1.0).set_column(0, "model", pa.array(["b"] * 3))
                    .set_column(1, "layer", pa.array([1] * 3, pa.int32())))
    views = catalog.refresh(tmp_path)
    assert views == ["activations", "damaged_partitions"]
    with duckdb.connect(str(catalog.catalog_path(tmp_path)), read_only=True) as con:
        rows = con.sql("SELECT model, count(*) FROM activations GROUP BY model ORDER BY model").fetchall()
    assert rows == [("a", 2), ("b", 3)]
    assert catalog.query(tmp_path, "SELECT count(*) AS n FROM activations")["n"][0] == 5


def test_a_view_is_made_of_the_files_still_in_place_when_one_vanished_after_verification(tmp_path: Path) -> None:
    """A run replacing a partition can move its verified file aside just before DuckDB opens it."""
    import pyarrow.parquet as pq

    kept, gone = (tmp_path / "model=m" / f"layer={layer}" / "part-0.parquet" for layer in (1, 2))
    kept.parent.mkdir(parents=True)
    pq.write_table(pa.table({"v": [1, 2]}), kept)
    with duckdb.connect() as con:
        made = catalog._create_view(con, "t", [str(kept), str(gone)], lambda files: catalog._parquet_view(
            "t", files, catalog.MAIN_HIVE))
        assert made and con.sql("SELECT count(*) FROM t").fetchone()[0] == 2
        assert not catalog._create_view(con, "u", [str(gone)], lambda files: catalog._parquet_view(
            "u", files, catalog.MAIN_HIVE))
