"""Stage: the positive controls. The real layer's neighbours and classes, fitted to targets that are
tokenwise by construction (engine: `updatelens.steps.controls`), measured by the geometry stage's code:
what the estimator shows when the paper's structure is there. Reads a whole layer at a time (the
linear control's leave-one-document-out fit needs every token)."""

import functools

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens.assets import checks
from updatelens.assets.common import StageRun, check_upstream, stage_asset
from updatelens.config import LOCAL_CLASSES
from updatelens.linear_control import made_controls
from updatelens.steps.controls import control_layer_tables, made_targets
from updatelens.steps.layer import layer_data
from updatelens.tables import Provenance, to_matrix


def stored_neighbours(fits: pa.Table, order: tuple[np.ndarray, np.ndarray]) -> np.ndarray | None:
    """The k neighbours the real layer's local fits used, rows in the kept tokens' (seq, pos) order
    (`order`); None where no local class was fitted."""
    local = [c for c in dict.fromkeys(fits["fn_class"].to_pylist()) if c in LOCAL_CLASSES]
    if not local:
        return None
    part = fits.filter(pc.equal(fits["fn_class"], local[0])).sort_by([("seq", "ascending"), ("pos", "ascending")])
    seq, pos = order
    if not (np.array_equal(part["seq"].to_numpy(), seq) and np.array_equal(part["pos"].to_numpy(), pos)):
        raise ValueError("local_fits do not cover the kept tokens of the activations")
    return to_matrix(part["neighbours"], np.int64)


def log_for(context: dg.AssetExecutionContext, model: str, message: str) -> None:
    context.log.info(f"{model} {message}")


@stage_asset
def controls(run: StageRun) -> None:
    cfg, store = run.cfg, run.store
    for model, layers in run.models():
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "controls")
            check_upstream(store, "local_fits", model, layer, cfg)
            table = store.partition("activations", model, layer).read()
            data = layer_data(table)
            y_ctl = None
            if pc.sum(pc.is_valid(table["y_ctl"])).as_py() == len(table):
                y_ctl = to_matrix(table.sort_by([("seq", "ascending"), ("pos", "ascending")])["y_ctl"]).reshape(
                    data.y_full.shape)
            neighbours = stored_neighbours(store.partition("local_fits", model, layer).read(
                ["fn_class", "seq", "pos", "neighbours"]), (data.seq, data.pos))
            made = control_layer_tables(data, y_ctl, neighbours, cfg, prov,
                                        log=functools.partial(log_for, run.context, model))
            stored = {name: run.written.add(store.partition(name, model, layer), table) for name, table in made.items()}
            expected = made_targets(cfg.positive_controls, y_ctl is not None)
            run.written.note(model, layer, positive_controls=",".join(made_controls(cfg.positive_controls,
                                                                                    y_ctl is not None)) or "none")
            verdict = checks.check_controls(stored["control_geometry"], stored["control_spectra"], len(data.x),
                                            cfg.classes, expected)
            verdict.merge(checks.check_context_split(stored["context_split"], data, y_ctl is not None), "split: ")
            verdict.merge(checks.check_context_heads(stored["context_heads"], data, y_ctl), "sources: ")
            run.judge("controls_valid", model, layer, verdict)
