"""Every stored table has one declared schema: the writer refuses a table that does not match it
before a byte is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.rows import declared_rows
from updatelens import schemas
from updatelens.config import AnalysisConfig
from updatelens.stages import SWEEP_TABLES, TABLES
from updatelens.storage.store import Store
from updatelens.tables import vector_column


def _row(table: str, cfg: AnalysisConfig) -> pa.Table:
    return declared_rows(table, 2, cfg)


def test_every_table_the_pipeline_writes_has_a_schema_its_own_rows_match() -> None:
    cfg = AnalysisConfig()
    for table in (*TABLES, *SWEEP_TABLES):
        schemas.check(table, _row(table, cfg))
        assert all(c.description for c in schemas.columns(table, cfg)), table


def test_a_missing_extra_misordered_or_mistyped_column_is_named() -> None:
    cfg = AnalysisConfig()
    good = _row("residuals", cfg)
    with pytest.raises(schemas.SchemaError, match=r"missing \['norm_res'\]"):
        schemas.check("residuals", good.drop_columns(["norm_res"]))
    with pytest.raises(schemas.SchemaError, match=r"undeclared \['extra'\]"):
        schemas.check("residuals", good.append_column("extra", pa.array([1, 2])))
    with pytest.raises(schemas.SchemaError, match="out of order"):
        schemas.check("residuals", good.select(["seq", *[n for n in good.column_names if n != "seq"]]))
    with pytest.raises(schemas.SchemaError, match="'rel_err' is float, declared double"):
        schemas.check("residuals", good.set_column(good.column_names.index("rel_err"), "rel_err",
                                                   pa.array([0.1, 0.2], pa.float32())))
    states = _row("activations", cfg)
    short = vector_column(np.full((2, 3), 0.5, np.float32))
    with pytest.raises(schemas.SchemaError, match=r"vector columns of different widths \[3, 4\]"):
        schemas.check("activations", states.set_column(states.column_names.index("x"), "x", short))
    with pytest.raises(schemas.SchemaError, match="no schema is declared for table 'nonesuch'"):
        schemas.check("nonesuch", good)


def test_configuration_dependent_columns_follow_the_rows_configuration() -> None:
    cfg = AnalysisConfig(subspace_ms=(2, 16), k=8)
    geometry = _row("geometry", cfg)
    schemas.check("geometry", geometry)  # proj_*_m2 and m16, not the default's m1, m4, m64
    assert "proj_res_m2" in geometry.column_names and "proj_res_m4" not in geometry.column_names
    as_default = geometry.set_column(geometry.column_names.index("config_json"), "config_json",
                                     pa.array([AnalysisConfig().to_json()] * len(geometry)))
    with pytest.raises(schemas.SchemaError, match="missing"):
        schemas.check("geometry", as_default)
    fits = _row("local_fits", cfg)
    wide = fits.set_column(fits.column_names.index("config_json"), "config_json",
                           pa.array([json.dumps({**json.loads(cfg.to_json()), "k": 9})] * len(fits)))
    with pytest.raises(schemas.SchemaError, match="'neighbours'"):
        schemas.check("local_fits", wide)
    assert schemas.describe_column("geometry", "proj_tok_m32").startswith("share of the energy of Δ_tok")


def test_the_store_refuses_a_table_off_its_schema_before_writing_anything(tmp_path: Path) -> None:
    cfg = AnalysisConfig()
    store = Store.open(tmp_path)
    part = store.partition("residuals", "m", 0)
    bad = _row("residuals", cfg).drop_columns(["rel_err"])
    with pytest.raises(schemas.SchemaError, match="rel_err"):
        part.write(bad)
    with pytest.raises(schemas.SchemaError, match="rel_err"):
        with part.writer() as sink:
            sink.write(bad)
    assert not part.exists() and not list(tmp_path.rglob("*.parquet"))
    part.write(_row("residuals", cfg))
    assert part.exists()
