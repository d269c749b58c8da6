"""Stage 2: k-NN in layer-l space and one tokenwise fit per anchor and class.

Memory: the layer's kept states (float32), the neighbour index and one class's T(x) at a time;
the partition is written class by class in row groups."""

import dagster as dg
import numpy as np

from updatelens.assets import checks
from updatelens.assets.common import Finished, Written, check_upstream, each_model, finish, stage_asset
from updatelens.assets.resources import UpdateLensResource
from updatelens.fits import fit_layer
from updatelens.steps.layer import transition_from_parts
from updatelens.steps.local_fits import fit_row_parts, layer_neighbours
from updatelens.tables import Provenance


@stage_asset
def local_fits(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> Finished:
    cfg = lens.config()
    store = lens.store
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    audits: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, store):
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "local_fits")
            source = store.partition("activations", model, layer)
            n_kept = int(source.read(["kept"])["kept"].to_numpy(zero_copy_only=False).sum())
            data = transition_from_parts(source.parts(["layer", "seq", "pos", "doc", "kept", "x", "y"]), n_kept)
            neighbours = layer_neighbours(data, cfg)
            context.log.info(f"{model} layer {layer}: neighbours of {n_kept} tokens found ({cfg.index} index)")
            degenerate = 0
            target = store.partition("local_fits", model, layer)
            with target.writer() as sink:
                for fn_class in cfg.classes:
                    fit = fit_layer(fn_class, data.x, data.y, data.seq, neighbours, cfg, label=f"{model} layer {layer}: ")
                    for part in fit_row_parts(data, fit, neighbours, prov, layer):
                        sink.write(part)
                    degenerate += int(np.sum(fit.degenerate))
                    del fit
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
