"""The reports' figures drawn in two processes: the same files as one process writes, and a failure in
the forked child (an error, or the child killed) neither loses a figure nor hides the error."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.artist import Artist
from matplotlib.figure import Figure

from updatelens.reports.pngs import save_pngs


def _figures(folder: Path, n: int = 4) -> dict[Path, Figure]:
    rng = np.random.default_rng(0)
    figures = {}
    for i in range(n):
        fig, axes = plt.subplots(1, i + 1, figsize=(3 + i, 2))
        for ax in np.atleast_1d(axes):
            ax.plot(rng.normal(size=50).cumsum())
            ax.set_yscale("log" if i % 2 else "linear")
            ax.set_title(f"figure {i}")
        figures[folder / f"f{i}.png"] = fig
    return figures


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


class _Failing(Artist):
    """Raises when drawn, or kills the process drawing it where that is not `survivor` (the forked child)."""

    def __init__(self, survivor: int | None = None) -> None:
        super().__init__()
        self.survivor = survivor

    def draw(self, renderer: object) -> None:
        if self.survivor is None:
            raise RuntimeError("this figure cannot be drawn")
        if os.getpid() != self.survivor:
            os.kill(os.getpid(), signal.SIGKILL)


def test_two_processes_write_the_files_one_process_writes(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    save_pngs(_figures(one), parallel=False)
    figures = _figures(two)
    save_pngs(figures, parallel=True)
    assert len(_bytes(one)) == 4
    assert _bytes(one) == _bytes(two)
    assert not any(plt.fignum_exists(f.number) for f in figures.values())  # every figure closed


def test_a_child_killed_midway_loses_no_figure(tmp_path: Path) -> None:
    """Every figure kills the child that draws it: this process draws whatever the child took, again."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    save_pngs(_figures(one), parallel=False)
    figures = _figures(two)
    for fig in figures.values():
        fig.axes[0].add_artist(_Failing(survivor=os.getpid()))
    save_pngs(figures, parallel=True)
    assert _bytes(two) == _bytes(one)
    assert not any(plt.fignum_exists(f.number) for f in figures.values())


def test_a_figure_that_cannot_be_drawn_raises_here(tmp_path: Path) -> None:
    """Whichever process takes the failing figure, the error reaches the caller."""
    for last in (False, True):
        figures = _figures(tmp_path)
        failing = list(figures.values())[-1 if last else 0]
        failing.axes[0].add_artist(_Failing())
        with pytest.raises(RuntimeError, match="cannot be drawn"):
            save_pngs(figures, parallel=True)
        plt.close("all")
