"""The stage skeleton (assets.common.StageRun): a step fails, naming the check, where a check its stage
declares judged no partition the step wrote, or where the body judges a check its stage does not declare."""

from __future__ import annotations

from typing import Any, cast

import pytest

from updatelens.assets.common import StageRun
from updatelens.assets.expectations import Verdict
from updatelens.stages import BY_NAME


def residuals_run() -> StageRun:
    """A residuals step that wrote layers 1 and 2 of model m (no Dagster, no root: the check comes first)."""
    stage = BY_NAME["residuals"]
    none = cast(Any, None)
    run = StageRun(none, none, stage, none, none, verdicts={name: {} for name in stage.checks})
    for layer in (1, 2):
        run.written.note("m", layer, rows_residuals=10)
    return run


def test_a_declared_check_left_unjudged_fails_the_step_naming_it() -> None:
    run = residuals_run()
    for check in ("residuals_match_fits", "rel_err_within_bounds", "no_blown_up_fits"):
        for layer in (1, 2):
            run.judge(check, "m", layer, Verdict())
    run.judge("rel_err_drift", "m", 1, Verdict())  # layer 2 forgotten
    with pytest.raises(RuntimeError, match="stage residuals: check rel_err_drift has no verdict on m:02"):
        run.finish()


def test_a_check_the_stage_does_not_declare_is_refused() -> None:
    with pytest.raises(KeyError, match="'geometry_ranges' is not a check of stage residuals"):
        residuals_run().judge("geometry_ranges", "m", 1, Verdict())
