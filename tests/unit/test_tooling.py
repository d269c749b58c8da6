"""The suite's own guard: a test that needs an executable skips without it, and fails under CI's
UPDATELENS_REQUIRE_ALL=1 (so CI cannot go green with the browser or cluster test skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NEEDS_MISSING = """
import pytest

@pytest.mark.needs_tool(("no-such-tool-updatelens",), "nothing installs it")
def test_uses_the_tool():
    pass
"""


@pytest.mark.parametrize("required, outcome", [("", "1 skipped"), ("1", "1 error")])  # an error fails the run
def test_a_missing_tool_skips_or_fails_under_require_all(tmp_path: Path, required: str, outcome: str) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_runtest_setup\n")
    (tmp_path / "test_needs.py").write_text(NEEDS_MISSING)
    env = {**os.environ, "PYTHONPATH": str(REPO), "UPDATELENS_REQUIRE_ALL": required}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert outcome in run.stdout, run.stdout + run.stderr
    assert (run.returncode != 0) == bool(required)
    if required:
        assert "no-such-tool-updatelens is not installed" in run.stdout and "UPDATELENS_REQUIRE_ALL=1" in run.stdout


PLANTED = """from updatelens.storage.location import as_root

ROOT = as_root({argument})
"""


@pytest.mark.parametrize("argument, fails", [("42", True), ("'data'", False)])
def test_lint_checks_types_across_the_folders(tmp_path: Path, argument: str, fails: bool) -> None:
    """`make lint`'s type check reads the folders as the installed package: a module of reports/ that
    calls storage/ with a wrong type fails it, naming the repository's path; the right type passes."""
    from tests.typecheck import check

    done = check(tree=tmp_path / "tree", planted={"reports/planted.py": PLANTED.format(argument=argument)},
                 targets=("updatelens/reports/planted.py",))
    assert (done.returncode != 0) == fails, done.stdout
    if fails:
        assert 'reports/planted.py:3: error: Argument 1 to "as_root" has incompatible type "int"' in done.stdout
