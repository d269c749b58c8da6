"""Stage 2: k-NN in layer-l space and one tokenwise fit per anchor and class."""

import dagster as dg
import numpy as np

from assets import checks
from assets.activations import activations
from assets.common import Written, each_model, finish, provenance_from, read_upstream, stage_asset
from orchestration.resources import UpdateLensResource
from updatelens.analysis import compute_fits, fits_table, layer_data


@stage_asset(
    "T(x) at every kept token for each function class, fitted on the token's k nearest "
    "neighbours (other sequences) and evaluated out of sample; fit condition numbers.",
    kinds={"faiss", "parquet"},
    deps=(activations,),
)
def local_fits(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, lens.root):
        for layer in layers:
            act = read_upstream(lens.root, "activations", model, layer, cfg)
            data = layer_data(act)
            fits, neighbours = compute_fits(data, cfg)
            stored = written.add(lens.root, "local_fits", model, layer,
                                 fits_table(data, fits, neighbours, provenance_from(act, cfg)))
            written.note(model, layer, degenerate_fits=int(sum(np.sum(f.degenerate) for f in fits.values())))
            verdicts[f"{model}:{layer:02d}"] = checks.check_fits(stored, cfg, data.x.shape[1], lens.checks,
                                                                 data.x.astype(np.float64), neighbours)
            context.log.info(f"{model} layer {layer}: fitted {', '.join(cfg.classes)}")
    return finish(lens.root, cfg, written, check_results=[checks.result("local_fits", "fits_valid", verdicts, lens.checks)])
