"""The reports' HTML: their tables (verdict cells coloured), pages and inlined figures, shared by the
model report, the comparison (build.py) and the notebook's findings table."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import polars as pl

from updatelens.verdicts import VERDICTS


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# ---- HTML ---------------------------------------------------------------------------------------
# Tables with their verdicts' colours: the reports' and the notebook's findings table.
TABLE_STYLE = """
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; display: block; max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; }
th { background: #f3f3f3; }
td.yes, td.holds { background: #e3f4e3; } td.no, td.fails { background: #fbe4e4; } td.flip { font-weight: bold; }
td.indistinct { background: #fff1cc; } td.undecided { background: #eeeeee; }
td.estimator-limited { background: #e1ecfb; } td.opposite { background: #f1dcf5; }
td.no-control { background: #eeeeee; }
"""
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1500px; color: #222; }
""" + TABLE_STYLE.strip() + """
details { margin: 0.5em 0 1.5em; } summary { cursor: pointer; color: #444; }
img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; margin-bottom: 1.5em; }
code, pre { background: #f6f6f6; font-size: 12px; }
pre { padding: 0.6em; overflow-x: auto; }
"""


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def html_table(frame: pl.DataFrame, verdict_columns: tuple[str, ...] = ("holds", "verdict")) -> str:
    """A table; a verdict column's cells are coloured (a boolean: yes/no; a verdict: its own colour)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in frame.columns)
    rows = []
    for row in frame.iter_rows(named=True):
        cells = []
        for column, value in row.items():
            cls = ""
            if column in verdict_columns and isinstance(value, bool):
                cls = ' class="yes"' if value else ' class="no"'
            elif column in verdict_columns and value in VERDICTS:
                cls = f' class="{value.replace(" ", "-")}"'
            elif column in verdict_columns and isinstance(value, str) and value.rsplit(": ", 1)[-1] in VERDICTS:
                cls = f' class="{value.rsplit(": ", 1)[-1].replace(" ", "-")}"'  # a comparison cell: "...: verdict"
            cells.append(f"<td{cls}>{html.escape(_cell(value))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def page(title: str, sections: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>")


def figure_section(name: str, caption: str, path: Path) -> str:
    return (f"<figure id='{name}'><img alt='{name}' src='{data_uri(path)}'>"
            f"<figcaption><b>{name}.png</b>: {html.escape(caption)}</figcaption></figure>")
