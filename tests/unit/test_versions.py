"""Staleness per stage: each stage's code version covers its asset module and the engine code that
module imports, and the versions of the stages it reads; nothing else (updatelens.versions).

Each test changes a copy of the sources and compares the versions computed from it with the real ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from updatelens import _mapped_dir
from updatelens.stages import BY_NAME, STAGE_NAMES, with_readers
from updatelens.versions import (
    ENGINE,
    SWEEP_ASSET,
    compute_versions,
    engine_file,
    imported_modules,
    stage_sources,
    stage_versions,
)

ALL_READERS_OF_FITS = ["local_fits", "residuals", "geometry", "controls", "functional_metrics"]


@pytest.fixture(scope="module")
def baseline() -> dict[str, str]:
    return compute_versions()


def changed(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The versions of a copy of the engine and the assets with `edits` ({path: (old, new)}; paths
    under updatelens/, assets/, reports/, storage/ or orchestration/; an empty `old` appends) made."""
    for name, source in (("updatelens", ENGINE), *((n, _mapped_dir(n)) for n in ("assets", "storage", "reports",
                                                                                    "orchestration"))):
        shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for path, (old, new) in edits.items():
        file = tmp_path / path
        text = file.read_text()
        assert old in text, f"{old!r} not in {path}"
        file.write_text(text.replace(old, new, 1) if old else text + new)  # no `old`: `new` appended
    return compute_versions(tmp_path / "updatelens", tmp_path / "assets")


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [stage for stage in STAGE_NAMES if a[stage] != b[stage]]


def test_the_versions_in_use_are_the_computed_ones(baseline: dict[str, str]) -> None:
    assert stage_versions() == baseline
    assert len(set(baseline.values())) == len(STAGE_NAMES) + 1  # every stage its own, and the sweep


def test_a_docstring_or_a_comment_changes_no_stage(tmp_path: Path, baseline: dict[str, str]) -> None:
    now = changed(tmp_path, {
        "updatelens/geometry.py": ('"""', '"""A fixed typo. '),
        "updatelens/fits/lowrank.py": ("\n", "\n# a comment\n"),
        "updatelens/steps/functional_metrics.py": ('"""', '"""Reworded. '),
        "updatelens/config.py": ('help="neighbours of each local fit"', 'help="the neighbours of each local fit"'),
    })
    assert differing(baseline, now) == []


def test_reports_the_command_line_orchestration_storage_and_the_assets_wiring_change_no_stage(
        tmp_path: Path, baseline: dict[str, str]) -> None:
    now = changed(tmp_path, {
        "reports/build.py": ("", "\nREPORT_CHANGED = 1\n"),
        "orchestration/cli.py": ("", "\nCLI_CHANGED = 1\n"),
        "storage/catalog.py": ("", "\nCATALOG_CHANGED = 1\n"),
        "assets/common.py": ("", "\nWIRING_CHANGED = 1\n"),
    })
    assert differing(baseline, now) == []


def test_a_change_to_the_geometry_code_makes_geometry_and_its_controls_stale_and_nothing_upstream(
        tmp_path: Path, baseline: dict[str, str]) -> None:
    """steps/geometry.py is the geometry stage's, and the positive controls are measured by the same code."""
    now = changed(tmp_path, {"updatelens/steps/geometry.py": ("NULL_M = 16", "NULL_M = 17")})
    assert differing(baseline, now) == ["geometry", "controls"]


def test_a_change_to_the_output_perturbation_makes_only_the_functional_metrics_stale(
        tmp_path: Path, baseline: dict[str, str]) -> None:
    now = changed(tmp_path, {"updatelens/perturbation.py": ("", "\nPERTURBATION_CHANGED = 1\n")})
    assert differing(baseline, now) == ["functional_metrics"]


def test_a_change_to_the_fits_makes_the_fits_and_every_stage_that_reads_them_stale(
        tmp_path: Path, baseline: dict[str, str]) -> None:
    now = changed(tmp_path, {"updatelens/fits/lowrank.py": ("", "\nLOWRANK_CHANGED = 1\n")})
    assert differing(baseline, now) == ALL_READERS_OF_FITS


def test_a_changed_default_in_the_configuration_makes_everything_stale(tmp_path: Path, baseline: dict[str, str]) -> None:
    """The help text of a setting is not code; its default, minimum or choices are."""
    now = changed(tmp_path, {"updatelens/config.py": ("setting(64, minimum=1,", "setting(64, minimum=2,")})
    assert differing(baseline, now) == list(STAGE_NAMES)


def test_a_change_to_the_capture_makes_everything_stale(tmp_path: Path, baseline: dict[str, str]) -> None:
    now = changed(tmp_path, {"updatelens/capture.py": ("", "\nCAPTURE_CHANGED = 1\n")})
    assert differing(baseline, now) == list(STAGE_NAMES)


def test_imports_anywhere_in_a_module_count_and_names_that_are_not_modules_are_left() -> None:
    source = b"""
import numpy
from updatelens.config import AnalysisConfig
def f():
    from updatelens import perturbation
    import updatelens.capture
from updatelens.storage.layout import read_file
"""
    names = imported_modules(source)
    files = {p.relative_to(ENGINE).as_posix() for n in names if (p := engine_file(n)) is not None}
    assert files == {"config.py", "perturbation.py", "capture.py"}  # storage is mapped: not followed


def test_the_functional_stage_holds_the_perturbation_code_and_not_the_geometry_stage() -> None:
    functional = {p.relative_to(ENGINE).as_posix() for p in stage_sources(BY_NAME["functional_metrics"])
                  if p.is_relative_to(ENGINE)}
    assert {"perturbation.py", "single_position.py", "steps/functional_metrics.py"} <= functional
    assert "steps/geometry.py" not in functional


def test_readers_follow_the_stages_declared_reads() -> None:
    assert with_readers({"geometry"}) == ["geometry"]
    assert with_readers({"local_fits"}) == ALL_READERS_OF_FITS
    assert with_readers({"activations"}) == list(STAGE_NAMES)
    assert with_readers(set()) == []


def test_the_sweeps_version_follows_its_own_code_and_the_stage_code_it_runs(tmp_path: Path, baseline: dict[str, str]) -> None:
    """The convention sweep's Dagster code version: its module and the engine code it runs, not wiring or prose."""
    prose = changed(tmp_path / "prose", {"assets/sweep.py": ('"""', '"""Reworded. '),
                                         "reports/build.py": ("", "\nREPORT_CHANGED = 1\n")})
    assert prose == baseline
    own = changed(tmp_path / "own", {"assets/sweep.py": ("", "\nSWEEP_CHANGED = 1\n")})
    assert differing(baseline, own) == [] and own[SWEEP_ASSET] != baseline[SWEEP_ASSET]
    geometry = changed(tmp_path / "geometry", {"updatelens/steps/geometry.py": ("NULL_M = 16", "NULL_M = 17")})
    assert geometry[SWEEP_ASSET] != baseline[SWEEP_ASSET]
