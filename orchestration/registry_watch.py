"""What the sensor and the schedule decide, as plain functions (easy to test, no Dagster context).

- `registry_changes`: which models are new (or changed source) since the cursor, which were removed.
- `stale_stages`, `stale_plan`: which stages of which (model, layer) partitions are
  missing, damaged, or were made by another configuration or another code version of their stage
  than the current one (and the stages that read them), judged from each table's manifest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from updatelens.registry import ModelEntry, load_models
from updatelens.stages import STAGES, with_readers
from updatelens.storage.integrity import partition_error, read_manifest
from updatelens.storage.layout import PART_FILE, partition_dir, partition_file
from updatelens.storage.location import RootLike


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




def stale_stages(root: RootLike, model: str, layer: int, config_id: str, versions: dict[str, str],
                 revision: str | None = None) -> list[str]:
    """The stages of a (model, layer) to recompute, in the stages' order: those with a table that is
    absent, does not verify against its manifest (a partition deleted or damaged, or a stray file
    beside it: see storage.integrity), holds no rows where the stage always writes some, or was written
    under another configuration or another code version of the stage (`updatelens.versions`) or, with
    `revision` (models.recorded_revision), from other weights, and every stage that reads their
    tables. A layer a run with other settings left half-written is stale from its first stage of those
    settings on."""
    stale: set[str] = set()
    for stage in STAGES:
        has_rows = False
        for table in stage.tables:
            folder = partition_dir(root, table, model, layer)
            # every file of the folder counts: one its manifest does not list (a stray copy) makes it stale
            files = [partition_file(root, table, model, layer),
                     *(f for f in folder.glob("*.parquet") if f.name != PART_FILE)]
            entry = read_manifest(files[0])
            if entry is None or any(partition_error(file) is not None for file in files):
                stale.add(stage.name)
                break
            if entry.get("rows"):
                has_rows = True
                if ((entry.get("config_id"), entry.get("code_version")) != (config_id, versions[stage.name])
                        or (revision is not None and entry.get("model_revision") != revision)):
                    stale.add(stage.name)
                    break
        else:
            if not has_rows and not stage.may_be_empty:
                stale.add(stage.name)
    return with_readers(stale)


def stale_plan(root: RootLike, model: str, layers: list[int], config_id: str, versions: dict[str, str],
               revision: str | None = None) -> dict[int, list[str]]:
    """{layer: its stale stages} for the layers with any."""
    plan = {layer: stale_stages(root, model, layer, config_id, versions, revision) for layer in layers}
    return {layer: stages for layer, stages in plan.items() if stages}

