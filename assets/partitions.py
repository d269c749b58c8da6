"""One dynamic partition per (model, layer), keyed `<slug>:<layer>` (layer zero-padded to 2).

Why not MultiPartitionsDefinition(model x layer)? It is a full cross product: with a 12-layer and
a 30-layer model, 18 (model, layer) keys could never be materialized. Dynamic keys are added from
each model's real depth, so every key exists. Every stage asset shares this definition (identity
mapping), each is a single-run backfill, so launching a model's key range runs one process that
loads the model and captures once for all its layers; a single key reruns one (model, layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import dagster as dg

# The run tags by which Dagster reads a run's partition or partition range (its run-tag protocol, the
# values of dagster._core.storage.tags, which the public API does not export; a test pins them).
PARTITION_NAME_TAG = "dagster/partition"
ASSET_PARTITION_RANGE_START_TAG = "dagster/asset_partition_range_start"
ASSET_PARTITION_RANGE_END_TAG = "dagster/asset_partition_range_end"

MODEL_LAYER_KEY = "model_layer"  # the partitions definitions' names (typed str, unlike their .name)
MODEL_LAYER = dg.DynamicPartitionsDefinition(name=MODEL_LAYER_KEY)
# One key per model (its slug): the per-model assets (report, convention sweep) read all its layers.
MODELS_KEY = "models"
MODELS = dg.DynamicPartitionsDefinition(name=MODELS_KEY)


def layer_key(model: str, layer: int) -> str:
    return f"{model}:{layer:02d}"


def parse_key(key: str) -> tuple[str, int]:
    model, _, layer = key.rpartition(":")
    if not model or not layer.isdigit():
        raise ValueError(f"partition key {key!r} is not of the form <model>:<layer>")
    return model, int(layer)


def model_keys(model: str, n_layers: int) -> list[str]:
    return [layer_key(model, layer) for layer in range(n_layers)]


def group_keys(keys: Iterable[str]) -> dict[str, list[int]]:
    """{model: sorted layers} for the keys of one run."""
    out: dict[str, list[int]] = {}
    for key in keys:
        model, layer = parse_key(key)
        out.setdefault(model, []).append(layer)
    return {m: sorted(set(ls)) for m, ls in out.items()}


def range_tags(keys: Sequence[str]) -> dict[str, str]:
    """Run tags that make one run over a contiguous key range (the assets are single-run backfills)."""
    return {ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}


def tagged_key_span(tags: Mapping[str, str]) -> tuple[str, str] | None:
    """The first and last partition key a run's tags name (a key range, or one key as both), or None
    for a run without partitions."""
    if ASSET_PARTITION_RANGE_START_TAG in tags:
        return tags[ASSET_PARTITION_RANGE_START_TAG], tags[ASSET_PARTITION_RANGE_END_TAG]
    if PARTITION_NAME_TAG in tags:
        return tags[PARTITION_NAME_TAG], tags[PARTITION_NAME_TAG]
    return None
