"""Printing results on the terminal."""

from __future__ import annotations


def print_frame(frame: object) -> None:
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True):
        print(frame)
