"""Stage 4: alignment, angles, projection on the dominant tokenwise subspace, singular spectra."""

import dagster as dg

from assets import checks
from assets.common import Written, each_model, finish, provenance_from, read_layer, read_upstream, stage_asset
from assets.residuals import residuals
from orchestration.resources import UpdateLensResource
from updatelens.analysis import geometry_tables


@stage_asset(
    "Per token: cosines and angles between Δ_full, Δ_tok and r (update and map forms), "
    "projection energies on the top-m tokenwise subspace; per layer: singular spectra "
    "(table `spectra`).",
    kinds={"parquet"},
    deps=(residuals,),
)
def geometry(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, lens.root):
        for layer in layers:
            act, data, fits = read_layer(lens.root, model, layer, cfg)
            read_upstream(lens.root, "residuals", model, layer, cfg)  # lineage and config check
            geo, spec = geometry_tables(data, fits, cfg, provenance_from(act, cfg))
            stored_geo = written.add(lens.root, "geometry", model, layer, geo)
            stored_spec = written.add(lens.root, "spectra", model, layer, spec)
            verdicts[f"{model}:{layer:02d}"] = checks.check_geometry(stored_geo, stored_spec)
    return finish(lens.root, cfg, written, check_results=[
        checks.result("geometry", "geometry_ranges", verdicts, lens.checks)])
