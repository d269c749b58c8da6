"""The verdict rule is declared once (updatelens.verdicts): its Python evaluation and its SQL rendering
give the same word for every combination of outcomes, and the rule says what the issue asks of it."""

from __future__ import annotations

import itertools

import duckdb
import pytest

from updatelens.verdicts import (
    CONTROL,
    CONTROL_WORDS,
    NULL,
    NULL_WORDS,
    ROLES,
    THRESHOLD,
    difference_outcome,
    difference_outcome_sql,
    threshold_outcome,
    threshold_outcome_sql,
    verdict,
    verdict_sql,
)

COMBINATIONS = list(itertools.product(THRESHOLD, NULL, ROLES, THRESHOLD, CONTROL))


def _sql_verdicts(rows: list[tuple[str | None, ...]]) -> list[str | None]:
    con = duckdb.connect()
    con.execute("CREATE TABLE o (i INTEGER, threshold_outcome VARCHAR, null_outcome VARCHAR, control_role VARCHAR, "
                "control_threshold_outcome VARCHAR, control_outcome VARCHAR)")
    con.executemany("INSERT INTO o VALUES (?, ?, ?, ?, ?, ?)", [(i, *row) for i, row in enumerate(rows)])
    return [r[0] for r in con.execute(f"SELECT {verdict_sql()} FROM o ORDER BY i").fetchall()]


def test_python_and_sql_give_the_same_verdict_for_every_combination_of_outcomes() -> None:
    assert len(COMBINATIONS) == 4 * 4 * 4 * 4 * 4
    python = [verdict(*row) for row in COMBINATIONS]
    assert _sql_verdicts(COMBINATIONS) == python
    assert set(python) == {None, "holds", "fails", "undecided", "indistinct", "estimator-limited", "no control",
                           "opposite"}


@pytest.mark.parametrize(("outcomes", "expected"), [
    # the value clears and is beyond its null: holds, whatever the control says (its miss is shown beside it)
    (("clears", "beyond", "positive", "misses", "below control"), "holds"),
    (("clears", "beyond", "positive", None, None), "holds"),
    (("clears", "beyond", "floor", "clears", "same"), "holds"),
    # it does not clear, and neither does the tokenwise control: the estimator cannot show it
    (("misses", "indistinct", "positive", "misses", "same"), "estimator-limited"),
    (("straddles", "beyond", "positive", "straddles", "beyond control"), "estimator-limited"),
    (("misses", "opposite", "positive", "misses", "below control"), "estimator-limited"),
    # it misses and the control clears and separates: the estimator could have shown it
    (("misses", "indistinct", "positive", "clears", "below control"), "fails"),
    (("misses", "beyond", "floor", "misses", "below control"), "fails"),
    # a floor finding that cannot be told from the estimator's own error
    (("misses", "beyond", "floor", "clears", "same"), "estimator-limited"),
    # no control where the verdict needs one
    (("misses", "indistinct", "positive", None, None), "no control"),
    (("straddles", "beyond", "floor", None, None), "no control"),
    # the findings without a control role are judged by threshold and null alone
    (("misses", "indistinct", "none", None, None), "fails"),
    (("misses", "opposite", "reference", None, None), "opposite"),
    (("clears", "opposite", "none", None, None), "opposite"),
    (("clears", "indistinct", "positive", "clears", "same"), "indistinct"),
    (("straddles", "indistinct", "none", None, None), "undecided"),
    (("clears", None, "none", None, None), "undecided"),
    ((None, "beyond", "positive", "clears", "same"), None),
])
def test_the_rule(outcomes: tuple[str | None, ...], expected: str | None) -> None:
    assert verdict(*outcomes) == expected  # type: ignore[arg-type]
    assert _sql_verdicts([outcomes]) == [expected]


def test_an_outcome_outside_its_domain_is_refused() -> None:
    with pytest.raises(ValueError, match="control_outcome"):
        verdict("clears", "beyond", "positive", "clears", "separates")


INTERVALS = [(lo, hi) for lo in (None, -1.0, 0.0, 0.5, 0.9, 1.0) for hi in (None, -0.5, 0.0, 0.5, 0.9, 1.5)
             if lo is None or hi is None or lo <= hi]


def test_the_outcomes_in_python_and_sql_agree_on_planted_intervals() -> None:
    con = duckdb.connect()
    for op, bound in ((">=", 0.9), ("<=", 0.5), (">=", 0.0)):
        for lo, hi in INTERVALS:
            row = con.execute(
                f"SELECT {threshold_outcome_sql('op', 'bound', 'lo', 'hi')}, "
                f"{difference_outcome_sql('op', 'lo', 'hi', NULL_WORDS)}, "
                f"{difference_outcome_sql('op', 'lo', 'hi', CONTROL_WORDS)} "
                "FROM (SELECT ?::VARCHAR AS op, ?::DOUBLE AS bound, ?::DOUBLE AS lo, ?::DOUBLE AS hi)",
                [op, bound, lo, hi]).fetchone()
            assert row == (threshold_outcome(op, bound, lo, hi), difference_outcome(op, lo, hi, NULL_WORDS),
                           difference_outcome(op, lo, hi, CONTROL_WORDS)), (op, bound, lo, hi)
    assert threshold_outcome("<=", 0.25, 0.1, 0.2) == "clears" and threshold_outcome(">=", 0.9, 0.5, 0.8) == "misses"
    assert difference_outcome("<=", -0.3, -0.1, CONTROL_WORDS) == "beyond control"  # smaller is the claim's side
    assert difference_outcome(">=", -0.3, -0.1, CONTROL_WORDS) == "below control"
