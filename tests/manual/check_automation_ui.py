"""A check run by hand (minutes: it waits for sensor ticks), not by the suite: in the real UI
(`updatelens ui`: webserver, daemon, sensors), adding a model to the registry makes the registry
sensor add its partitions, the stage automation sensor evaluate the stages' conditions and launch
the model's run; then, after a change of the engine's code, the assets show the new code version.

    python -m tests.manual.check_automation_ui OUT_DIR

Writes OUT_DIR/automation.json (what GraphQL reported at each point) and screenshots taken with
headless Chromium: the activations asset's Automation tab and the runs list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from tests.pipeline.test_ui import screenshot
from tests.pipeline.test_webserver import REPO, free_port, graphql
from tests.zoo import build_zoo

RUNS = "{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }"
EVALUATIONS = """
{ assetConditionEvaluationRecordsOrError(assetKey: {path: ["activations"]}, limit: 5) {
    ... on AssetConditionEvaluationRecords { records { evaluationId numRequested timestamp runIds
        rootUniqueId evaluationNodes { uniqueId userLabel expandedLabel numTrue } } } } }
"""
CODE_VERSIONS = """
{ assetNodes(assetKeys: [{path: ["activations"]}, {path: ["local_fits"]}, {path: ["functional_metrics"]}]) {
    assetKey { path } opVersion staleStatus(partition: "tiny-gpt2:00")
    staleCauses(partition: "tiny-gpt2:00") { category reason } } }
"""


def wait_for(what: str, probe, timeout: float = 600.0, every: float = 5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every)
    raise TimeoutError(f"{what}: not seen within {timeout:.0f} s")


def start_ui(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """`updatelens ui` in the background, its output to `log`; returns once the webserver answers."""
    proc = subprocess.Popen([sys.executable, "-m", "updatelens.orchestration.cli", "ui", "--port", str(port)],
                            cwd=REPO, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"updatelens ui exited; see {log}")
        try:
            return bool(graphql(port, "{ version }"))
        except OSError:
            return False

    wait_for("the webserver", answers, timeout=300, every=2)
    return proc


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="automation-ui-"))
    zoo = tomllib.loads(build_zoo(work / "zoo").read_text())
    registry = work / "registry.toml"
    registry.write_text('[corpora.wiki-embedded]\nsource = "embedded"\n')
    env = dict(os.environ, DAGSTER_HOME=str(work / "home"), UPDATELENS_REGISTRY=str(registry),
               UPDATELENS_DATA=str(work / "data"), UPDATELENS_SETTINGS='{"n_seq": 6, "seq_len": 16, "k": 8, "rank": 2}')
    record: dict[str, object] = {}
    port = free_port()
    proc = start_ui(env, port, out / "ui.log")
    try:
        record["before"] = graphql(port, RUNS)["data"]["runsOrError"]["results"]
        added = time.time()
        registry.write_text(f'[models.tiny-gpt2]\nsource = "local"\npath = "{zoo["models"]["tiny-gpt2"]["path"]}"\n'
                            '[corpora.wiki-embedded]\nsource = "embedded"\n')

        def succeeded() -> list[dict]:
            runs = graphql(port, RUNS)["data"]["runsOrError"]["results"]
            return [r for r in runs if r["status"] == "SUCCESS"] if runs else []

        runs = wait_for("a successful run of the new model", succeeded)
        record["seconds_to_a_successful_run"] = round(time.time() - added, 1)
        record["runs"] = graphql(port, RUNS)["data"]["runsOrError"]["results"]
        record["evaluations"] = graphql(port, EVALUATIONS)["data"]["assetConditionEvaluationRecordsOrError"]
        record["code_versions_before"] = graphql(port, CODE_VERSIONS)["data"]["assetNodes"]
        pages = {"automation_tab.png": f"http://127.0.0.1:{port}/assets/activations?view=automation",
                 "runs.png": f"http://127.0.0.1:{port}/runs",
                 "run.png": f"http://127.0.0.1:{port}/runs/{runs[0]['runId']}"}
        for name, url in pages.items():
            screenshot(url, out / name, work / f"profile-{name}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    # a change of the engine's code: the assets' code version moves, the UI marks them
    engine = REPO / "updatelens" / "stages.py"
    original = engine.read_text()
    try:
        engine.write_text(original + "\n# a code change for the automation check\n")
        proc = start_ui(env, port, out / "ui.log")
        try:
            record["code_versions_after"] = graphql(port, CODE_VERSIONS)["data"]["assetNodes"]
            screenshot(f"http://127.0.0.1:{port}/assets/activations", out / "code_changed.png",
                       work / "profile-code")
            screenshot(f"http://127.0.0.1:{port}/assets/activations?view=partitions", out / "code_changed_partitions.png",
                       work / "profile-partitions")
            time.sleep(40)  # one more automation tick under the new code
            record["evaluations_after_code_change"] = graphql(port, EVALUATIONS)["data"][
                "assetConditionEvaluationRecordsOrError"]
            screenshot(f"http://127.0.0.1:{port}/asset-groups", out / "graph_code_changed.png", work / "profile-graph")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    finally:
        engine.write_text(original)
    (out / "automation.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k in ("seconds_to_a_successful_run",)}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
