"""The code location loads in the real webserver (via workspace.yaml) and its GraphQL API shows
the assets, their (model, layer) partitions and their checks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

from updatelens.assets.partitions import model_keys
from updatelens.orchestration.runner import DAGSTER_YAML

REPO = Path(__file__).resolve().parents[2]
QUERY = """
{ assetNodes { assetKey { path } partitionDefinition { type name } partitionKeys
  assetChecksOrError { ... on AssetChecks { checks { name } } } } }
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def group_left(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """What still runs in the process group `proc` leads, after waiting up to `timeout` s for it to
    empty (pgrep's lines; '' when nothing is left)."""
    deadline = time.time() + timeout
    while (left := subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True,
                                  text=True).stdout.strip()) and time.time() < deadline:
        time.sleep(0.5)
    return left


def kill_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGKILL whatever runs of the process group `proc` leads (a test's cleanup), then reap `proc`."""
    if proc.poll() is None or subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout)


def start_webserver(home: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, DAGSTER_HOME=str(home), HF_HUB_OFFLINE="1", UPDATELENS_DATA=str(home / "data"))
    return subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-w", "workspace.yaml", "-h", "127.0.0.1",
                             "-p", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"webserver exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("webserver did not answer in time")


@pytest.fixture(scope="module")
def webserver(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("dagster_home")
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("model_layer", model_keys("smollm2-135m", 30))
    port = free_port()
    proc = start_webserver(home, port)
    try:
        wait_ready(proc, port)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_assets_partitions_and_checks_appear_in_graphql(webserver: int) -> None:
    nodes = {tuple(n["assetKey"]["path"]): n for n in graphql(webserver, QUERY)["data"]["assetNodes"]}
    per_model = {("report",), ("convention_sweep",), ("comparison_report",)}
    assert set(nodes) == {("activations",), ("local_fits",), ("residuals",), ("geometry",), ("controls",),
                          ("functional_metrics",),
                          *per_model}
    assert nodes[("report",)]["partitionDefinition"] == {"type": "DYNAMIC", "name": "models"}
    assert [c["name"] for c in nodes[("report",)]["assetChecksOrError"]["checks"]] == ["report_complete"]
    nodes = {key: node for key, node in nodes.items() if key not in per_model}
    for node in nodes.values():
        assert node["partitionDefinition"] == {"type": "DYNAMIC", "name": "model_layer"}
        assert node["partitionKeys"] == model_keys("smollm2-135m", 30)
    checks = {name: {c["name"] for c in n["assetChecksOrError"]["checks"]} for (name,), n in nodes.items()}
    assert all(checks.values()), checks
