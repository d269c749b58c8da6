"""Fault injection: bad inputs fail fast and write nothing; a SIGKILL mid-write leaves nothing
partial visible; concurrent runs do not interfere; reruns give identical results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel

from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.errors import ModelError, UpdateLensError
from updatelens.models import locate_blocks
from updatelens.orchestration.cli import main
from updatelens.orchestration.deployments import PROFILE_ENV
from updatelens.orchestration.runner import materialize_model
from updatelens.stages import TABLES
from updatelens.storage import catalog
from updatelens.storage.layout import STAGING

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--n-seq", "6", "--seq-len", "16", "--k", "8", "--rank", "2"]
# the crash and concurrency runs store results only (the reports are tested where they are built)
NO_REPORT = ["--no-report"]


def registry_with(zoo: Path, path: Path, extra: str = "") -> Path:
    path.write_text(zoo.read_text() + "\n" + extra)
    return path


def parquet_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.parquet") if STAGING not in p.parts]


def local_model(zoo: Path, slug: str) -> Path:
    return Path(tomllib.loads(zoo.read_text())["models"][slug]["path"])


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("UPDATELENS_CACHE", str(tmp_path / "cache"))
    return tmp_path


def bad_inputs(zoo: Path, tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, CLI args, expected message) for every bad input the issue lists."""
    truncated = tmp / "truncated"
    shutil.copytree(local_model(zoo, "tiny-llama"), truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    bert = tmp / "bert"  # a causal-LM-capable type, but the checkpoint has only the encoder
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(bert)
    distilbert = tmp / "distilbert"  # a type with no causal LM at all
    DistilBertModel(DistilBertConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=32)).save_pretrained(distilbert)
    fake_pkg = tmp / "pkgs" / "fake_gguf_pkg"
    fake_pkg.mkdir(parents=True)
    (fake_pkg / "__init__.py").write_text("")
    (fake_pkg / "broken.gguf").write_bytes(b"GGUF" + os.urandom(64))
    (tmp / "empty.txt").write_text("")
    (tmp / "binary.txt").write_bytes(b"\x00\x01binary\x00" * 100)
    (tmp / "short.txt").write_text("only a few words here")
    (tmp / "a-file").write_text("not a folder")
    registry = registry_with(zoo, tmp / "registry.toml", f"""
[models.missing]
source = "local"
path = "{tmp / 'does-not-exist'}"
[models.offline-hub]
source = "hub"
id = "nobody/never-downloaded-model"
[models.truncated]
source = "local"
path = "{truncated}"
[models.bert]
source = "local"
path = "{bert}"
[models.distilbert]
source = "local"
path = "{distilbert}"
[models.broken-gguf]
source = "embedded"
package = "fake_gguf_pkg"
file = "broken.gguf"
[corpora.empty]
source = "text"
path = "{tmp / 'empty.txt'}"
[corpora.binary]
source = "text"
path = "{tmp / 'binary.txt'}"
[corpora.short]
source = "text"
path = "{tmp / 'short.txt'}"
""")
    base = ["run", "--registry", str(registry), "--data-root", str(tmp / "data")]
    llama = [*base, "--model", "tiny-llama", *SMALL]
    return [
        ("unknown model", [*base, "--model", "nope"], "unknown model 'nope'"),
        ("missing local path", [*base, "--model", "missing"], "does not exist or is not a folder"),
        ("hub id offline", [*base, "--model", "offline-hub"], "HF_HUB_OFFLINE=1 and it is not in the local cache"),
        ("truncated weights", [*base, "--model", "truncated", *SMALL], "is truncated"),
        ("corrupt gguf", [*base, "--model", "broken-gguf"], "corrupt or truncated GGUF"),
        ("no causal LM class", [*base, "--model", "distilbert"], "has no causal language-model head"),
        ("empty corpus", [*llama, "--corpus", "empty"], "is empty"),
        ("binary corpus", [*llama, "--corpus", "binary"], "looks binary"),
        ("too-short corpus", [*llama, "--corpus", "short"], "is too short"),
        ("seq_len above context", [*base, "--model", "tiny-llama", "--seq-len", "100"], "exceeds the model's context of 64"),
        ("k too large", [*base, "--model", "tiny-llama", "--n-seq", "2", "--seq-len", "8", "--k", "64"], "candidate neighbours"),
        ("rank >= d", [*base, "--model", "tiny-llama", *SMALL[:6], "--rank", "32"], "rank=32 must be below d_model=32"),
        ("unknown class", [*llama, "--classes", "diagonal,spline"], "unknown function class 'spline'"),
        ("unknown metric", [*llama, "--set", "metric=manhattan"], "unknown metric 'manhattan'"),
        ("data root not writable", [*llama, "--data-root", str(tmp / "a-file" / "data")], "is not writable"),
    ]


def test_each_bad_input_fails_fast_with_its_message_and_writes_nothing(
        zoo: Path, env: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = bad_inputs(zoo, env)
    monkeypatch.syspath_prepend(str(env / "pkgs"))  # where the package with the broken GGUF lives
    for name, args, message in cases:
        start = time.perf_counter()
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2, f"{name}: exit {code}, stderr {err}"
        assert message in err, f"{name}: {err}"
        assert time.perf_counter() - start < 30, f"{name}: took too long to fail"
    assert not parquet_files(env / "data")


def test_a_checkpoint_without_a_trained_lm_head_is_refused_before_capture(
        zoo: Path, env: Path, capsys: pytest.CaptureFixture) -> None:
    """The config allows a causal LM (BERT as a decoder) but the weights lack its head: the model
    load reports the missing weights and the run stops before anything is written."""
    args = next(a for n, a, _ in bad_inputs(zoo, env) if n == "unknown model")
    code = main([*args[:-1], "bert", *SMALL])
    assert code == 1
    assert "it has no trained causal LM head" in capsys.readouterr().err
    assert not parquet_files(env / "data")


def test_out_of_disk_space_is_reported_before_any_work(zoo: Path, env: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage:
        total, used, free = 10**9, 10**9 - 1000, 1000

    monkeypatch.setattr("updatelens.preflight.shutil.disk_usage", lambda path: Usage())
    code = main(["run", "--registry", str(zoo), "--data-root", str(env / "data"), "--model", "tiny-gpt2", *SMALL])
    assert code == 2 and "GiB free, the run needs about" in capsys.readouterr().err
    assert not parquet_files(env / "data")


def test_blocks_that_cannot_be_located_are_a_clear_error() -> None:
    import torch

    class NoBlocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(ModelError, match="cannot locate the blocks"):
        locate_blocks(NoBlocks())


def cli(args: list[str], home: Path, fault: str | None = None) -> subprocess.Popen:
    """The CLI in a subprocess; with `fault`, under bench.faults, killed at that point of writing geometry."""
    env = dict(os.environ, DAGSTER_HOME=str(home), HF_HUB_OFFLINE="1")
    entry = ["bench.faults", fault, "geometry", "--"] if fault else ["updatelens.orchestration.cli"]
    return subprocess.Popen([sys.executable, "-m", *entry, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_mid_write_before_the_manifest_and_mid_replace_leave_only_verified_files(
        zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Killed while a partition's data file is half-written, and after it is complete but before its
    manifest: the partition never appears, nor does any table of the run's earlier stages (stage, then
    swap: they wait in the run's folder). Killed while the run's partitions are swapped in (geometry's
    new folder in place, its old one not yet removed, the tables after it not yet swapped): every
    partition is whole, and the next run finishes the swap. Every file readers see verifies, queries
    keep answering, and the next run completes."""
    root = tmp_path / "data"
    args = ["run", "--registry", str(zoo), "--data-root", str(root), "--model", "tiny-gpt2", *SMALL, *NO_REPORT]
    killed = cli(args, tmp_path / "home", "mid_write")
    killed.communicate(timeout=300)
    assert killed.returncode == -9
    assert list((root / STAGING).glob("*/part-0.parquet")), "the kill should land with a staging file half-written"
    assert not (root / "geometry").exists()  # the partial file is not where readers look
    for path in parquet_files(root):  # everything visible is whole
        pq.read_table(path)
    # the stages before the killed one wrote whole partitions, into the run's folder, not in place
    assert len(list((root / STAGING).glob("run-*/local_fits/model=tiny-gpt2/layer=*/part-0.parquet"))) == 3
    assert not (root / "local_fits").exists() and not (root / "activations").exists()

    killed = cli(args, tmp_path / "home", "before_manifest")  # the rerun computes what is missing: geometry on
    killed.communicate(timeout=300)
    assert killed.returncode == -9
    assert list((root / STAGING).glob("*/part-0.parquet")) and not (root / "geometry").exists()
    assert catalog.query(root, "SELECT count(*) AS n FROM damaged_partitions")["n"][0] == 0

    rerun = cli([*args, "--summary-json", str(tmp_path / "summary.json")], tmp_path / "home")
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())  # what the bench reads
    assert summary["pipeline_s"] > 0 and 0 < summary["peak_rss_gib"] < 24 and summary["layers"] == [0, 1, 2]
    assert "reports not built (--no-report)" in out and not (root / "reports").exists()
    assert not list((root / STAGING).iterdir())  # the crashed runs' staging dirs were cleaned up
    assert catalog.query(root, "SELECT count(*) AS n FROM geometry")["n"][0] == 3 * 2 * 6 * 15

    replaced = cli([*args, "--force"], tmp_path / "home", "mid_replace")
    replaced.communicate(timeout=300)
    assert replaced.returncode == -9
    layers = catalog.query(root, "SELECT DISTINCT layer FROM geometry ORDER BY layer")["layer"].to_list()
    assert len(layers) == 3  # never absent: the old partition or the new one, whole
    assert list((root / STAGING).iterdir())  # the old folder, left by the killed writer, and the run's folder
    assert list((root / STAGING).glob("run-*/commit.json"))  # the swap's list: the next run finishes it
    assert catalog.query(root, "SELECT count(*) AS n FROM damaged_partitions")["n"][0] == 0
    assert catalog.query(root, "SELECT count(*) AS n FROM local_fits")["n"][0] == 3 * 2 * 6 * 15
    final = cli(args, tmp_path / "home")
    out, _ = final.communicate(timeout=300)
    assert final.returncode == 0, out
    assert catalog.query(root, "SELECT count(DISTINCT layer) AS n FROM geometry")["n"][0] == 3
    assert not list((root / STAGING).iterdir())  # the abandoned folder was cleaned
    # in this process (what `run` and `verify` decide from the stored files; a CLI process costs 10 s)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))  # restored after the test: `run` sets them
    monkeypatch.setenv(PROFILE_ENV, "local")
    capsys.readouterr()
    assert main(args[:]) == 0 and "every requested partition is up to date" in capsys.readouterr().out
    assert main(["verify", "--data-root", str(root)]) == 0
    # a run that gives one layer other settings says what that does to each configuration's findings
    capsys.readouterr()
    assert main([*args, "--layers", "1", "--set", "ridge=0.01"]) == 0
    out = capsys.readouterr().out
    assert "note: layer(s) 1 held configuration" in out, out
    assert ": 2 of 3 layers" in out and ": 1 of 3 layers" in out and "'not measured'" in out


def test_concurrent_runs_on_two_models_and_on_one_model_while_sql_reads(zoo: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    base = ["run", "--registry", str(zoo), "--data-root", str(root), *SMALL, *NO_REPORT, "--force"]
    procs = [cli([*base, "--model", "tiny-gpt2"], tmp_path / "h1"),
             cli([*base, "--model", "tiny-mamba"], tmp_path / "h2"),
             cli([*base, "--model", "tiny-mamba"], tmp_path / "h3")]  # same partitions as the one before
    reads = 0
    while any(p.poll() is None for p in procs):
        try:
            catalog.query(root, "SELECT count(*) FROM activations")
            reads += 1
        except Exception as exc:  # noqa: BLE001 - only "no such view yet" is acceptable
            assert "does not exist" in str(exc), exc
        time.sleep(1.0)  # a query a second: each costs the test process CPU the three runs need
    for p in procs:
        out, _ = p.communicate()
        assert p.returncode == 0, out
    assert reads > 0
    counts = catalog.query(root, "SELECT model, count(*) AS n FROM geometry GROUP BY model ORDER BY model")
    assert counts.rows() == [("tiny-gpt2", 3 * 2 * 6 * 15), ("tiny-mamba", 3 * 2 * 6 * 15)]


def test_rerun_with_the_same_config_gives_identical_tables(zoo: Path, tmp_path: Path) -> None:
    """Two runs of the middle layer, on two roots, store equal tables: every column of every row."""
    tables = []
    for name in ("a", "b"):
        lens = UpdateLensResource(data_root=str(tmp_path / name), registry=str(zoo),
                                  analysis=AnalysisSettings(n_seq=6, seq_len=16, k=8, rank=2))
        with dg.DagsterInstance.ephemeral() as instance:
            assert materialize_model("tiny-llama", lens, instance, layers=[1]).success
        tables.append({t: pq.read_table(p).sort_by([("layer", "ascending")])
                       for t in TABLES for p in (tmp_path / name / t / "model=tiny-llama").glob("layer=1/*.parquet")})
    assert set(tables[0]) == set(TABLES)
    for t in TABLES:
        assert tables[0][t].equals(tables[1][t]), t


@pytest.fixture
def deep_lens(zoo: Path, env: Path) -> UpdateLensResource:
    """A 12-layer config beside the tiny Llama's tokenizer and weights: the preflight reads no weights,
    so it stands for a deeper model in the checks that come before any work."""
    deep = env / "deep-llama"
    shutil.copytree(local_model(zoo, "tiny-llama"), deep)
    config = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12, "max_position_embeddings": 256}))
    registry = registry_with(zoo, env / "registry.toml", f'[models.deep-llama]\nsource = "local"\npath = "{deep}"\n')
    # exclusion by sequence: the study preset's small sizes (2 or 4 windows of one article) leave no
    # neighbour outside the anchor's document
    return UpdateLensResource(registry=str(registry), data_root=str(env / "data"), model="deep-llama",
                              analysis=AnalysisSettings(n_seq=8, seq_len=16, k=4, rank=2, exclusion="sequence"))


def test_the_disk_check_counts_the_layers_the_run_analyses(deep_lens: UpdateLensResource,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The study preset analyses three layers: its disk estimate counts three, not the model's depth
    (a 30-layer model's study was refused for 10 x the room it needs); `converge` counts every size."""
    from updatelens.config import preset_layers
    from updatelens.orchestration.convergence import plan_convergence
    from updatelens.orchestration.runner import check_inputs
    from updatelens.preflight import estimate_bytes

    lens, cfg = deep_lens, deep_lens.config()
    everything = check_inputs("deep-llama", lens)
    study = check_inputs("deep-llama", lens, preset="study")
    assert everything.n_layers == 12 and preset_layers("study", 12) == [0, 6, 11]
    assert study.bytes_needed == estimate_bytes(cfg, 3, study.d_model) == everything.bytes_needed // 4
    assert check_inputs("deep-llama", lens, [1]).bytes_needed == estimate_bytes(cfg, 1, study.d_model)

    sizes = [2 * 16, 8 * 16]  # the larger size alone fits, both together do not
    larger = estimate_bytes(cfg.replace(n_seq=8), 3, study.d_model)

    class Usage:
        total, used, free = 10**12, 0, int(1.3 * larger)

    monkeypatch.setattr("updatelens.preflight.shutil.disk_usage", lambda path: Usage())
    with pytest.raises(UpdateLensError, match="GiB free, the run needs about"):
        plan_convergence("deep-llama", lens, sizes)
    Usage.free = 2 * larger
    assert plan_convergence("deep-llama", lens, sizes).layers == [0, 6, 11]


def test_converge_uses_the_study_presets_settings_so_its_largest_size_is_the_study(
        deep_lens: UpdateLensResource, capsys: pytest.CaptureFixture) -> None:
    from updatelens.config import PRESETS
    from updatelens.errors import ConfigError
    from updatelens.orchestration.convergence import ConvergeConfig, plan_convergence

    study = PRESETS["study"]
    assert ConvergeConfig().preset == "study"
    plan = plan_convergence("deep-llama", deep_lens, [256, 512], preset="study")
    for (_tokens, sub), n_seq in zip(plan.sizes, (2, 4)):
        cfg = sub.config()
        assert (cfg.n_seq, cfg.seq_len, list(cfg.classes), list(cfg.controls), cfg.bootstrap, cfg.jackknife_groups) == (
            n_seq, study["seq_len"], study["classes"], study["controls"], study["bootstrap"], study["jackknife_groups"])
        assert cfg.k == 4 and cfg.rank == 2  # the lens's own settings where the preset says nothing
    own = plan_convergence("deep-llama", deep_lens, [32])  # no preset: the lens's settings
    assert own.sizes[0][1].config().seq_len == 16 and own.sizes[0][1].config().n_seq == 2
    with pytest.raises(ConfigError, match="unknown preset 'big'"):
        plan_convergence("deep-llama", deep_lens, [256], preset="big")
    # the CLI's default is the study too: a size that is no multiple of its 128-token windows is refused
    code = main(["converge", "--registry", deep_lens.registry, "--data-root", deep_lens.data_root,
                 "--model", "deep-llama", "--tokens", "64"])
    assert code == 2 and "multiple of seq_len=128" in capsys.readouterr().err


def test_a_sweep_on_a_fresh_root_captures_the_sample_first_and_only_once(zoo: Path, env: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """The sweep analyses the stored activations: `updatelens sweep` captures the swept layers that have
    none, then sweeps; a second sweep reads the same capture."""
    args = ["sweep", "--registry", str(zoo), "--data-root", str(env / "data"), "--model", "tiny-gpt2", "--layers", "0,1",
            "--grid", '{"k": [4]}', "--set", "n_seq=6", "--set", "seq_len=16", "--set", "k=8", "--set", "rank=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capturing the activations of layers 0-1 first" in out
    root = env / "data"
    assert set(catalog.query(root, "SELECT DISTINCT layer FROM sweep_geometry")["layer"]) == {0, 1}
    assert len(catalog.query(root, "SELECT DISTINCT config_id FROM sweep_functional_summary")) == 2
    assert not (root / "local_fits").exists()  # the run's own stages are not materialized by a sweep
    assert main(args) == 0
    assert "capturing" not in capsys.readouterr().out


def test_other_weights_under_the_same_name_are_never_mixed_with_the_stored_rows(
        zoo: Path, env: Path, capsys: pytest.CaptureFixture) -> None:
    """The weights' fingerprint is on every row and in every manifest: with a changed config in the model's
    folder (one norm epsilon), a run of one layer refuses in one line (the other layers' rows were made with
    the old weights) and changes nothing; a run of every layer recomputes them all (staleness compares the
    fingerprint). A root that holds two fingerprints under one name is named by `verify`."""
    from updatelens.storage.integrity import MANIFEST
    from updatelens.storage.layout import partition_file

    folder = env / "tiny-copy"
    shutil.copytree(local_model(zoo, "tiny-gpt2"), folder)
    registry = registry_with(zoo, env / "registry.toml", f'[models.tiny-copy]\nsource = "local"\npath = "{folder}"\n')
    root = env / "data"
    base = ["run", "--registry", str(registry), "--data-root", str(root), "--model", "tiny-copy", *SMALL, *NO_REPORT]
    assert main(base) == 0
    before = {p: p.read_bytes() for p in parquet_files(root)}
    revisions = {json.loads((p.parent / MANIFEST).read_text())["model_revision"] for p in before}
    assert len(revisions) == 1 and " weights:" in next(iter(revisions))
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_epsilon"] = 1e-3
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main([*base, "--layers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layers 1-2 made with other weights" in err[0], err
    assert {p: p.read_bytes() for p in parquet_files(root)} == before  # nothing touched
    assert main(base) == 0  # every layer: all stale by their fingerprint, all recomputed
    after = {json.loads((p.parent / MANIFEST).read_text())["model_revision"] for p in parquet_files(root)}
    assert len(after) == 1 and after != revisions
    assert main(["verify", "--data-root", str(root)]) == 0
    # a root holding both (as a run of an older version could leave it): verify names it
    manifest = partition_file(root, "geometry", "tiny-copy", 1).parent / MANIFEST
    entry = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(entry | {"model_revision": next(iter(revisions))}))
    capsys.readouterr()
    assert main(["verify", "--data-root", str(root)]) == 1
    assert "mixed weights: model=tiny-copy: its rows come from 2 sets of weights" in capsys.readouterr().out
