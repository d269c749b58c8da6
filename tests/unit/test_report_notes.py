"""The model report names what a missing or damaged partition leaves out, for every stored table."""

from __future__ import annotations

from updatelens.reports.build import LEFT_OUT
from updatelens.stages import TABLES


def test_every_stored_table_says_what_its_loss_leaves_out_of_the_report() -> None:
    assert set(LEFT_OUT) == set(TABLES)
