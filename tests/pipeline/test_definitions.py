"""Snapshot of the code location: assets, lineage, partitions, jobs, resources."""

from __future__ import annotations

import dagster as dg

from orchestration.definitions import defs

LINEAGE = {
    "activations": set(),
    "local_fits": {"activations"},
    "residuals": {"local_fits"},
    "geometry": {"residuals"},
    "functional_metrics": {"geometry"},
}


def test_asset_graph_snapshot() -> None:
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == set(LINEAGE)
    for key, parents in LINEAGE.items():
        node = graph.get(dg.AssetKey(key))
        assert {p.to_user_string() for p in node.parent_keys} == parents, key
        assert isinstance(node.partitions_def, dg.DynamicPartitionsDefinition)
        assert node.partitions_def.name == "model_layer"
        assert node.group_name == "updatelens"
        assert node.backfill_policy == dg.BackfillPolicy.single_run()


def test_jobs_and_resources() -> None:
    assert defs.resolve_job_def("analyse").name == "analyse"
    lens = defs.resources["lens"]
    assert lens.config().classes == ("diagonal", "lowrank")
