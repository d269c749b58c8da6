"""Stage 3, residuals: r = y - T(x) per token and class, with its norms and relative error."""

from __future__ import annotations

import pyarrow as pa

from updatelens.fits import LayerFit
from updatelens.geometry import (
    decompose,
    token_metrics,
)
from updatelens.steps.layer import LayerData
from updatelens.tables import Provenance, vector_column, with_provenance


def residuals_table(data: LayerData, fits: dict[str, LayerFit], prov: Provenance) -> pa.Table:
    parts = []
    for fn_class, fit in fits.items():
        dec = decompose(data.x, data.y, fit.tx)
        m = token_metrics(data.x, data.y, fit.tx, dec)
        cols = {
            "fn_class": pa.array([fn_class] * len(fit.tx)),
            "seq": pa.array(data.seq),
            "pos": pa.array(data.pos),
            "residual": vector_column(dec.residual),
            "norm_full": pa.array(m["norm_full"]),
            "norm_tok": pa.array(m["norm_tok"]),
            "norm_res": pa.array(m["norm_res"]),
            "rel_err": pa.array(m["rel_err"]),
        }
        parts.append(with_provenance(cols, prov, data.layer))
    return pa.concat_tables(parts)
