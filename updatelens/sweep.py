"""Convention sweeps: the same sample analysed under a grid of configurations, one convention at a time.

Every convention the paper leaves open (docs/method.md) is a configuration value; a sweep varies one value
at a time around a baseline (one-at-a-time, not the full cross product, so the cost grows with
the number of settings, not their product). This module declares the grid and its configurations;
the `convention_sweep` asset runs them through the stages' engine runners on the stored sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from updatelens.config import AnalysisConfig
from updatelens.errors import ConfigError

# Around the default: neighbour exclusion, every position patched at once, k, rank and the function
# class. The alignment form, the angle reference and the error measure need no extra run: every run
# measures them both ways.
DEFAULT_GRID: dict[str, list[object]] = {
    "exclusion": ["sequence", "self", "none"],
    "patch_mode": ["all"],  # every position patched at once, beside the exact single-position effects
    "k": [32, 128],
    "rank": [4, 16],
    "classes": [["psd_diagonal", "orthogonal"]],
}
# How many layers, spread over the depth, a sweep measures when its layers are not named.
SWEEP_LAYERS = 8
# Keys that change the sample itself: a sweep compares conventions on one sample.
SAMPLE_KEYS = ("n_seq", "seq_len", "corpus_offset", "skip_first_position")
# Names the `sensitivity` view shows for a swept key.
CONVENTION_NAMES = {"classes": "class"}


@dataclass(frozen=True)
class SweepRun:
    convention: str  # "baseline", or the swept key ("k", "exclusion", ..., "class")
    setting: str  # the value, as text
    config: AnalysisConfig


def _setting(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def parse_grid(text: str) -> dict[str, list[object]]:
    """A grid from JSON ({"k": [32, 128], ...}), with a clear error for anything else."""
    try:
        grid = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"sweep grid is not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(grid, dict) or not all(isinstance(v, list) for v in grid.values()):
        raise ConfigError(f'sweep grid must map each setting to a list of values, e.g. {{"k": [32, 128]}}; got {text!r}')
    return grid


def sweep_baseline(cfg: AnalysisConfig, with_controls: bool) -> AnalysisConfig:
    """The configuration a sweep varies around: `cfg`, without its controls unless asked (two
    patched forwards per layer and configuration)."""
    return cfg if with_controls else cfg.replace(controls=())


def sweep_runs(base: AnalysisConfig, grid: Mapping[str, Sequence[object]], d_model: int | None = None,
               max_positions: int | None = None) -> list[SweepRun]:
    """The baseline and one configuration per (key, value) of the grid, each validated up front."""
    names = set(base.to_dict())
    runs = [SweepRun("baseline", "default", base)]
    seen = {base.config_id}
    for key, values in grid.items():
        if key not in names:
            raise ConfigError(f"sweep grid key {key!r} is not an analysis setting; choose from {sorted(names)}")
        if key in SAMPLE_KEYS:
            raise ConfigError(f"sweep grid key {key!r} changes the sample; a sweep compares conventions on one "
                              f"sample (run it as a separate analysis instead)")
        for value in values:
            try:
                cfg = base.replace(**{key: value})
            except TypeError as exc:
                raise ConfigError(f"sweep grid value {key}={value!r}: {exc}") from exc
            if cfg.config_id in seen:
                continue
            seen.add(cfg.config_id)
            runs.append(SweepRun(CONVENTION_NAMES.get(key, key), _setting(value), cfg))
    for run in runs:
        try:
            run.config.validate(d_model=d_model, max_positions=max_positions)
        except ConfigError as exc:
            raise ConfigError(f"sweep setting {run.convention}={run.setting}: {exc}") from exc
    return runs


def spread_layers(n_layers: int, count: int) -> list[int]:
    """`count` layers spread evenly from the first to the last (all of them if count >= n_layers)."""
    if count >= n_layers:
        return list(range(n_layers))
    return sorted({round(i * (n_layers - 1) / (count - 1)) for i in range(count)}) if count > 1 else [0]


def run_record(model: str, run: SweepRun, base: AnalysisConfig, layers: Iterable[int]) -> pa.Table:
    """The row that lists one configuration in the `sweep_runs` view."""
    return pa.table({
        "model": [model],
        "config_id": [run.config.config_id],
        "base_config_id": [base.config_id],
        "convention": [run.convention],
        "setting": [run.setting],
        "layers": [",".join(str(layer) for layer in layers)],
        "config_json": [run.config.to_json()],
    })

