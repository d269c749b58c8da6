"""Nothing wrong is served: misplaced and stray partition files, a damaged or foreign catalog, SQL that
tries to write, missing token text, interrupted replacements and bad input (each fault made by hand)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from updatelens.storage import catalog
from updatelens.storage.integrity import MANIFEST, QUARANTINE, partition_error, quarantine, scan, sha256_of
from updatelens.storage.layout import (
    STAGING,
    TARGET_SUFFIX,
    partition_dir,
    partition_file,
    staged_dir,
    write_partition,
)
from updatelens.storage.staging import clean_abandoned_staging


def rows(layer: int, n: int = 4, model: str = "m", config: str = "c1") -> pa.Table:
    return pa.table({"model": [model] * n, "layer": pa.array([layer] * n, pa.int32()), "config_id": [config] * n,
                     "seq": pa.array(range(n), pa.int32()), "pos": pa.array([1] * n, pa.int32()),
                     "corpus_slice": ["s"] * n, "v": [float(layer)] * n})


def two_layers(root: Path) -> None:
    for layer in (3, 4):
        write_partition(root, "activations", "m", layer, rows(layer))


def test_a_partition_copied_into_another_layers_folder_is_damaged_and_left_out(tmp_path: Path) -> None:
    two_layers(tmp_path)
    shutil.rmtree(partition_dir(tmp_path, "activations", "m", 4))
    shutil.copytree(partition_dir(tmp_path, "activations", "m", 3), partition_dir(tmp_path, "activations", "m", 4))
    reason = partition_error(partition_file(tmp_path, "activations", "m", 4))
    assert reason is not None and "manifest says it holds activations model=m layer=3" in reason
    assert catalog.query(tmp_path, "SELECT DISTINCT layer FROM activations")["layer"].to_list() == [3]
    damaged = catalog.query(tmp_path, "SELECT table_name, layer FROM damaged_partitions")
    assert damaged.rows() == [("activations", 4)]


def test_rows_of_another_layer_under_a_manifest_that_names_the_folder_are_damaged(tmp_path: Path) -> None:
    """The manifest rewritten to match the folder (checksum and all): the rows still say layer 3."""
    two_layers(tmp_path)
    target = partition_file(tmp_path, "activations", "m", 4)
    shutil.copy(partition_file(tmp_path, "activations", "m", 3), target)
    manifest = json.loads((target.parent / MANIFEST).read_text())
    manifest.update(bytes=target.stat().st_size, sha256=sha256_of(target))
    (target.parent / MANIFEST).write_text(json.dumps(manifest))
    assert "its rows have layer 3, its folder and manifest say 4" in (partition_error(target) or "")
    manifest["config_id"] = "other"
    write_partition(tmp_path, "activations", "m", 5, rows(5))
    five = partition_file(tmp_path, "activations", "m", 5)
    entry = json.loads((five.parent / MANIFEST).read_text())
    (five.parent / MANIFEST).write_text(json.dumps({**entry, "config_id": "c2"}))
    assert "its rows have config_id c1, its folder and manifest say c2" in (partition_error(five) or "")


def test_a_manifest_that_does_not_name_its_partition_is_not_trusted(tmp_path: Path) -> None:
    write_partition(tmp_path, "activations", "m", 3, rows(3))
    file = partition_file(tmp_path, "activations", "m", 3)
    entry = json.loads((file.parent / MANIFEST).read_text())
    assert (entry["table"], entry["model"], entry["layer"], entry["config_id"]) == ("activations", "m", 3, "c1")
    del entry["layer"]
    (file.parent / MANIFEST).write_text(json.dumps(entry))
    assert "does not say which partition it holds" in (partition_error(file) or "")


def test_a_stray_file_is_quarantined_alone_and_its_partition_is_stale(tmp_path: Path) -> None:
    from updatelens.orchestration.registry_watch import stale_stages
    from updatelens.versions import stage_versions

    two_layers(tmp_path)
    folder = partition_dir(tmp_path, "activations", "m", 4)
    stray = folder / "part-1.parquet"
    shutil.copy(partition_file(tmp_path, "activations", "m", 3), stray)
    _, damaged = scan(tmp_path, ("activations",))
    assert [(Path(d.path).name, d.layer) for d in damaged] == [("part-1.parquet", 4)]
    assert "not listed in a manifest" in damaged[0].reason
    # stale: the next run rewrites the partition (and what reads it)
    assert stale_stages(tmp_path, "m", 4, "c1", stage_versions())[0] == "activations"
    where = quarantine(tmp_path, stray)
    assert where.exists() and not (where.parent / MANIFEST).exists()  # the manifest is part-0's: it stays
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "part-0.parquet"]
    assert partition_error(partition_file(tmp_path, "activations", "m", 4)) is None
    assert catalog.query(tmp_path, "SELECT count(*) AS n FROM activations WHERE layer = 4")["n"][0] == 4


@pytest.mark.parametrize("fault", ["truncated", "foreign"])
def test_a_damaged_or_foreign_catalog_is_set_aside_and_rebuilt(tmp_path: Path, fault: str) -> None:
    import duckdb

    two_layers(tmp_path)
    catalog.refresh(tmp_path)
    db = catalog.catalog_path(tmp_path)
    assert db is not None and catalog.catalog_error(db) is None
    if fault == "truncated":
        with open(db, "r+b") as handle:
            handle.truncate(100)
    else:
        db.unlink()
        with duckdb.connect(str(db)) as con:
            con.execute("CREATE TABLE notes AS SELECT 1 AS x")
    assert catalog.catalog_error(db) is not None
    with pytest.warns(UserWarning, match="moved it to"):
        views = catalog.refresh(tmp_path)
    assert "activations" in views and catalog.catalog_error(db) is None
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.sql("SELECT count(*) FROM activations").fetchone() == (8,)
    kept = list((tmp_path / QUARANTINE).glob(f"*/{db.name}"))
    assert len(kept) == 1  # set aside, never deleted


def _snapshot(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for folder in folders
            for p in sorted(folder.rglob("*")) if p.is_file()}


def write_forms(stored: Path, outside: Path) -> list[str]:
    """Every way of writing through SQL we know of, at a stored partition file and outside the root."""
    forms = []
    for target in (stored, outside / "x.parquet"):
        copy = f"COPY (SELECT 42 AS a) TO '{target}' (FORMAT parquet, USE_TMP_FILE false)"
        forms += [copy, f"EXPLAIN ANALYZE {copy}", f"explain analyse {copy}", f"/* c */ EXPLAIN /* d */ ANALYZE {copy}",
                  f"EXPLAIN (ANALYZE) {copy}", f"SELECT 1; {copy}", f"-- note\n{copy}",
                  f"EXPLAIN ANALYZE EXPLAIN ANALYZE {copy}", f"COPY activations TO '{target}' (FORMAT csv)"]
    forms += [f"EXPORT DATABASE '{outside / 'export'}'", f"ATTACH '{outside / 'other.duckdb'}' AS other",
              f"EXPLAIN ANALYZE ATTACH '{outside / 'other.duckdb'}'", "INSTALL httpfs", "LOAD httpfs",
              "SET enable_external_access = true", "RESET lock_configuration", "CREATE TABLE t AS SELECT 1",
              "CREATE OR REPLACE VIEW activations AS SELECT 1", f"SET temp_directory = '{outside / 'tmp'}'",
              "PRAGMA enable_profiling = 'json'", f"SET profiling_output = '{outside / 'profile.json'}'",
              "CALL enable_logging()", "CHECKPOINT", "DROP VIEW activations"]
    return forms


def test_sql_cannot_write_in_any_form(tmp_path: Path) -> None:
    import duckdb

    root, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    two_layers(root)
    catalog.refresh(root)
    stored = partition_file(root, "activations", "m", 3)
    before = _snapshot(root, outside)
    for form in write_forms(stored, outside):
        with pytest.raises((catalog.ReadOnlyError, duckdb.ParserException)) as caught:  # refused, or cannot parse
            catalog.query(root, form)
        assert caught.type is catalog.ReadOnlyError or "syntax error" in str(caught.value), (form, caught.value)
    assert _snapshot(root, outside) == before
    # the engine itself refuses every file but the verified ones, whatever the statement check let by
    # (a stored file is protected by the statement check alone: the engine may read it, hence open it)
    with catalog.connect(root, read_only=True) as con:
        engine = [f for f in write_forms(stored, outside) if str(outside) in f and "EXPLAIN" not in f
                  and "SET" not in f and "(SELECT 42" in f]
        for form in [*engine, f"SELECT * FROM read_csv('{tmp_path}/x.csv')", "INSTALL httpfs",
                     f"ATTACH '{outside / 'other.duckdb'}' AS other", "SET enable_external_access = true"]:
            with pytest.raises(duckdb.Error, match="disabled by configuration|Permission|locked"):
                con.execute(form)
    assert _snapshot(root, outside) == before
    # reading still works, EXPLAIN of a SELECT included; --write lifts the limits
    assert catalog.query(root, "EXPLAIN ANALYZE SELECT count(*) FROM activations").height >= 1
    assert catalog.query(root, "/* c */ SELECT count(*) AS n FROM activations; SELECT 2 AS n")["n"][0] == 2
    catalog.query(root, f"COPY (SELECT 1 AS a) TO '{outside / 'ok.csv'}'", write=True)
    assert (outside / "ok.csv").exists()


def test_missing_token_text_is_listed_with_what_it_leaves_out(tmp_path: Path) -> None:
    for layer in (3, 4):
        write_partition(tmp_path, "residuals", "m", layer, rows(layer))
        write_partition(tmp_path, "tokens", "m", layer, rows(layer).append_column("token_id", pa.array([7] * 4))
                        .append_column("token", pa.array(["a"] * 4)).append_column("context", pa.array(["b a"] * 4)))
    shutil.rmtree(partition_dir(tmp_path, "tokens", "m", 4))
    damaged = catalog.query(tmp_path, "SELECT table_name, layer, reason FROM damaged_partitions")
    assert damaged.rows(named=False)[0][:2] == ("tokens", 4)
    assert "token text" in damaged["reason"][0] and "NULL" in damaged["reason"][0]


def test_a_replaced_folder_is_never_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap is one atomic exchange; where the system cannot exchange, a writer killed between its
    two renames leaves the old folder aside with its target, and cleaning puts it back."""
    from updatelens.storage import layout

    final = tmp_path / "reports" / "m"
    for text in ("old", "new"):
        with staged_dir(tmp_path, final) as staging:
            (staging / "index.html").write_text(text)
    assert (final / "index.html").read_text() == "new" and not list((tmp_path / STAGING).iterdir())
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    with staged_dir(tmp_path, final) as staging:
        (staging / "index.html").write_text("newer")
    assert (final / "index.html").read_text() == "newer" and not list((tmp_path / STAGING).iterdir())
    # what a kill between the two renames leaves: the folder aside, its target beside it
    dead = 2**22 + 12345
    aside = tmp_path / STAGING / f"{dead}-abc.old"
    os.rename(final, aside)
    (aside.parent / f"{aside.name}{TARGET_SUFFIX}").write_text(str(final))
    (tmp_path / STAGING / f"{dead}-def").mkdir()  # and a half-written new folder
    removed = clean_abandoned_staging(tmp_path)
    assert sorted(removed) == [f"{dead}-abc.old", f"{dead}-def"]
    assert (final / "index.html").read_text() == "newer" and not list((tmp_path / STAGING).iterdir())


def test_settings_of_the_wrong_name_or_type_are_refused_in_one_line() -> None:
    from updatelens.config import AnalysisConfig
    from updatelens.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown configuration keys: \['nosuchfield'\]"):
        AnalysisConfig.from_dict({"nosuchfield": 1})
    with pytest.raises(ConfigError, match=r"^k must be int \(default 64\), got 'abc'$"):
        AnalysisConfig.from_dict({"k": "abc"})
    with pytest.raises(ConfigError, match=r"classes must be a list of str"):
        AnalysisConfig.from_dict({"classes": "lowrank"})
    assert AnalysisConfig.from_dict({"ridge": 1, "classes": ["lowrank"]}).ridge == 1


@pytest.mark.parametrize("layers,message", [("4-3", "the range '4-3' is reversed; write 3-4"),
                                            ("4-3,7", "the range '4-3' is reversed"),
                                            ("", "--layers is empty"), (" ", "--layers is empty"),
                                            ("3,,4", "'' is not a layer")])
def test_layer_lists_that_mean_nothing_are_refused(layers: str, message: str) -> None:
    from updatelens.orchestration.commands import _parse_layers

    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _parse_layers(layers)


@pytest.mark.parametrize("extra,message", [(["--layers", "99"], "has 3 layers (0..2); no layer [99]"),
                                           (["--layers", "1-0"], "reversed"),
                                           (["--set", "nosuchfield=1"], "unknown configuration keys: ['nosuchfield']"),
                                           (["--set", "rank=abc"], "rank must be int (default 8), got 'abc'"),
                                           (["--set", "k"], "write KEY=VALUE")])
def test_bad_run_input_is_refused_before_anything_is_created(zoo: Path, tmp_path: Path, extra: list[str],
                                                             message: str, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from updatelens.orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    root = tmp_path / "data"
    code = main(["run", "--registry", str(zoo), "--data-root", str(root), "--model", "tiny-gpt2", "--n-seq", "6",
                 "--seq-len", "16", "--k", "8", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no data root, no Dagster home


def test_queries_hash_a_file_only_when_it_changed_and_verify_always(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from updatelens.storage import integrity

    write_partition(tmp_path, "activations", "m", 3, rows(3))
    file = partition_file(tmp_path, "activations", "m", 3)
    hashed: list[str] = []
    real = integrity.sha256_of
    monkeypatch.setattr(integrity, "sha256_of", lambda path: hashed.append(str(path)) or real(path))
    integrity._verified.clear()
    assert partition_error(file) is None and hashed == []  # size and mtime as the manifest recorded them
    assert partition_error(file, full=True) is None and len(hashed) == 1  # `verify`: every checksum
    data = bytearray(file.read_bytes())
    data[10] ^= 0x10  # a bit of the first data page flipped by a write: the mtime moves
    file.write_bytes(bytes(data))
    assert "SHA-256" in (partition_error(file) or "") and len(hashed) == 2
    stat = file.stat()
    entry = json.loads((file.parent / MANIFEST).read_text())
    os.utime(file, ns=(stat.st_atime_ns, entry["mtime_ns"]))  # damage that kept the mtime: only verify sees it
    integrity._verified.clear()
    assert partition_error(file) is None
    assert "SHA-256" in (partition_error(file, full=True) or "")


def test_a_stage_refuses_a_misplaced_or_damaged_input_instead_of_reading_it(tmp_path: Path) -> None:
    """What 'materialize selected' of the downstream stages reads: the upstream check verifies first."""
    from updatelens.assets.common import StaleInputError, check_upstream
    from updatelens.config import AnalysisConfig
    from updatelens.storage.store import Store

    two_layers(tmp_path)
    shutil.rmtree(partition_dir(tmp_path, "activations", "m", 4))
    shutil.copytree(partition_dir(tmp_path, "activations", "m", 3), partition_dir(tmp_path, "activations", "m", 4))
    with pytest.raises(StaleInputError, match="activations for m layer 4 does not verify .its manifest says it holds"):
        check_upstream(Store.open(tmp_path), "activations", "m", 4, AnalysisConfig())


def test_queries_read_the_catalog_without_verifying_again_only_while_nothing_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a refresh, a query on an unchanged root reads the catalog file as verified then; a file
    touched or damaged since, or a view altered in the catalog, makes it verify again, and a damaged
    file is then left out."""
    two_layers(tmp_path)
    catalog.refresh(tmp_path)
    verifying = []
    original = catalog._create_views
    monkeypatch.setattr(catalog, "_create_views", lambda *a: verifying.append(1) or original(*a))
    query = "SELECT layer, count(*) AS n FROM activations GROUP BY layer ORDER BY layer"
    assert catalog.query(tmp_path, query)["layer"].to_list() == [3, 4] and not verifying  # as verified
    with pytest.raises(catalog.ReadOnlyError):  # still read-only
        catalog.query(tmp_path, "COPY (SELECT 1) TO 'x.csv'")
    file = partition_file(tmp_path, "activations", "m", 4)
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 1000))  # touched
    assert catalog.query(tmp_path, query)["layer"].to_list() == [3, 4] and len(verifying) == 1
    catalog.refresh(tmp_path)
    verifying.clear()
    assert catalog.query(tmp_path, query)["layer"].to_list() == [3, 4] and not verifying
    with duckdb_file(tmp_path) as con:  # someone alters a view in the catalog file
        con.execute("CREATE OR REPLACE VIEW activations AS SELECT 99 AS layer, 1 AS n")
    assert catalog.query(tmp_path, query)["layer"].to_list() == [3, 4] and len(verifying) == 1
    catalog.refresh(tmp_path)
    file.write_bytes(file.read_bytes()[:-10])  # damaged: verified again and left out
    assert catalog.query(tmp_path, query)["layer"].to_list() == [3] and len(verifying) == 3


def test_a_refresh_removes_what_a_killed_refresh_was_building(tmp_path: Path) -> None:
    two_layers(tmp_path)
    db = tmp_path / catalog.CATALOG_FILE
    left = [db.with_name(f"{db.name}.999999.building"), db.with_name(f"{db.name}.999999.building.wal")]
    for path in left:  # a refresh killed while it built its file
        path.write_bytes(b"half a catalog")
    catalog.refresh(tmp_path)
    assert not any(path.exists() for path in left)
    assert sorted(p.name for p in tmp_path.glob(f"{db.name}*")) == [db.name, db.name + catalog.VERIFIED_SUFFIX]


def duckdb_file(root: Path):
    import duckdb

    return duckdb.connect(str(root / catalog.CATALOG_FILE))


@pytest.mark.parametrize("command", [["sql", "SELECT 1"], ["verify"], ["verify", "--repair"], ["report"]])
def test_a_mistyped_data_root_is_refused_by_the_reading_commands_and_nothing_is_created(
        tmp_path: Path, command: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from updatelens.orchestration.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    missing = tmp_path / "dta"
    code = main([command[0], "--data-root", str(missing), *command[1:]])
    err = capsys.readouterr().err
    assert code == 2 and f"no data root at {missing}: {command[0]} only reads results" in err, err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no folder, catalog, lock or Dagster home


def test_a_copied_root_serves_its_own_files_and_survives_the_original_moving(tmp_path: Path) -> None:
    """`cp -a` keeps every file's size and time, so the copy's catalog fingerprint matches; its views
    still name the original's files. The copy is another folder: it verifies again, then serves its own
    rows, also once the original is changed and then moved away."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    two_layers(original)
    assert catalog.query(original, "SELECT sum(v) AS s FROM activations")["s"][0] == 4 * 3 + 4 * 4
    shutil.copytree(original, copy, symlinks=True)  # copy2: sizes and modification times kept
    write_partition(original, "activations", "m", 5, rows(5))  # the original moves on
    assert catalog.query(copy, "SELECT sum(v) AS s FROM activations")["s"][0] == 28  # not 48
    record = json.loads((copy / "updatelens.duckdb.verified.json").read_text())
    assert record["root"].startswith(f"{os.path.realpath(copy)}\t")
    assert all(str(copy) in path for path in record["readable"])
    original.rename(tmp_path / "moved")
    assert catalog.query(copy, "SELECT count(DISTINCT layer) AS n FROM activations")["n"][0] == 2


def test_an_empty_partition_verifies_only_where_its_manifest_says_it_is_empty(tmp_path: Path) -> None:
    """The controls stage without a positive control stores an empty partition on purpose: it
    verifies. A file emptied after its manifest was written (rows stated) does not."""
    write_partition(tmp_path, "activations", "m", 3, rows(3, n=0))
    assert partition_error(partition_file(tmp_path, "activations", "m", 3)) is None
    write_partition(tmp_path, "activations", "m", 4, rows(4))
    target = Path(partition_file(tmp_path, "activations", "m", 4))
    entry = json.loads((target.parent / MANIFEST).read_text())
    pq.write_table(rows(4, n=0), target)
    stat = target.stat()
    entry.update(bytes=stat.st_size, mtime_ns=stat.st_mtime_ns, sha256=sha256_of(target))  # rows: still 4
    (target.parent / MANIFEST).write_text(json.dumps(entry))
    assert partition_error(target, full=True) == "no rows"


def test_folders_the_layout_does_not_write_are_never_read_and_are_set_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second spelling of a key (layer=03 beside layer=3: read as layer 3 twice before), a backup's
    name (layer=4.bak: a key the views could not cast) and a layer folder replaced by a symbolic link
    (its target can change behind the manifests) are left out of every view and named in
    damaged_partitions; verify names them without a traceback and --repair sets them aside (the
    link itself, never its target); the real partitions answer throughout."""
    from updatelens.orchestration.cli import main

    root = tmp_path / "root"
    two_layers(root)
    table = root / "activations" / "model=m"
    shutil.copytree(table / "layer=3", table / "layer=03")
    shutil.copytree(table / "layer=4", table / "layer=4.bak")
    elsewhere = tmp_path / "elsewhere"
    write_partition(elsewhere, "activations", "m", 5, rows(5))
    (table / "layer=5").symlink_to(elsewhere / "activations" / "model=m" / "layer=5", target_is_directory=True)
    assert catalog.query(root, "SELECT layer, count(*) AS n FROM activations GROUP BY layer ORDER BY layer"
                         ).rows() == [(3, 4), (4, 4)]
    listed = catalog.query(root, "SELECT layer, reason FROM damaged_partitions ORDER BY reason").rows()
    assert len(listed) == 3, listed
    assert sum("not the layout's spelling" in reason for _, reason in listed) == 2
    assert any("layer=5 is a symbolic link" in reason for _, reason in listed)
    assert main(["verify", "--data-root", str(root)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err and out.out.count("damaged: ") == 3
    assert main(["verify", "--data-root", str(root), "--repair"]) == 1
    capsys.readouterr()
    main(["verify", "--data-root", str(root)])  # what is left: layers 3 and 4 (this root holds activations only)
    out = capsys.readouterr().out
    assert "damaged" not in out and out.count("incomplete: ") == 2, out
    assert sorted(p.name for p in table.iterdir()) == ["layer=3", "layer=4"]
    assert (elsewhere / "activations" / "model=m" / "layer=5" / "part-0.parquet").exists()  # the target is kept
    assert catalog.query(root, "SELECT count(*) AS n FROM activations")["n"][0] == 8


def test_a_layer_whose_tables_come_from_two_runs_is_incomplete(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A run with other settings stopped after its first stage: the layer's activations are of config c2,
    its other tables of c1. verify calls the layer incomplete and names both; layer 4 (one run) is not."""
    from updatelens.orchestration.cli import main
    from updatelens.storage.integrity import mixed_layers

    for layer in (3, 4):
        for table in ("activations", "local_fits"):
            write_partition(tmp_path, table, "m", layer, rows(layer))
    write_partition(tmp_path, "activations", "m", 3, rows(3, config="c2"))
    mixed = mixed_layers(tmp_path, ("activations", "local_fits"))
    assert [(model, layer, sorted(runs)) for model, layer, runs in mixed] == [("m", 3, ["c1", "c2"])]
    assert main(["verify", "--data-root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "incomplete: model=m layer=3: its tables come from different runs: activations at config c2" in out, out
    assert "layer=4: its tables" not in out


def test_an_interrupted_command_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C (KeyboardInterrupt) in any command: exit 130 and one line, no traceback; a command that
    writes says what is left and what redoes it."""
    from updatelens.orchestration import cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_run", interrupted)
    monkeypatch.setattr(cli, "cmd_verify", interrupted)
    assert cli.main(["run", "--data-root", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("updatelens run: interrupted; every partition is written whole")
    assert cli.main(["verify", "--data-root", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "updatelens verify: interrupted"


def test_damage_that_verify_found_is_remembered_left_out_and_forgotten_once_the_partition_is_rewritten(
        tmp_path: Path) -> None:
    """A flipped byte whose file kept its mtime is seen only by `verify` (full checksums); once seen, the
    root remembers it (a mark beside the partition, tied to its manifest): later queries leave the file
    out and list it in damaged_partitions without --repair, until the partition is written anew;
    quarantine takes the mark along."""
    from updatelens.storage import integrity
    from updatelens.storage.integrity import DAMAGE_MARK

    two_layers(tmp_path)
    file = partition_file(tmp_path, "activations", "m", 3)
    data = bytearray(file.read_bytes())
    data[10] ^= 0x10
    entry = json.loads((file.parent / MANIFEST).read_text())
    file.write_bytes(bytes(data))
    os.utime(file, ns=(file.stat().st_atime_ns, entry["mtime_ns"]))  # damage that kept the mtime
    integrity._verified.clear()
    assert catalog.query(tmp_path, "SELECT count(DISTINCT layer) AS n FROM activations")["n"][0] == 2  # served
    assert "SHA-256" in (partition_error(file, full=True) or "")  # what `updatelens verify` does
    integrity._verified.clear()  # another process: nothing remembered in memory
    assert "found by `updatelens verify`" in (partition_error(file) or "")
    assert catalog.query(tmp_path, "SELECT DISTINCT layer FROM activations")["layer"].to_list() == [4]
    listed = catalog.query(tmp_path, "SELECT table_name, layer, reason FROM damaged_partitions").to_dicts()
    assert [(r["table_name"], r["layer"]) for r in listed] == [("activations", 3)] and "SHA-256" in listed[0]["reason"]
    write_partition(tmp_path, "activations", "m", 3, rows(3))  # a run writes the partition anew
    assert partition_error(file) is None
    assert catalog.query(tmp_path, "SELECT count(DISTINCT layer) AS n FROM activations")["n"][0] == 2
    # quarantine takes the mark with the file and its manifest
    file.write_bytes(bytes(data))
    assert partition_error(file, full=True) is not None and (file.parent / DAMAGE_MARK).exists()
    moved = quarantine(tmp_path, file)
    assert (moved.parent / DAMAGE_MARK).exists() and not file.parent.exists()


def test_staging_left_by_a_killed_process_is_cleaned_everywhere_under_the_root(tmp_path: Path) -> None:
    """The main tables' staging, every sweep configuration's and convergence size's, and a sweep computed
    out of sight (sweeps/_next/...): what a dead process left goes, a live process's stays."""
    from tests.processes import dead_pid
    from updatelens.storage.staging import clean_abandoned_staging

    dead = dead_pid()
    left = [tmp_path / "_staging" / f"{dead}-a", tmp_path / "sweeps" / "config=abc" / "_staging" / f"{dead}-b",
            tmp_path / "convergence" / "n_seq=4" / "_staging" / f"{dead}-c", tmp_path / "sweeps" / "_next" / f"{dead}-d"]
    live = [tmp_path / "sweeps" / "config=abc" / "_staging" / f"{os.getpid()}-e",
            tmp_path / "sweeps" / "_next" / f"{os.getpid()}-f"]
    for folder in left + live:
        (folder / "geometry").mkdir(parents=True)
        (folder / "geometry" / "part-0.parquet").write_bytes(b"half")
    removed = clean_abandoned_staging(tmp_path)
    assert len(removed) == len(left) and not any(f.exists() for f in left)
    assert all(f.exists() for f in live)


def test_a_full_disk_while_the_catalog_is_built_leaves_no_half_built_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    two_layers(tmp_path)
    catalog.refresh(tmp_path)
    db_path = catalog.catalog_path(tmp_path)
    assert db_path is not None
    before = db_path.read_bytes()

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(db_path.parent / "x"))

    monkeypatch.setattr(catalog, "_create_views", full)
    with pytest.raises(OSError):
        catalog.refresh(tmp_path)
    assert not list(db_path.parent.glob("*.building*"))  # nothing half-built left beside the catalog
    assert db_path.read_bytes() == before  # the last good catalog stays


@pytest.mark.parametrize("fault", ["enospc", "sqlite"])
def test_a_full_disk_mid_run_ends_in_one_line_naming_the_cause_and_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fault: str) -> None:
    """The two ways a full disk surfaces: an OSError (a partition, the catalog) and the run database's
    SQLAlchemy error over SQLite's 'disk I/O error' (raised by Dagster outside any step)."""
    import errno
    import sqlite3

    import sqlalchemy.exc

    from updatelens.orchestration import cli

    def full(args: object) -> int:
        if fault == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "geometry" / "part-0.parquet"))
        raise sqlalchemy.exc.OperationalError("INSERT INTO event_logs", {}, sqlite3.OperationalError("disk I/O error"))

    monkeypatch.setattr(cli, "cmd_verify", full)
    parser_default = ["verify", "--data-root", str(tmp_path)]
    assert cli.main(parser_default) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the disk is full (or failing)" in err[0], err
    assert ("part-0.parquet" if fault == "enospc" else "disk I/O error") in err[0]


def test_the_weights_fingerprint_follows_the_content_and_is_read_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file's content counts (one byte of the config changes it, size and all kept), the WEIGHTS
    note and hidden files do not; a second call on unchanged files reads none of them (only stats)."""
    import updatelens.models as models

    monkeypatch.setenv("UPDATELENS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"layer_norm_epsilon": 1e-05}')
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    first = models.weights_fingerprint(folder)
    (folder / models.WEIGHTS_FILE).write_text("GGUF Q4_K_M\n")
    (folder / ".lock").write_text("x")
    read: list[Path] = []
    digest = models._file_digest
    monkeypatch.setattr(models, "_file_digest", lambda path: read.append(path) or digest(path))
    assert models.weights_fingerprint(folder) == first and read == []  # cached: nothing read again
    stat = (folder / "config.json").stat()
    (folder / "config.json").write_text('{"layer_norm_epsilon": 1e-03}')  # same size
    os.utime(folder / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = models.weights_fingerprint(folder)
    assert changed != first and [p.name for p in read] == ["config.json"]


def test_an_embedded_models_conversion_follows_its_gguf_file_not_its_slug(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion of a slug's GGUF is reused while it was made from that very file; other weights under
    the slug (a new package version, the registry pointed at another file) are converted anew and swapped
    in whole, so the weights' fingerprint is that of what loads; a reinstall of the same file (new mtime) is
    hashed once and kept; a folder converted before the identity was recorded is kept where its SOURCE
    names the file's name and size."""
    from updatelens.models import SOURCE_IDENTITY, converted, weights_fingerprint

    monkeypatch.setenv("UPDATELENS_CACHE", str(tmp_path / "cache"))
    calls: list[bytes] = []

    def convert(gguf: Path, folder: Path) -> None:  # a stand-in: the "weights" are the file's content
        calls.append(gguf.read_bytes())
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(gguf.read_bytes()[::-1])

    gguf, target = tmp_path / "pkg" / "model.gguf", tmp_path / "cache" / "models" / "slug"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF first weights")
    assert converted(gguf, target, convert) == target and len(calls) == 1
    first = weights_fingerprint(target)
    assert converted(gguf, target, convert) == target and len(calls) == 1  # reused: the same file
    os.utime(gguf, ns=(1, 1))  # reinstalled: the same content, another mtime
    assert converted(gguf, target, convert) == target and len(calls) == 1
    assert json.loads((target / SOURCE_IDENTITY).read_text())["mtime_ns"] == 1
    gguf.write_bytes(b"GGUF other weights!")  # other weights under the slug's file
    assert converted(gguf, target, convert) == target and len(calls) == 2
    assert (target / "model.safetensors").read_bytes() == b"GGUF other weights!"[::-1]
    assert weights_fingerprint(target) != first
    assert not [p for p in target.parent.iterdir() if p.name not in ("slug", ".slug.lock")]  # old one gone whole
    (target / SOURCE_IDENTITY).unlink()  # converted by an earlier version: SOURCE alone
    assert converted(gguf, target, convert) == target and len(calls) == 2
    (target / SOURCE_IDENTITY).unlink()
    (target / "SOURCE").write_text("model.gguf size=18\n")  # SOURCE of another file
    assert converted(gguf, target, convert) == target and len(calls) == 3


def test_processes_converting_one_gguf_together_convert_it_once(tmp_path: Path) -> None:
    """Two conversions of the same file at once (two test workers, two runs on a fresh cache): the second
    waits for the first and reuses its folder, instead of converting again beside it."""
    import threading
    import time

    from updatelens.models import converted

    calls: list[str] = []

    def convert(gguf: Path, folder: Path) -> None:
        calls.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other to arrive while this one converts
        (folder / "config.json").write_text("{}")

    gguf, target = tmp_path / "model.gguf", tmp_path / "cache" / "slug"
    gguf.write_bytes(b"GGUF weights")
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(converted(gguf, target, convert)), name=f"t{i}")
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [target, target] and len(calls) == 1, calls
