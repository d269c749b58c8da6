"""Stage 2: k-NN in layer-l space and one tokenwise fit per anchor and class.

Memory: the layer's kept states (float32), the neighbour index and one class's T(x) at a time;
the partition is written class by class in row groups."""

import dagster as dg

from updatelens.assets import checks
from updatelens.assets.common import (
    Finished,
    Written,
    check_upstream,
    each_model,
    finish,
    read_transition,
    run_store,
    stage_asset,
)
from updatelens.assets.resources import UpdateLensResource
from updatelens.steps.local_fits import layer_neighbours, stream_fits
from updatelens.tables import Provenance


@stage_asset
def local_fits(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> Finished:
    cfg = lens.config()
    store = run_store(context, lens.store)
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    audits: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, store):
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "local_fits")
            data = read_transition(store, model, layer)
            n_kept = len(data.x)
            neighbours = layer_neighbours(data, cfg)
            context.log.info(f"{model} layer {layer}: neighbours of {n_kept} tokens found ({cfg.index} index)")
            target = store.partition("local_fits", model, layer)
            with target.writer() as sink:
                degenerate = stream_fits(data, neighbours, cfg, prov, layer, sink.write, label=f"{model} layer {layer}: ")
            written.record(target, sink.rows)
            written.note(model, layer, degenerate_fits=degenerate)
            verdicts[f"{model}:{layer:02d}"] = checks.check_fits(target.parts(["fn_class", "seq", "pos", "degenerate", "tx"]),
                                                                 cfg, data.x.shape[1], lens.checks, len(data.x))
            audits[f"{model}:{layer:02d}"] = checks.refit_audit(target.parts(["fn_class", "neighbours", "tx"]),
                                                                data.x, data.y, cfg, lens.checks)
            context.log.info(f"{model} layer {layer}: fitted {', '.join(cfg.classes)}")
    return finish(store, cfg, written, outcomes=[
        checks.Outcome("local_fits", "fits_valid", verdicts, lens.checks),
        checks.Outcome("local_fits", "fits_refit_audit", audits, lens.checks)])
