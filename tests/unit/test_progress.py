"""Progress of long work: a bar on a terminal, and log lines an orchestrator captures."""

from __future__ import annotations

import logging

import pytest

from updatelens import progress as progress_module
from updatelens.assets.common import engine_logs
from updatelens.progress import progress


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "updatelens"]


def test_long_work_logs_every_step_with_rate_and_time_left(caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "QUIET_S", 0.0)
    monkeypatch.setenv("UPDATELENS_PROGRESS", "off")
    with caplog.at_level(logging.INFO, logger="updatelens"), progress("layer 3: fit lowrank", 100, "anchor",
                                                                      log_every=0.25) as bar:
        for _ in range(10):
            bar.update(10)
    logged = lines(caplog)
    assert [line.split(": ", 2)[2].split(" ", 1)[0] for line in logged] == ["30/100", "50/100", "80/100", "100/100"]
    assert "anchor/s, time left" in logged[0] and "(30%)" in logged[0]
    assert "(100%)" in logged[-1] and "done in" in logged[-1]


def test_short_work_logs_only_its_final_line(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPDATELENS_PROGRESS", "off")
    with caplog.at_level(logging.INFO, logger="updatelens"), progress("capture", 8, "seq") as bar:
        for _ in range(8):
            bar.update(1)
    assert len(lines(caplog)) == 1 and lines(caplog)[0].startswith("capture: 8/8 seq (100%)")


def test_a_bar_is_drawn_when_asked(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPDATELENS_PROGRESS", "bar")
    with progress("patched passes", 4, "seq") as bar:
        bar.update(4)
    assert "patched passes" in capsys.readouterr().err


def test_engine_logs_reach_the_dagster_step_log() -> None:
    seen: list[tuple[str, str]] = []

    class StepLog:
        def info(self, message: str) -> None:
            seen.append(("info", message))

        def warning(self, message: str) -> None:
            seen.append(("warning", message))

    engine = logging.getLogger("updatelens")
    with engine_logs(StepLog()):  # type: ignore[arg-type]
        engine.info("capture: 8/8 seq")
        engine.warning("slow")
        engine.debug("not shown")
    engine.info("after the step")
    assert seen == [("info", "capture: 8/8 seq"), ("warning", "slow")]


def test_tty_mode_draws_on_the_terminal_and_closes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    class Terminal(io.StringIO):
        def close(self) -> None:
            self.seen = self.getvalue()
            super().close()

    terminal = Terminal()
    monkeypatch.setenv("UPDATELENS_PROGRESS", "tty")
    monkeypatch.setattr(progress_module, "_open_tty", lambda: terminal)
    with progress("capture", 4, "seq") as bar:
        bar.update(4)
    assert "capture" in terminal.seen and terminal.closed
    monkeypatch.setattr(progress_module, "_open_tty", lambda: None)  # no controlling terminal: no bar
    with progress("capture", 4, "seq") as bar:
        bar.update(4)
