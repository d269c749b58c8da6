from __future__ import annotations

import numpy as np
import pytest

from updatelens.config import AnalysisConfig
from updatelens.errors import ConfigError

BAD = [
    (dict(classes=("diagonal", "spline")), "unknown function class 'spline'"),
    (dict(metric="manhattan"), "unknown metric"),
    (dict(exclusion="article"), "unknown neighbour exclusion"),
    (dict(bootstrap_unit="token"), "unknown bootstrap_unit"),
    (dict(windows_per_doc=-1), "windows_per_doc must be >= 0"),
    (dict(n_seq=2, seq_len=8, k=64), "candidate neighbours"),
    (dict(classes=("lowrank",), rank=32), "rank=32 must be below d_model=32"),
    (dict(classes=("mlp",), n_seq=1), "n_seq=1 is below folds=2"),
    (dict(controls=("crude",), classes=("lowrank",)), "crude control needs"),
    (dict(controls=("sideways",)), "unknown control"),
    (dict(seq_len=300), "exceeds the model's context of 256"),
    (dict(device="tpu"), "device must be"),
    (dict(device="cuda:x"), "device must be"),
    (dict(bootstrap=-1), "bootstrap must be >= 0, got -1"),
    (dict(jackknife_groups=1), "jackknife_groups must be 0 .* or at least 2"),
    (dict(kl_block=0), "kl_block must be >= 1, got 0"),
    (dict(subspace_ms=(1, 4, 64)), "subspace_ms must include 16"),
    (dict(subspace_ms=(16, 90)), "subspace_ms may not include 90"),
    (dict(index="annoy"), "unknown index"),
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(seed=10**23), "seed must be <= 2147483647"),
    (dict(mlp_lr=-0.1), "mlp_lr must be > 0, got -0.1"),
    (dict(mlp_lr=float("nan")), "mlp_lr must be a number, got nan"),
    (dict(bootstrap=10**9), "bootstrap must be <= 10000, got 1000000000"),
    (dict(energy_threshold=1.5), "energy_threshold must be <= 1"),
    (dict(energy_threshold=0.0), "energy_threshold must be > 0"),
]


@pytest.mark.parametrize("changes,message", BAD)
def test_bad_settings_name_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        AnalysisConfig(**changes).validate(d_model=32, max_positions=256)


def test_defaults_are_valid_and_config_id_tracks_results_not_batching() -> None:
    base = AnalysisConfig()
    base.validate(d_model=576, max_positions=8192)
    assert base.replace(patch_batch=3).config_id == base.config_id
    assert base.replace(kl_block=4).config_id == base.config_id
    assert base.replace(bootstrap=50).config_id != base.config_id
    assert base.replace(k=32).config_id != base.config_id
    assert AnalysisConfig.from_dict(base.to_dict()) == base
    with pytest.raises(ConfigError, match="unknown configuration keys"):
        AnalysisConfig.from_dict({"kk": 3})


def test_study_preset_and_its_layers() -> None:
    from updatelens.config import PRESETS, preset_layers

    cfg = AnalysisConfig(**PRESETS["study"])
    cfg.validate(d_model=576, max_positions=8192)
    assert cfg.n_seq * cfg.seq_len == 131072 and cfg.jackknife_groups > 0
    assert preset_layers("study", 30) == [0, 15, 29]
    assert preset_layers("study", 2) == [0, 1]
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_layers("huge", 30)


def test_layer_lists_and_ranges_parse_or_name_the_bad_part() -> None:
    from updatelens.orchestration.commands import _parse_layers

    assert _parse_layers("3-7,10") == [3, 4, 5, 6, 7, 10]
    assert _parse_layers("0,15,29") == [0, 15, 29]
    assert _parse_layers(None) is None
    with pytest.raises(ValueError, match="'x' is not a layer"):
        _parse_layers("3,x")


def test_the_code_locations_settings_come_from_updatelens_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from updatelens.assets.resources import UpdateLensResource
    from updatelens.errors import ConfigError

    monkeypatch.setenv("UPDATELENS_SETTINGS", '{"n_seq": 6, "seq_len": 16, "classes": ["lowrank"]}')
    cfg = UpdateLensResource().config()
    assert (cfg.n_seq, cfg.seq_len, cfg.classes) == (6, 16, ("lowrank",))
    monkeypatch.setenv("UPDATELENS_SETTINGS", '{"n_sequences": 6}')
    with pytest.raises(ConfigError, match="unknown configuration keys: \\['n_sequences'\\]"):
        UpdateLensResource()
    monkeypatch.setenv("UPDATELENS_SETTINGS", "[6]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        UpdateLensResource()


def test_the_kl_block_is_sized_from_the_vocabulary() -> None:
    cfg = AnalysisConfig()
    assert cfg.kl_block_size(49_152) == 8  # SmolLM2: 24 MiB a sequence, 192 MiB budget
    assert cfg.kl_block_size(262_144) == 1  # Gemma 3: 128 MiB a sequence
    assert cfg.replace(kl_budget_mb=1).kl_block_size(262_144) == 1
    assert cfg.replace(kl_budget_mb=64).config_id == cfg.config_id  # batching, not results


def test_fewer_documents_than_jackknife_groups_leave_each_document_out_once() -> None:
    from updatelens.steps.geometry import LayerGeometry

    cfg = AnalysisConfig(n_seq=4, bootstrap=10)
    cfg.validate()
    assert cfg.jackknife_groups > 4
    jack = LayerGeometry(cfg, ["diagonal"], 8, np.array([0, 0, 1, 2])).jackknife  # 3 documents, one of them twice
    assert jack.shape == (3, 4) and (jack.sum(axis=0) == 2).all()  # every sequence left out once
    assert sorted(jack.sum(axis=1).tolist()) == [2.0, 3.0, 3.0]


def test_one_declaration_gives_the_checks_the_launchpad_the_flags_and_the_help(capsys: pytest.CaptureFixture) -> None:
    """Every setting's choices, minimum and help are declared once (`updatelens.config.setting`): the
    checks, the Dagster launchpad's descriptions, `updatelens run`'s flags, `--set` parsing and its
    help all read them."""
    import dataclasses

    from updatelens.assets.resources import AnalysisSettings
    from updatelens.config import field_help, flag_fields, parse_setting
    from updatelens.orchestration.cli import main

    fields = dataclasses.fields(AnalysisConfig)
    for f in fields:
        assert AnalysisSettings.model_fields[f.name].description == field_help(f)
        if f.metadata.get("choices"):  # a value outside the declared choices is refused, naming them
            bad = ("nonsense",) if isinstance(f.default, tuple) else "nonsense"
            with pytest.raises(ConfigError, match=f"unknown {f.metadata['what']} 'nonsense'; choose from"):
                AnalysisConfig(**{f.name: bad}).validate()
        if f.metadata.get("minimum") is not None:  # each declared bound is enforced, naming the field
            below = f.metadata["minimum"] - 1
            with pytest.raises(ConfigError, match=f"{f.name} must be >= "):
                AnalysisConfig(**{f.name: type(f.default)(below)}).validate()
        if f.metadata.get("maximum") is not None:
            with pytest.raises(ConfigError, match=f"{f.name} must be <= "):
                AnalysisConfig(**{f.name: type(f.default)(f.metadata["maximum"] * 2 + 1)}).validate()
        if f.metadata.get("above") is not None:
            with pytest.raises(ConfigError, match=f"{f.name} must be > "):
                AnalysisConfig(**{f.name: type(f.default)(f.metadata["above"])}).validate()
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = capsys.readouterr().out
    assert all(f"  {f.name}: " in shown for f in fields)
    assert {f.metadata["flag"] for f in flag_fields()} == {"--n-seq", "--seq-len", "--k", "--rank", "--classes"}
    assert all(f.metadata["flag"] in shown for f in flag_fields())
    assert parse_setting("controls", "random,crude") == ["random", "crude"]
    assert parse_setting("controls", '["random"]') == ["random"]
    assert parse_setting("k", "32") == 32 and parse_setting("metric", "l2") == "l2"
    assert parse_setting("skip_first_position", "false") is False
    with pytest.raises(ConfigError, match="unknown configuration keys: \\['kk'\\]"):
        parse_setting("kk", "3")


def test_a_bad_setting_on_the_command_line_is_one_line_before_any_work(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from updatelens.orchestration.cli import main

    for args, message in ((["--set", "metric=manhattan"], "unknown metric 'manhattan'; choose from"),
                          (["--k", "0"], "k must be >= 1, got 0"),
                          (["--k", "many"], "k must be int (default 64), got 'many'"),
                          (["--classes", "lowrank,spline"], "unknown function class 'spline'")):
        assert main(["run", "--data-root", str(tmp_path / "data"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("updatelens run: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "data").exists()


def test_a_cuda_device_on_a_build_without_one_is_refused_before_the_weights_load() -> None:
    import torch

    from updatelens.preflight import check_device

    check_device("cpu")
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ConfigError, match="has no usable CUDA device"):
            check_device("cuda")
