"""Stage 2: k-NN in layer-l space and one tokenwise fit per anchor and class.

Memory: the layer's kept states (float32), the neighbour index and one class's T(x) at a time;
the partition is written class by class in row groups."""

from updatelens.assets import checks
from updatelens.assets.common import StageRun, check_upstream, read_transition, stage_asset
from updatelens.steps.local_fits import layer_neighbours, stream_fits
from updatelens.tables import Provenance


@stage_asset
def local_fits(run: StageRun) -> None:
    cfg, store, settings = run.cfg, run.store, run.lens.checks
    for model, layers in run.models():
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "local_fits")
            data = read_transition(store, model, layer)
            n_kept = len(data.x)
            neighbours = layer_neighbours(data, cfg)
            run.context.log.info(f"{model} layer {layer}: neighbours of {n_kept} tokens found ({cfg.index} index)")
            target = store.partition("local_fits", model, layer)
            with target.writer() as sink:
                degenerate = stream_fits(data, neighbours, cfg, prov, layer, sink.write, label=f"{model} layer {layer}: ")
            run.written.record(target, sink.rows)
            run.written.note(model, layer, degenerate_fits=degenerate)
            run.judge("fits_valid", model, layer, checks.check_fits(
                target.parts(["fn_class", "seq", "pos", "degenerate", "tx"]), cfg, data.x.shape[1], settings, len(data.x)))
            run.judge("fits_refit_audit", model, layer, checks.refit_audit(
                target.parts(["fn_class", "neighbours", "tx"]), data.x, data.y, cfg, settings))
            run.context.log.info(f"{model} layer {layer}: fitted {', '.join(cfg.classes)}")
