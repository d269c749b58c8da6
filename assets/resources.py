"""The one resource the assets share: where data lives, which registry, and the analysis settings.

The analysis settings are Dagster config generated from the engine's AnalysisConfig dataclass (one
source of truth for names and defaults); the launchpad shows them under `resources.lens.config`.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic
import torch
from upath import UPath

from updatelens.analysis import held_out_sample, model_sample
from updatelens.assets.check_catalog import CheckSettings
from updatelens.config import AnalysisConfig, field_help, json_object_env
from updatelens.corpus import Sample
from updatelens.memory import release_free_memory
from updatelens.models import LoadedModel, load_model, recorded_revision
from updatelens.registry import DEFAULT_CORPUS, get_corpus, get_model, registry_path
from updatelens.storage.location import as_root, default_data_root
from updatelens.storage.store import Store


def _settings_fields() -> dict[str, Any]:
    """The launchpad's fields: AnalysisConfig's, with each one's help, choices and default as its description."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(AnalysisConfig):
        default = f.default
        if isinstance(default, tuple):
            inner = type(default[0]) if default else str
            fields[f.name] = (list[inner], pydantic.Field(list(default), description=field_help(f)))  # type: ignore[valid-type]
        else:
            fields[f.name] = (type(default), pydantic.Field(default, description=field_help(f)))
    return fields


AnalysisSettings = pydantic.create_model(
    "AnalysisSettings",
    __base__=dg.Config,
    __doc__="Every knob of the method (docs/method.md) (see updatelens.config.AnalysisConfig); recorded with results.",
    **_settings_fields(),
)

_MODEL_CACHE: dict[tuple[str, str, str | None], LoadedModel] = {}


def release_models() -> None:
    """Drop the loaded model and hand its memory back (updatelens.memory): a step that has made its
    forward passes calls it before the work after them (the catalog's refresh, the stages that need no
    model), so the weights (1 GiB for Gemma 3 270M) are not held through them. The next step that needs
    the model loads it again (seconds)."""
    _MODEL_CACHE.clear()
    gc.collect()
    release_free_memory()


SETTINGS_ENV = "UPDATELENS_SETTINGS"


def default_settings() -> Any:
    """The code location's analysis settings: the engine's defaults, overridden by the JSON object in
    $UPDATELENS_SETTINGS (e.g. '{"n_seq": 64, "classes": ["lowrank"]}'): what automated runs (sensors,
    declarative automation, schedules) use unless a launch gives its own config."""
    values = json_object_env(SETTINGS_ENV)
    if values is None:
        return AnalysisSettings()
    AnalysisConfig.from_dict(values)  # unknown or invalid settings fail here, with their names
    return AnalysisSettings(**values)


class UpdateLensResource(dg.ConfigurableResource):
    """Data root, registry and the analysis configuration of a run."""

    data_root: str = pydantic.Field(default_factory=default_data_root)
    registry: str = pydantic.Field(default_factory=lambda: str(registry_path()))
    corpus: str = DEFAULT_CORPUS
    analysis: AnalysisSettings = pydantic.Field(default_factory=default_settings)  # type: ignore[valid-type]
    checks: CheckSettings = pydantic.Field(default_factory=CheckSettings)

    @property
    def root(self) -> UPath:
        """A local folder or an object-store URL (storage.location)."""
        return as_root(self.data_root)

    @property
    def store(self) -> Store:
        """The data root opened: partitions, locks and the SQL catalog (storage.store)."""
        return Store.open(self.data_root)

    def config(self) -> AnalysisConfig:
        return AnalysisConfig.from_dict(self.analysis.model_dump())  # type: ignore[attr-defined]

    def load(self, model: str) -> LoadedModel:
        """Load (or reuse) a model; one model is kept in memory at a time. Reused only while its folder
        holds the same weights (the fingerprint, models.recorded_revision: a warm cache stats the files),
        so a long-lived process (the UI's code server) never runs stale weights under their name."""
        cfg = self.config()
        entry = get_model(model, Path(self.registry))
        key = (model, cfg.device, recorded_revision(entry))
        if key not in _MODEL_CACHE:
            _MODEL_CACHE.clear()
            lm = load_model(entry, device=cfg.device, dtype=torch.float32)
            key = (model, cfg.device, recorded_revision(entry))  # a hub model not cached before has one now
            _MODEL_CACHE[key] = lm
        return _MODEL_CACHE[key]

    def sample(self, lm: LoadedModel) -> Sample:
        cfg = self.config()
        entry = get_corpus(self.corpus, Path(self.registry))
        return model_sample(lm, entry, cfg)

    def held_out_sample(self, lm: LoadedModel, sample: Sample) -> Sample:
        """The linear control's held-out windows (analysis.held_out_sample)."""
        return held_out_sample(lm, get_corpus(self.corpus, Path(self.registry)), self.config(), sample)
