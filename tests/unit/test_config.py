from __future__ import annotations

import pytest

from updatelens.config import AnalysisConfig
from updatelens.errors import ConfigError

BAD = [
    (dict(classes=("diagonal", "spline")), "unknown function class 'spline'"),
    (dict(metric="manhattan"), "unknown metric"),
    (dict(exclusion="document"), "unknown neighbour exclusion"),
    (dict(n_seq=2, seq_len=8, k=64), "candidate neighbours"),
    (dict(classes=("lowrank",), rank=32), "rank=32 must be below d_model=32"),
    (dict(classes=("mlp",), n_seq=1), "n_seq=1 is below folds=2"),
    (dict(controls=("crude",), classes=("lowrank",)), "crude control needs"),
    (dict(controls=("sideways",)), "unknown control"),
    (dict(seq_len=300), "exceeds the model's context of 256"),
    (dict(device="tpu"), "device must be"),
]


@pytest.mark.parametrize("changes,message", BAD)
def test_bad_settings_name_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        AnalysisConfig(**changes).validate(d_model=32, max_positions=256)


def test_defaults_are_valid_and_config_id_tracks_results_not_batching() -> None:
    base = AnalysisConfig()
    base.validate(d_model=576, max_positions=8192)
    assert base.replace(patch_batch=3).config_id == base.config_id
    assert base.replace(k=32).config_id != base.config_id
    assert AnalysisConfig.from_dict(base.to_dict()) == base
    with pytest.raises(ConfigError, match="unknown configuration keys"):
        AnalysisConfig.from_dict({"kk": 3})
