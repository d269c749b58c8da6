"""Printing results on the terminal."""

from __future__ import annotations


def print_frame(frame: object) -> None:
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True):
        print(frame)


def _cell(value: object, width: int = 60) -> str:
    text = "null" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def print_rows(columns: list[str], rows: list[tuple[object, ...]]) -> None:
    """A plain-text table of query rows (floats to 6 significant digits, long text cut at 60)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    print(line)
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print(line)
    for raw, row in zip(rows, cells):  # numbers right-aligned, text left
        print("| " + " | ".join(v.rjust(w) if isinstance(x, (int, float)) else v.ljust(w)
                                for x, v, w in zip(raw, row, widths)) + " |")
    print(line)
    print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}")

