"""The defaults the documentation states are the code's: every "`field` ... default X" (and
"`field="X"` (default)", "`field` ... `[...]` by default") in the README and docs/ that names a field
of AnalysisConfig says that field's default."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from updatelens.config import AnalysisConfig

REPO = Path(__file__).resolve().parents[2]
PATTERNS = (
    re.compile(r"`(\w+)`[^`.;:]{0,40}?\(?\bdefault:?\s+`?([^\s`),;]+(?:,\d{3})*)`?"),  # `k` (default 64), `k`, default 64
    re.compile(r"`(\w+)\s*=\s*\"?([^\"`]+)\"?`\s*\(default"),  # `exclusion="document"` (default)
    re.compile(r"`(\w+)`[^`.]{0,30}`(\[[^`]*\])` by default"),  # `positive_controls` chooses them: `[...]` by default
)


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """(field, the default as written) for every statement of a default of a configuration field."""
    fields = {f.name for f in dataclasses.fields(AnalysisConfig)}
    return [(m.group(1), m.group(2)) for pattern in PATTERNS for m in pattern.finditer(text) if m.group(1) in fields]


def agrees(written: str, value: object) -> bool:
    if isinstance(value, tuple):
        return json.loads(written) == list(value)
    if isinstance(value, bool):
        return written.lower() == str(value).lower()
    if isinstance(value, int | float):
        return float(written.replace(",", "")) == float(value)
    return written == str(value)


def test_the_documented_defaults_are_the_codes() -> None:
    defaults = AnalysisConfig()
    stated = [(path.relative_to(REPO), field, written)
              for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
              for field, written in stated_defaults(path.read_text(encoding="utf-8"))]
    assert len({field for _, field, _ in stated}) >= 6, stated  # the patterns still find the docs' defaults
    wrong = [(str(path), field, written, getattr(defaults, field)) for path, field, written in stated
             if not agrees(written, getattr(defaults, field))]
    assert wrong == []


def test_the_defaults_check_sees_a_wrong_default() -> None:
    text = "Neighbours: `k` (default 32) tokens; `exclusion=\"sequence\"` (default); `positive_controls`: `[]` by default."
    stated = stated_defaults(text)
    assert [field for field, _ in stated] == ["k", "exclusion", "positive_controls"]
    assert not any(agrees(written, getattr(AnalysisConfig(), field)) for field, written in stated)


def test_the_documented_sweep_grid_is_the_codes() -> None:
    from updatelens.sweep import DEFAULT_GRID

    assert f"`{json.dumps(DEFAULT_GRID)}`" in (REPO / "docs" / "results.md").read_text(encoding="utf-8")
