"""Stage 3: the decomposition Δ_full = Δ_tok + r, residual vectors, norms and relative errors."""

import dagster as dg
import numpy as np
import pyarrow.compute as pc

from assets import checks
from assets.common import Written, each_model, finish, provenance_from, read_layer, stage_asset
from assets.local_fits import local_fits
from orchestration.resources import UpdateLensResource
from updatelens.analysis import residuals_table


@stage_asset(
    "Residual r = y - T(x) per token and class, with ||Δ_full||, ||Δ_tok||, ||r|| and the "
    "relative error ||r|| / ||Δ_full||.",
    kinds={"parquet"},
    deps=(local_fits,),
)
def residuals(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    recon: dict[str, checks.Verdict] = {}
    bounds: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, lens.root):
        for layer in layers:
            act, data, fits = read_layer(lens.root, model, layer, cfg)
            stored = written.add(lens.root, "residuals", model, layer, residuals_table(data, fits, provenance_from(act, cfg)))
            key = f"{model}:{layer:02d}"
            recon[key] = checks.check_reconstruction(stored, data, fits, cfg, lens.checks)
            bounds[key] = checks.check_rel_err_bounds(stored, lens.checks)
            for fn_class in cfg.classes:
                part = stored.filter(pc.equal(stored["fn_class"], fn_class))
                written.note(model, layer, **{f"rel_err_median_{fn_class}": float(np.median(part["rel_err"].to_numpy()))})
    return finish(lens.root, cfg, written, check_results=[
        checks.result("residuals", "reconstruction_exact", recon, lens.checks),
        checks.result("residuals", "rel_err_within_bounds", bounds, lens.checks),
    ])
