"""The verdict rule, declared once: where a finding's intervals lie (against its threshold, its null
and its positive control) and the word that follows. The same declaration is evaluated in Python
(`verdict`, `threshold_outcome`, ...; the calibration study and the tests call them) and rendered to
SQL (`verdict_sql`, ...; the catalog's `findings_by_class` views), so the two cannot drift apart
(tests/unit/test_verdicts.py gives both every combination of outcomes).

The outcomes (docs/method.md, "Verdicts"):
- threshold: `clears` (the value's 95 % interval is on the claim's side of the bound), `misses` (on
  the other side), `straddles`; NULL without an interval.
- null: `beyond` (the interval of value minus null, resample by resample, excludes zero on the
  claim's side), `opposite` (excludes it on the other side), `indistinct`; NULL without one.
- control (the positive control: the same finding on a target tokenwise by construction), its
  threshold outcome as above and where the real value lies against it: `beyond control` (the
  interval of real minus control on the claim's side), `below control` (on the other side: the
  estimator shows less of the structure on the layer than on the tokenwise target), `same`;
  NULL where the finding has no control role or no control was stored.

The rule, first match wins:
1. no interval: no verdict (NULL);
2. `holds`: the value clears its threshold and is beyond its null (whatever the control says: the
   control's outcome is shown beside it);
3. `estimator-limited`: the value does not clear, and for a finding whose control is `positive`
   (the claim says the layer is tokenwise, so a tokenwise target must show it) the control does not
   clear either or cannot be told from the value; for a `floor` control (the claim is about the
   residual; the control's residual is the estimator's own error) the value cannot be told from it;
4. `no control`: the value does not clear, the finding needs a control to tell a failure from the
   estimator's limit, and none was measured (a sweep, or a run without controls);
5. `opposite`: the value is beyond its null on the wrong side of the claim;
6. `fails`: the value misses its threshold;
7. `undecided`: the value straddles its threshold, or has no null interval;
8. `indistinct`: it clears the threshold but cannot be told from its null.
"""

from __future__ import annotations

from dataclasses import dataclass

# Each outcome's domain (None: SQL NULL)
THRESHOLD = ("clears", "misses", "straddles", None)
NULL = ("beyond", "opposite", "indistinct", None)
ROLES = ("positive", "floor", "reference", "none")
CONTROL = ("beyond control", "below control", "same", None)
VERDICTS = ("holds", "fails", "undecided", "indistinct", "estimator-limited", "no control", "opposite")

# the columns the rule reads, in the findings views
FIELDS = ("threshold_outcome", "null_outcome", "control_role", "control_threshold_outcome", "control_outcome")

Condition = tuple[tuple[str, tuple[str | None, ...]], ...]  # a conjunction: each field takes one of these values


@dataclass(frozen=True)
class Rule:
    verdict: str | None
    any_of: tuple[Condition, ...]  # a disjunction of conjunctions


NOT_CLEARS = ("misses", "straddles")
RULES: tuple[Rule, ...] = (
    Rule(None, ((("threshold_outcome", (None,)),),)),
    Rule("holds", ((("threshold_outcome", ("clears",)), ("null_outcome", ("beyond",))),)),
    Rule("estimator-limited", (
        (("threshold_outcome", NOT_CLEARS), ("control_role", ("positive",)), ("control_threshold_outcome", NOT_CLEARS)),
        (("threshold_outcome", NOT_CLEARS), ("control_role", ("positive", "floor")), ("control_outcome", ("same",))),
    )),
    Rule("no control", ((("threshold_outcome", NOT_CLEARS), ("control_role", ("positive", "floor")),
                         ("control_outcome", (None,))),)),
    Rule("opposite", ((("null_outcome", ("opposite",)),),)),
    Rule("fails", ((("threshold_outcome", ("misses",)),),)),
    Rule("undecided", ((("threshold_outcome", ("straddles",)),), (("null_outcome", (None,)),))),
    Rule("indistinct", ((),)),
)


def _matches(condition: Condition, outcomes: dict[str, str | None]) -> bool:
    return all(outcomes[field] in allowed for field, allowed in condition)


def verdict(threshold_outcome: str | None, null_outcome: str | None, control_role: str,
            control_threshold_outcome: str | None = None, control_outcome: str | None = None) -> str | None:
    """The verdict word of one finding from its outcomes (RULES, first match)."""
    outcomes = {"threshold_outcome": threshold_outcome, "null_outcome": null_outcome, "control_role": control_role,
                "control_threshold_outcome": control_threshold_outcome, "control_outcome": control_outcome}
    for field, domain in zip(FIELDS, (THRESHOLD, NULL, ROLES, THRESHOLD, CONTROL)):
        if outcomes[field] not in domain:
            raise ValueError(f"{field} must be one of {domain}, got {outcomes[field]!r}")
    for rule in RULES:
        if any(_matches(condition, outcomes) for condition in rule.any_of):
            return rule.verdict
    raise AssertionError("the last rule matches everything")


def _sql_value(value: str | None) -> str:
    return "NULL" if value is None else "'" + value.replace("'", "''") + "'"


def _condition_sql(condition: Condition) -> str:
    if not condition:
        return "true"
    parts = []
    for field, allowed in condition:
        values = [v for v in allowed if v is not None]
        terms = [f"{field} IS NULL"] if None in allowed else []
        if values:
            terms.append(f"{field} IN ({', '.join(_sql_value(v) for v in values)})")
        parts.append("(" + " OR ".join(terms) + ")")
    return " AND ".join(parts)


def verdict_sql() -> str:
    """RULES as one SQL CASE over the columns FIELDS (NULL-safe: each test names NULL explicitly)."""
    whens = "\n".join(f"     WHEN {' OR '.join('(' + _condition_sql(c) + ')' for c in rule.any_of)} "
                      f"THEN {_sql_value(rule.verdict)}" for rule in RULES)
    return f"CASE\n{whens}\nEND"


# Where an interval lies against a bound (threshold) and against zero (a paired difference), for a
# claim `op` ('>=': the claim is a large value; '<=': a small one). Python and SQL side by side, tested equal.
def threshold_outcome(op: str, bound: float, lo: float | None, hi: float | None) -> str | None:
    if lo is None or hi is None:
        return None
    if (op == ">=" and lo >= bound) or (op == "<=" and hi <= bound):
        return "clears"
    if (op == ">=" and hi < bound) or (op == "<=" and lo > bound):
        return "misses"
    return "straddles"


def threshold_outcome_sql(op: str, bound: str, lo: str, hi: str) -> str:
    return (f"CASE WHEN {lo} IS NULL OR {hi} IS NULL THEN NULL "
            f"WHEN ({op} = '>=' AND {lo} >= {bound}) OR ({op} = '<=' AND {hi} <= {bound}) THEN 'clears' "
            f"WHEN ({op} = '>=' AND {hi} < {bound}) OR ({op} = '<=' AND {lo} > {bound}) THEN 'misses' "
            f"ELSE 'straddles' END")


def difference_outcome(op: str, lo: float | None, hi: float | None, words: tuple[str, str, str]) -> str | None:
    """Where the interval of a difference (value minus a reference) lies: `words` = (on the claim's
    side, on the other side, neither)."""
    if lo is None or hi is None:
        return None
    if (op == ">=" and lo > 0) or (op == "<=" and hi < 0):
        return words[0]
    if (op == ">=" and hi < 0) or (op == "<=" and lo > 0):
        return words[1]
    return words[2]


def difference_outcome_sql(op: str, lo: str, hi: str, words: tuple[str, str, str]) -> str:
    beyond, below, same = (_sql_value(w) for w in words)
    return (f"CASE WHEN {lo} IS NULL OR {hi} IS NULL THEN NULL "
            f"WHEN ({op} = '>=' AND {lo} > 0) OR ({op} = '<=' AND {hi} < 0) THEN {beyond} "
            f"WHEN ({op} = '>=' AND {hi} < 0) OR ({op} = '<=' AND {lo} > 0) THEN {below} "
            f"ELSE {same} END")


NULL_WORDS = ("beyond", "opposite", "indistinct")
CONTROL_WORDS = ("beyond control", "below control", "same")
