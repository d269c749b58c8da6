"""The light paths stay light: `updatelens sql`, `updatelens verify` (without repair) and the reading
of stored tables by the reports import neither torch, transformers, great-expectations nor Dagster
(a query answers in a fraction of a second where those imports take seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_findings import fixture, replicate_fixture

HEAVY = ("torch", "transformers", "great_expectations", "dagster")

RUN = """
import json, sys
{body}
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def heavy_imports(body: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `body`."""
    out = subprocess.run([sys.executable, "-c", RUN.format(body=body, heavy=HEAVY)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command, code", [(["sql", "SELECT count(*) FROM findings"], 0),
                                           (["verify"], 1)])  # the fixture's layers lack the stages' other tables
def test_sql_and_verify_import_nothing_heavy(tmp_path: Path, command: list[str], code: int) -> None:
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    body = (f"from updatelens.orchestration.cli import main\n"
            f"assert main({[command[0], '--data-root', str(tmp_path), *command[1:]]!r}) == {code}")
    assert heavy_imports(body) == []


def test_the_catalog_and_the_report_builders_import_nothing_heavy() -> None:
    assert heavy_imports("import updatelens.storage.catalog, updatelens.reports.build") == []


def test_importing_the_package_hashes_no_source() -> None:
    """The code version is computed when first asked for, not on `import updatelens`."""
    body = ("import updatelens\nassert 'CODE_VERSION' not in vars(updatelens)\n"
            "from updatelens import CODE_VERSION\nassert CODE_VERSION.startswith(updatelens.__version__ + '+')")
    assert heavy_imports(body) == []


def test_the_check_would_see_a_heavy_import() -> None:
    """The positive control of the tests above: importing the engine's capture pulls in torch."""
    assert "torch" in heavy_imports("import updatelens.capture")


LONG_QUERY = "SELECT count(*) FROM range(1000000000000) a"


def test_a_query_past_its_timeout_or_interrupted_ends_in_one_line(tmp_path: Path) -> None:
    """`--timeout` stops a long query; Ctrl-C (SIGINT) during one ends it too; either way one line on
    stderr, no traceback."""
    import signal
    import time

    fixture(tmp_path)
    command = [sys.executable, "-m", "updatelens.orchestration.cli", "sql", "--data-root", str(tmp_path)]
    start = time.perf_counter()
    done = subprocess.run([*command, "--timeout", "1", LONG_QUERY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.perf_counter() - start < 60
    assert done.stderr.strip() == "updatelens sql: the query ran past its limit of 1 s and was stopped", done.stderr
    subprocess.run([*command, "SELECT 1"], check=True, capture_output=True)  # the catalog is built: the next starts fast
    # SIGINT as a terminal delivers it: a runner that started this suite in the background may have set it
    # to be ignored, and a test worker's thread may block it; the child would inherit either
    def as_from_a_terminal() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([*command, LONG_QUERY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    time.sleep(3)
    for _ in range(10):  # a Ctrl-C that lands while DuckDB verifies the catalog can be absorbed: press again
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        proc.kill()
        raise AssertionError("the query did not stop on SIGINT")
    assert proc.returncode == 130 and err.strip() == "updatelens sql: interrupted; nothing was written", err


@pytest.mark.parametrize("limit", ["nan", "-1", "0", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_in_one_line(limit: str, capsys: pytest.CaptureFixture) -> None:
    from updatelens.orchestration.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["sql", "--data-root", "nowhere", "--timeout", limit, "SELECT 1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --timeout" in err and ("positive number of seconds" in err or "not a number" in err), err
