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


# per model (its slug), reading every (model, layer) partition upstream
PER_MODEL = {
    "convention_sweep": (set(), "models"),
    "report": ({"functional_metrics", "convention_sweep"}, "models"),
    "comparison_report": ({"report"}, None),
}


def test_asset_graph_snapshot() -> None:
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == set(LINEAGE) | set(PER_MODEL)
    for key, (parents, partitions) in PER_MODEL.items():
        node = graph.get(dg.AssetKey(key))
        assert {p.to_user_string() for p in node.parent_keys} == parents, key
        assert node.group_name == "reports"
        assert (node.partitions_def.name if node.partitions_def else None) == partitions, key
    for key, parents in LINEAGE.items():
        node = graph.get(dg.AssetKey(key))
        assert {p.to_user_string() for p in node.parent_keys} == parents, key
        assert isinstance(node.partitions_def, dg.DynamicPartitionsDefinition)
        assert node.partitions_def.name == "model_layer"
        assert node.group_name == {"activations": "capture", "local_fits": "decomposition",
                                   "residuals": "decomposition"}.get(key, "analysis")
        assert node.backfill_policy == dg.BackfillPolicy.single_run()


def test_jobs_and_resources() -> None:
    analyse = defs.resolve_job_def("analyse")
    assert {k.to_user_string() for k in analyse.asset_layer.selected_asset_keys} == set(LINEAGE)
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"analyse", "build_report", "build_comparison",
                                                               "sweep_conventions"}
    assert {s.name for s in defs.sensors} == {"model_registry_sensor", "reports_after_analysis"}
    lens = defs.resources["lens"]
    assert lens.config().classes == ("diagonal", "lowrank")
