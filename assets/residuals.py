"""Stage 3: the decomposition Δ_full = Δ_tok + r, residual vectors, norms and relative errors."""

import dagster as dg
import pyarrow.compute as pc

from assets.common import GROUP, Written, finish, partitions_of, provenance_from, read_upstream
from assets.local_fits import local_fits
from orchestration.partitions import MODEL_LAYER
from orchestration.resources import UpdateLensResource
from updatelens import CODE_VERSION
from updatelens.analysis import fits_from_table, layer_data, residuals_table


@dg.asset(
    partitions_def=MODEL_LAYER,
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name=GROUP,
    code_version=CODE_VERSION,
    kinds={"parquet"},
    deps=[local_fits],
    description="Residual r = y - T(x) per token and class, with ||Δ_full||, ||Δ_tok||, ||r|| and the "
                "relative error ||r|| / ||Δ_full||.",
)
def residuals(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    medians: dict[str, float] = {}
    for model, layers in partitions_of(context).items():
        for layer in layers:
            act = read_upstream(lens.root, "activations", model, layer, cfg)
            data = layer_data(act)
            fits = fits_from_table(read_upstream(lens.root, "local_fits", model, layer, cfg), data)
            table = residuals_table(data, fits, provenance_from(act, cfg))
            written.add(lens.root, "residuals", model, layer, table)
            for fn_class in cfg.classes:
                part = table.filter(pc.equal(table["fn_class"], fn_class))
                medians[f"rel_err_median_{fn_class}"] = float(pc.approximate_median(part["rel_err"]).as_py())
    return finish(lens.root, cfg, written, medians if len(written.partitions) == 1 else {})
