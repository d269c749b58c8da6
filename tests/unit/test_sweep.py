"""Sweep grids: validated before any heavy work, one configuration per setting."""

from __future__ import annotations

import pytest

from updatelens.config import AnalysisConfig
from updatelens.errors import ConfigError
from updatelens.sweep import DEFAULT_GRID, parse_grid, spread_layers, sweep_runs


def test_default_grid_is_one_setting_at_a_time() -> None:
    base = AnalysisConfig(controls=())  # as the sweep asset runs it by default
    runs = sweep_runs(base, DEFAULT_GRID, d_model=576, max_positions=2048)
    assert runs[0].convention == "baseline" and runs[0].config == base
    assert [(r.convention, r.setting) for r in runs[1:]] == [
        ("exclusion", "sequence"), ("exclusion", "self"), ("exclusion", "none"), ("patch_mode", "all"), ("k", "32"),
        ("k", "128"), ("rank", "4"), ("rank", "16"), ("class", "psd_diagonal,orthogonal")]
    assert len({r.config.config_id for r in runs}) == len(runs)
    for run in runs[1:]:  # each differs from the baseline in exactly the swept setting
        changed = {k for k, v in run.config.to_dict().items() if base.to_dict()[k] != v}
        assert changed == {"classes" if run.convention == "class" else run.convention}


def test_a_value_equal_to_the_baseline_is_not_run_twice() -> None:
    runs = sweep_runs(AnalysisConfig(), {"k": [64, 32]})
    assert [(r.convention, r.setting) for r in runs] == [("baseline", "default"), ("k", "32")]


@pytest.mark.parametrize("grid, message", [
    ({"kk": [1]}, "'kk' is not an analysis setting"),
    ({"n_seq": [8]}, "changes the sample"),
    ({"k": [5000]}, "sweep setting k=5000: k=5000 must be below"),
    ({"exclusion": ["others"]}, "unknown neighbour exclusion 'others'"),
])
def test_bad_grids_are_refused_up_front(grid: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sweep_runs(AnalysisConfig(), grid)


def test_parse_grid_names_the_problem() -> None:
    assert parse_grid('{"k": [32]}') == {"k": [32]}
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_grid("{k: 32}")
    with pytest.raises(ConfigError, match="map each setting to a list"):
        parse_grid('{"k": 32}')


def test_spread_layers() -> None:
    assert spread_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert spread_layers(3, 8) == [0, 1, 2]
    assert spread_layers(10, 1) == [0]
