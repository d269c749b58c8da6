from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # several test processes share the cores: one thread each (and in the processes they start),
    # as OpenMP threads of two torch processes on the same cores spin against each other
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


REQUIRE_ALL = "UPDATELENS_REQUIRE_ALL"  # set to 1 by .ci/run: a missing tool fails its tests instead of skipping


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in case a plugin imported torch before the variable was set
        import torch

        torch.set_num_threads(1)
    config.addinivalue_line("markers", "needs_tool(names, install): the test runs one of these executables; "
                                       "skipped when none is installed, failed when UPDATELENS_REQUIRE_ALL=1")


# The longest tests (2-3 minutes each, mostly waiting on subprocesses) start first: collected late, one
# of them leaves a worker running alone at the end while the other has nothing left to take.
LONGEST_FIRST = ("test_partitions_launched_by_clicking_in_the_ui_are_followed_by_their_report",
                 "test_pipeline_on_local_cluster_equals_local_run",
                 "test_sigkill_mid_write_before_the_manifest_and_mid_replace_leave_only_verified_files")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.name not in LONGEST_FIRST)  # stable: the rest keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the test modules imported (the whole stack: about 0.75 million objects) for the
    garbage collector (gc.freeze): every full collection walked them all again, about 1 s apiece, and
    a materialization in a test process set off a dozen (test_checks.py alone: 280 s before, 163 s
    after, on 2 cores). The objects the tests make are collected as before."""
    import great_expectations  # noqa: F401 - the first check would import it, and later walks cover it

    import tests.zoo  # noqa: F401 - the tiny models' classes

    gc.freeze()


RSS_LOG = "UPDATELENS_TEST_RSS_LOG"  # a file: each test's process high-water mark (GiB) before and after it, and its CPU


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """With $UPDATELENS_TEST_RSS_LOG set, a line per test: its process's peak resident memory before and
    after it (VmHWM only grows: the test where it jumps is the one that took the memory), the CPU
    seconds it took, its subprocesses included (those it waited for), when it started (epoch seconds)
    and its wall seconds: what each test process did when."""
    from updatelens.orchestration.commands import _peak_rss_gib  # what `run` reports: VmHWM

    log = os.environ.get(RSS_LOG)
    before, cpu, start = (_peak_rss_gib(), _cpu_seconds(), time.time()) if log else (0.0, 0.0, 0.0)
    result = yield
    if log:
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {before:.3f} {_peak_rss_gib():.3f} {_cpu_seconds() - cpu:.1f} "
                      f"{start:.1f} {time.time() - start:.1f} {item.nodeid}\n")
    return result


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_tool"):
        names, install = mark.args
        if not any(shutil.which(name) for name in names):
            message = f"{' or '.join(names)} is not installed ({install})"
            if os.environ.get(REQUIRE_ALL) == "1":
                pytest.fail(f"{message}; {REQUIRE_ALL}=1 makes a missing tool a failure", pytrace=False)
            pytest.skip(message)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Registry file of the tiny GPT-2, Llama and Mamba models (built once per session)."""
    from tests.zoo import build_zoo

    return build_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def tiny_models(zoo: Path) -> dict[str, object]:
    from updatelens.models import load_model
    from updatelens.registry import load_models

    return {slug: load_model(entry) for slug, entry in load_models(zoo).items()}


@pytest.fixture(autouse=True)
def no_dagster_instance_left_current(request: pytest.FixtureRequest):
    """Each test starts with no current Dagster instance and must leave none: a test that does not
    close what entered an instance fails here, itself.

    Dagster keeps the current instance's definitions-state storage in a context variable, which
    entering an instance sets and closing it resets. A sensor or schedule evaluation context built
    on a persistent instance enters an instance of its own on first use; left unclosed, it keeps
    that instance current until the garbage collector finalizes it, at whatever moment, which then
    resets the variable out of order. A later materialize, in another test, then read a collected
    instance ('Attempted to resolve undefined DagsterInstance weakref'), depending on test order
    and collection. (The variable is private to Dagster; the tests police it, the product does not
    touch it.)"""
    from dagster._core.storage.defs_state.base import _current_storage

    token = _current_storage.set(None)
    yield
    if "pipeline" in request.node.path.parts:  # the tests that open instances: finalize what they dropped
        gc.collect()
    left = _current_storage.get()
    _current_storage.reset(token)
    assert left is None, ("the test left a Dagster instance current: close every instance and every "
                          "sensor/schedule/resource context it opens (use `with`)")
