"""Arrow helpers: vector columns as FixedSizeList<float32>, provenance columns on every row."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import pyarrow as pa

from updatelens import CODE_VERSION
from updatelens.config import AnalysisConfig

FLOAT32 = pa.float32()


def vector_column(values: np.ndarray, dtype: pa.DataType = FLOAT32) -> pa.FixedSizeListArray:
    values = np.ascontiguousarray(values, dtype=dtype.to_pandas_dtype())
    n, d = values.shape
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=dtype), d)


def to_matrix(column: pa.ChunkedArray | pa.Array, dtype: type = np.float32) -> np.ndarray:
    """A FixedSizeList column back to an [n, d] numpy array."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros((0, arr.type.list_size), dtype=dtype)
    return arr.values.to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size).astype(dtype, copy=False)


@dataclass(frozen=True)
class Provenance:
    """The configuration that produced a row: written as constant columns on every table."""

    model: str
    model_revision: str
    corpus: str
    corpus_slice: str
    config_id: str
    k: int
    rank: int
    dtype: str
    code_version: str
    config_json: str
    model_layers: int  # the model's real depth (the analysed layers may be fewer)
    weights: str  # what the model ran with: quantization and dtype (models.weights_of)

    @classmethod
    def of(cls, model: str, model_revision: str, corpus: str, corpus_slice: str, cfg: AnalysisConfig,
           model_layers: int, weights: str) -> Provenance:
        """The one place provenance is built: what was analysed (model, its depth, revision, weights, corpus
        slice), the configuration that analysed it and this code's version."""
        return cls(model=model, model_revision=model_revision, corpus=corpus, corpus_slice=corpus_slice,
                   config_id=cfg.config_id, k=cfg.k, rank=cfg.rank, dtype=cfg.fit_dtype, code_version=CODE_VERSION,
                   config_json=cfg.to_json(), model_layers=model_layers, weights=weights)

    def for_stage(self, stage: str) -> Provenance:
        """The rows of a stage record that stage's code version (`updatelens.versions`), not the whole tree's."""
        from updatelens.versions import stage_version

        return replace(self, code_version=stage_version(stage))

    @classmethod
    def of_rows(cls, table: pa.Table, cfg: AnalysisConfig, stage: str) -> Provenance:
        """For a stage that reads stored rows: they say which model (its depth and weights), revision and
        corpus slice; the rows it writes record its code version."""
        row = table.slice(0, 1).select(["model", "model_revision", "corpus", "corpus_slice", "model_layers",
                                        "weights"]).to_pylist()[0]
        return cls.of(row["model"], row["model_revision"], row["corpus"], row["corpus_slice"], cfg, row["model_layers"],
                      row["weights"]).for_stage(stage)

    def columns(self, n: int) -> dict[str, pa.Array]:
        out: dict[str, pa.Array] = {}
        for key, value in asdict(self).items():
            typ = pa.int32() if isinstance(value, int) else pa.string()
            out[key] = pa.array([value] * n, type=typ)
        return out


PROVENANCE_COLUMNS: tuple[str, ...] = ("model", "model_revision", "corpus", "corpus_slice", "config_id", "k", "rank",
                                       "dtype", "code_version", "config_json", "model_layers", "weights")


def with_provenance(columns: dict[str, pa.Array | np.ndarray], prov: Provenance, layer: int) -> pa.Table:
    """Rows carry model and layer too (also the hive partition values), so a file stands alone."""
    n = len(next(iter(columns.values()))) if columns else 0
    data: dict[str, pa.Array | np.ndarray] = {"layer": pa.array([layer] * n, type=pa.int32())}
    data.update(columns)
    data.update(prov.columns(n))
    return pa.table(data)
