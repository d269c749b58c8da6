"""Rows of a stored table with exactly its declared columns (updatelens.schemas), for the storage
tests that write through the store: the given columns take the given values, the others nulls."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from updatelens import schemas
from updatelens.config import AnalysisConfig
from updatelens.tables import vector_column


def declared_rows(table: str, n: int, cfg: AnalysisConfig | None = None, d: int = 4,
                  **values: Sequence[object] | object) -> pa.Table:
    """`n` rows of `table`; `values[name]` a sequence of n values or one value for every row."""
    cfg = cfg or AnalysisConfig()
    data: dict[str, pa.Array] = {}
    for column in schemas.columns(table, cfg):
        given = values.pop(column.name, None)
        if column.type == schemas.VECTOR:
            data[column.name] = vector_column(np.full((n, d), 0.5, np.float32))
        elif column.type in (schemas.FLOATS, schemas.INTS):
            typ = pa.float32() if column.type == schemas.FLOATS else pa.int32()
            data[column.name] = pa.nulls(n, pa.list_(typ, 1))
        elif column.type == schemas.NEIGHBOURS:
            data[column.name] = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(n * cfg.k), pa.int32()), cfg.k)
        elif column.name == "config_json":
            data[column.name] = pa.array([cfg.to_json()] * n)
        elif given is not None:
            listed = list(given) if isinstance(given, (list, tuple)) else [given] * n
            data[column.name] = pa.array(listed, column.type)
        else:
            data[column.name] = pa.nulls(n, column.type)
    if values:
        raise KeyError(f"{table} declares no column {sorted(values)}")
    return pa.table(data)
