"""Headless materialization of a model's partitions: what `updatelens run` and the tests call."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from assets.reports import comparison_report, convention_sweep, report
from orchestration.definitions import ASSETS
from orchestration.partitions import (
    MODEL_LAYER,
    MODELS,
    model_keys,
    parse_key,
    range_tags,
)
from orchestration.registry_watch import stale_keys
from orchestration.resources import UpdateLensResource
from updatelens import CODE_VERSION
from updatelens.errors import ConfigError
from updatelens.preflight import Preflight, preflight
from updatelens.registry import get_corpus, get_model


def dagster_yaml(model_pool_limit: int | None = None) -> str:
    """Instance config: telemetry and the welcome pop-up off; the `model` pool (capture and patched
    forwards) limited so two runs never hold two models at once ($UPDATELENS_MODEL_POOL_LIMIT)."""
    limit = model_pool_limit or int(os.environ.get("UPDATELENS_MODEL_POOL_LIMIT", "1"))
    return (f"telemetry:\n  enabled: false\nnux:\n  enabled: false\n"
            f"concurrency:\n  pools:\n    default_limit: {limit}\n")


DAGSTER_YAML = dagster_yaml(1)


def project_dagster_home(base: Path | None = None) -> Path:
    """DAGSTER_HOME if set, else `.dagster_home` in the working directory (telemetry and nux off)."""
    home = Path(os.environ.get("DAGSTER_HOME") or (base or Path.cwd()) / ".dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text(dagster_yaml())
    return home


def register_model(instance: dg.DagsterInstance, model: str, n_layers: int) -> list[str]:
    """Add the model's (model, layer) keys so they are contiguous in the partition order.

    Launching a key range runs exactly those keys; if an earlier registration left the model's
    keys scattered (or of another depth), they are removed and added again at the end.
    """
    wanted = model_keys(model, n_layers)
    existing = list(instance.get_dynamic_partitions(MODEL_LAYER.name))
    mine = [k for k in existing if parse_key(k)[0] == model]
    if mine == wanted and existing[existing.index(wanted[0]) : existing.index(wanted[0]) + n_layers] == wanted:
        return wanted
    for key in mine:
        instance.delete_dynamic_partition(MODEL_LAYER.name, key)
    instance.add_dynamic_partitions(MODEL_LAYER.name, wanted)
    return wanted


def register_model_key(instance: dg.DagsterInstance, model: str) -> None:
    """The model's key of the per-model assets (report, convention sweep)."""
    if not instance.has_dynamic_partition(MODELS.name, model):
        instance.add_dynamic_partitions(MODELS.name, [model])


def contiguous_ranges(layers: Sequence[int]) -> list[list[int]]:
    """[0, 1, 2, 5, 6] -> [[0, 1, 2], [5, 6]]: each range is one single-run backfill."""
    ranges: list[list[int]] = []
    for layer in sorted(set(layers)):
        if ranges and layer == ranges[-1][-1] + 1:
            ranges[-1].append(layer)
        else:
            ranges.append([layer])
    return ranges


def stale_layers(lens: UpdateLensResource, model: str, layers: Sequence[int]) -> list[int]:
    """The requested layers whose results are missing or from another code version or config."""
    keys = model_keys(model, max(layers) + 1)
    stale = set(stale_keys(lens.root, model, len(keys), lens.config().config_id, CODE_VERSION))
    return [layer for layer in layers if keys[layer] in stale]


def check_inputs(model: str, lens: UpdateLensResource, layers: Sequence[int] | None = None) -> Preflight:
    """Everything that can be checked without loading weights (seconds, not minutes)."""
    registry = Path(lens.registry)
    report = preflight(get_model(model, registry), get_corpus(lens.corpus, registry), lens.config(), lens.root)
    bad = [layer for layer in layers or [] if not 0 <= layer < report.n_layers]
    if bad:
        raise ConfigError(f"{model} has {report.n_layers} layers (0..{report.n_layers - 1}); no layer {bad}")
    return report


def materialize_model(model: str, lens: UpdateLensResource, instance: dg.DagsterInstance,
                      layers: Sequence[int] | None = None,
                      selection: Sequence[dg.AssetsDefinition] | None = None,
                      log_level: str = "DEBUG", raise_on_error: bool = True,
                      report: Preflight | None = None) -> dg.ExecuteInJobResult:
    """One in-process run over a contiguous range of the model's layers (default: all)."""
    report = report or check_inputs(model, lens, layers)
    keys = register_model(instance, model, report.n_layers)
    register_model_key(instance, model)
    chosen = list(range(report.n_layers)) if layers is None else sorted(set(layers))
    if len(contiguous_ranges(chosen)) != 1:
        raise ConfigError("layers must be a contiguous range (e.g. 3-7) for a single run")
    return dg.materialize(
        list(selection or ASSETS),
        instance=instance,
        resources={"lens": lens},
        tags=range_tags([keys[layer] for layer in chosen]),
        run_config={"loggers": {"console": {"config": {"log_level": log_level}}}},
        raise_on_error=raise_on_error,
    )


def materialize_reports(models: Sequence[str], lens: UpdateLensResource, instance: dg.DagsterInstance,
                        comparison: bool = True, raise_on_error: bool = True) -> list[dg.ExecuteInJobResult]:
    """Each model's report (from stored results), then the comparison across all models."""
    results = []
    for model in models:
        register_model_key(instance, model)
        results.append(dg.materialize([report], instance=instance, resources={"lens": lens}, partition_key=model,
                                      raise_on_error=raise_on_error))
    if comparison:
        results.append(dg.materialize([comparison_report], instance=instance, resources={"lens": lens},
                                      raise_on_error=raise_on_error))
    return results


def materialize_sweep(model: str, lens: UpdateLensResource, instance: dg.DagsterInstance,
                      sweep_config: dict[str, object] | None = None, raise_on_error: bool = True) -> dg.ExecuteInJobResult:
    """The model's convention sweep (loads the model once, analyses every configuration)."""
    register_model_key(instance, model)
    return dg.materialize([convention_sweep], instance=instance, resources={"lens": lens}, partition_key=model,
                          run_config={"ops": {"convention_sweep": {"config": sweep_config or {}}}},
                          raise_on_error=raise_on_error)
