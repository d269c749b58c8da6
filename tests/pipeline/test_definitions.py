"""Snapshot of the code location: assets, lineage, partitions, jobs, resources."""

from __future__ import annotations

import dagster as dg

from updatelens.orchestration.definitions import defs as load_defs

defs = load_defs()  # the code location, as Dagster's tools load it

LINEAGE = {
    "activations": set(),
    "local_fits": {"activations"},
    "residuals": {"activations", "local_fits"},  # each stage depends on the stages whose tables it reads
    "geometry": {"activations", "local_fits"},
    "functional_metrics": {"activations", "local_fits"},
    "controls": {"activations", "local_fits"},  # the positive controls reuse the real layer's neighbours
}


# per model (its slug), reading every (model, layer) partition upstream
PER_MODEL = {
    "convention_sweep": ({"activations"}, "models"),  # the stored sample it analyses
    "report": ({"geometry", "functional_metrics", "controls", "convention_sweep"}, "models"),
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
                                   "residuals": "decomposition",
                                   "controls": "calibration"}.get(key, "analysis")
        assert node.backfill_policy == dg.BackfillPolicy.single_run()


def test_jobs_and_resources() -> None:
    analyse = defs.resolve_job_def("analyse")
    assert {k.to_user_string() for k in analyse.asset_layer.selected_asset_keys} == set(LINEAGE)
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"analyse", "build_report", "build_comparison",
                                                               "sweep_conventions"}
    assert {s.name for s in defs.sensors} == {"model_registry_sensor", "stage_automation", "reports_after_analysis"}
    lens = defs.resources["lens"]
    assert lens.config().classes == ("diagonal", "lowrank")


# Where each stage's step may run: model steps on GPU workers, the others anywhere.
QUEUES = {"activations": "gpu", "local_fits": "cpu", "residuals": "cpu", "geometry": "cpu",
          "functional_metrics": "gpu", "controls": "cpu"}


def test_deployment_profiles_select_the_executor_and_route_steps(monkeypatch) -> None:
    import json

    import pytest

    from updatelens.errors import ConfigError
    from updatelens.orchestration.definitions import build_defs
    from updatelens.orchestration.deployments import active_profile
    from updatelens.orchestration.distributed import analyse_job

    expected = {"local": "multiprocess", "celery": "celery", "k8s": "k8s"}
    for name, executor in expected.items():
        job = build_defs(active_profile(name)).resolve_job_def("analyse")
        assert job.executor_def.name == executor, name
    monkeypatch.setenv("UPDATELENS_PROFILE", "celery")
    assert analyse_job().executor_def.name == "celery"  # what a worker rebuilds from its environment
    monkeypatch.setenv("UPDATELENS_PROFILE", "nosuch")
    with pytest.raises(ConfigError, match="unknown deployment profile 'nosuch'"):
        active_profile()

    job = defs.resolve_job_def("analyse")
    for step, queue in QUEUES.items():
        tags = job.graph.node_named(step).tags
        assert tags["dagster-celery/queue"] == queue, step
        resources = json.loads(tags["dagster-k8s/config"])["container_config"]["resources"]
        assert ("nvidia.com/gpu" in resources["requests"]) == (queue == "gpu"), step
    # every other asset that loads a model goes where models run too
    sweep = defs.resolve_assets_def("convention_sweep")
    assert sweep.op.tags["dagster-celery/queue"] == "gpu"


def test_automated_runs_use_the_code_locations_settings(monkeypatch) -> None:
    """What a run launched by a sensor or by automation gets: the resource's config defaults."""
    from updatelens.orchestration.definitions import build_defs
    from updatelens.orchestration.deployments import active_profile

    monkeypatch.setenv("UPDATELENS_SETTINGS", '{"n_seq": 6, "seq_len": 16}')
    lens = build_defs(active_profile()).resolve_job_def("analyse").resource_defs["lens"]
    analysis = lens.config_schema.as_field().default_value["analysis"]
    assert (analysis["n_seq"], analysis["seq_len"]) == (6, 16)


def test_the_stage_description_drives_the_assets_and_every_check_belongs_to_a_stage() -> None:
    from updatelens.assets.checks import CHECK_DEFS
    from updatelens.stages import STAGES

    graph = defs.resolve_asset_graph()
    for stage in STAGES:
        node = graph.get(dg.AssetKey(stage.name))
        assert node.group_name == stage.group and node.description == stage.description, stage.name
        checks = {k.name for k in node.check_keys}
        assert checks == set(stage.checks), stage.name
    assert {c for s in STAGES for c in s.checks} == set(CHECK_DEFS)


def test_each_stage_and_the_sweep_carry_their_own_code_version() -> None:
    """The UI's code version of an asset is the one its rows record: a stage's version, the sweep's own."""
    from updatelens.versions import stage_versions

    graph = defs.resolve_asset_graph()
    for name, version in stage_versions().items():
        assert graph.get(dg.AssetKey(name)).code_version == version, name
