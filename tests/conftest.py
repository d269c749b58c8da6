from __future__ import annotations

import os
import shutil
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
def isolated_dagster_instance_context():
    """Dagster keeps the 'current' instance's definitions-state storage in a context variable. Some
    sequences of instance_for_test / materialize leave it pointing at a disposed instance (seen:
    the schedule test, then the pool test, then any defs.resolve_* call fails with 'undefined
    DagsterInstance weakref'). Each test starts and ends with no current instance."""
    from dagster._core.storage.defs_state.base import _current_storage

    token = _current_storage.set(None)
    yield
    _current_storage.reset(token)
