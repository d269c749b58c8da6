"""What the sensor and the schedule decide, as plain functions (easy to test, no Dagster context).

- `registry_changes`: which models are new (or changed source) since the cursor, which were removed.
- `stale_keys`: which (model, layer) partitions are missing, or were made by another code version
  or configuration than the current one, judged from the last stage's stored rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from updatelens.assets.partitions import model_keys
from updatelens.registry import ModelEntry, load_models
from updatelens.stages import LAST_TABLE, TABLES
from updatelens.storage.integrity import layer_runs, partition_error
from updatelens.storage.layout import PART_FILE, partition_dir, partition_file, read_file


def fingerprint(entry: ModelEntry) -> str:
    """The entry as the sensor tracks it: its source, and whether it opts in to running unasked (so
    turning auto_run on is a change the sensor acts on)."""
    return hashlib.sha1(f"{entry.describe()}|auto_run={entry.auto_run}".encode()).hexdigest()[:12]


@dataclass
class RegistryChanges:
    added: list[ModelEntry]  # new slugs, or a slug whose source changed
    removed: list[str]
    cursor: str  # JSON {slug: fingerprint} of the registry as now seen


def registry_changes(registry: Path, cursor: str | None) -> RegistryChanges:
    seen: dict[str, str] = json.loads(cursor) if cursor else {}
    models = load_models(registry)
    now = {slug: fingerprint(entry) for slug, entry in models.items()}
    added = [models[s] for s in sorted(now) if seen.get(s) != now[s]]
    removed = sorted(set(seen) - set(now))
    return RegistryChanges(added=added, removed=removed, cursor=json.dumps(now, sort_keys=True))




def partition_state(root: Path, model: str, layer: int) -> tuple[str, str] | None:
    """(config_id, code_version) of a stored partition of the last stage; None if it or any other
    table of the (model, layer) is absent or does not verify against its manifest (a partition
    deleted or damaged upstream makes the layer stale: see storage.integrity), or if the tables
    were written under different configurations or code versions (a run that stopped midway)."""
    path = partition_file(root, LAST_TABLE, model, layer)
    for table in TABLES:
        folder = partition_dir(root, table, model, layer)
        # every file of the folder counts: one its manifest does not list (a stray copy) makes it stale
        files = [partition_file(root, table, model, layer), *(f for f in folder.glob("*.parquet") if f.name != PART_FILE)]
        if any(partition_error(file) is not None for file in files):
            return None
    if len(layer_runs(root, model, layer, TABLES)) > 1:  # tables of another run's settings: not one result
        return None
    table = read_file(path).select(["config_id", "code_version"])
    if len(table) == 0:
        return None
    return table["config_id"][0].as_py(), table["code_version"][0].as_py()


def stale_keys(root: Path, model: str, n_layers: int, config_id: str, code_version: str) -> list[str]:
    keys = model_keys(model, n_layers)
    return [key for layer, key in enumerate(keys)
            if partition_state(root, model, layer) != (config_id, code_version)]
