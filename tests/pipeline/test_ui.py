"""The UI: `updatelens ui` starts from the repo root with a project-local DAGSTER_HOME and stops on
SIGTERM; headless Chromium renders the asset graph and a partitions page (screenshots saved)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from tests.pipeline.test_webserver import REPO, free_port, graphql, start_webserver, wait_ready
from updatelens.assets.partitions import model_keys
from updatelens.orchestration.commands import location_name
from updatelens.orchestration.runner import dagster_yaml

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = Path(os.environ.get("UPDATELENS_SCREENSHOTS", REPO / "data" / "ui-screenshots"))


def test_updatelens_ui_starts_and_stops_on_sigterm(tmp_path: Path) -> None:
    home = tmp_path / "home"
    registry = tmp_path / "registry.toml"
    registry.write_text('[corpora.wiki-embedded]\nsource = "embedded"\n')  # no model: the sensor stays idle
    port = free_port()
    env = dict(os.environ, DAGSTER_HOME=str(home), UPDATELENS_REGISTRY=str(registry),
               UPDATELENS_DATA=str(tmp_path / "data"))
    proc = subprocess.Popen([sys.executable, "-m", "updatelens.orchestration.cli", "ui", "--port", str(port)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, port, timeout=180)
        names = {n["assetKey"]["path"][0] for n in graphql(port, "{ assetNodes { assetKey { path } } }")["data"]["assetNodes"]}
        assert "functional_metrics" in names
        # the code location is named after the data root the UI serves
        entries = graphql(port, "{ workspaceOrError { ... on Workspace { locationEntries { name } } } }")
        assert [e["name"] for e in entries["data"]["workspaceOrError"]["locationEntries"]] == \
            [location_name(tmp_path / "data")]
        assert "enabled: false" in (home / "dagster.yaml").read_text()  # telemetry and nux off
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("updatelens ui did not stop on SIGTERM within 60 s")
    deadline = time.time() + 30  # dagster dev's children (webserver, daemon, code server) follow it
    while time.time() < deadline:
        leftover = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        if not leftover.strip():
            break
        time.sleep(0.5)
    assert not leftover.strip(), f"processes still running 30 s after SIGTERM:\n{leftover}"


def screenshot(url: str, out: Path, profile: Path) -> None:
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                    f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--window-size=1400,900",
                    f"--screenshot={out}", url], check=True, timeout=120, capture_output=True)


@pytest.mark.needs_tool(("chromium", "chromium-browser"), "apt-get install chromium")
def test_asset_graph_and_partitions_pages_render_in_chromium(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(dagster_yaml(1))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("model_layer", model_keys("smollm2-135m", 30))
    port = free_port()
    proc = start_webserver(home, port)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        wait_ready(proc, port)
        pages = {"asset_graph.png": f"http://127.0.0.1:{port}/asset-groups",
                 "partitions.png": f"http://127.0.0.1:{port}/assets/local_fits?view=partitions"}
        for name, url in pages.items():
            screenshot(url, SCREENSHOTS / name, tmp_path / f"profile-{name}")
            size = (SCREENSHOTS / name).stat().st_size
            assert size > 20_000, f"{name} is {size} bytes: a blank page?"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
