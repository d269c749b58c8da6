"""Stage 4: alignment, angles, projection on the dominant tokenwise subspace, singular spectra.

Two passes over blocks of whole sequences (engine: `LayerGeometry`): the first accumulates d x d
Gram matrices (the dominant subspace and the spectra come from them), the second writes the
per-token geometry block by block; memory holds a block whatever the sample size."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from updatelens.assets import checks
from updatelens.assets.common import StageRun, block_reader, check_upstream, seq_blocks, stage_asset
from updatelens.steps.geometry import stream_geometry
from updatelens.steps.layer import sample_docs
from updatelens.storage.store import Store
from updatelens.tables import Provenance, to_matrix


@stage_asset
def geometry(run: StageRun) -> None:
    cfg, store = run.cfg, run.store
    for model, layers in run.models():
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "geometry")
            check_upstream(store, "local_fits", model, layer, cfg)  # what it reads: lineage and config
            docs = sample_docs(store.partition("activations", model, layer).read(["seq", "doc"]))
            target = store.partition("geometry", model, layer)
            with target.writer() as sink:
                spectra, resamples = stream_geometry(block_reader(store, model, layer), seq_blocks(cfg), cfg, docs, prov,
                                                     sink.write)
            run.written.record(target, sink.rows)
            stored_spec = run.written.add(store.partition("spectra", model, layer), spectra)
            run.written.add(store.partition("geometry_bootstrap", model, layer), resamples)
            n_kept, energy = kept_updates(store, model, layer)
            stored = target.read()
            run.written.note(model, layer, **geometry_figures(stored, stored_spec))
            verdict = checks.check_geometry(stored, stored_spec, n_kept, cfg.classes)
            verdict.merge(checks.check_spectra_energy(stored_spec, energy))
            run.judge("geometry_ranges", model, layer, verdict)


def kept_updates(store: Store, model: str, layer: int) -> tuple[int, float]:
    """The layer's kept tokens and sum ||y - x||^2 over them, read from the stored activations one row
    group at a time: what the geometry's rows and the spectra of Δ_full are checked against."""
    n_kept, energy = 0, 0.0
    for part in store.partition("activations", model, layer).parts(["kept", "x", "y"]):
        kept = part["kept"].to_numpy(zero_copy_only=False)
        update = to_matrix(part["y"], np.float64)[kept] - to_matrix(part["x"], np.float64)[kept]
        n_kept += int(kept.sum())
        energy += float(np.einsum("ij,ij->", update, update))
    return n_kept, energy


def geometry_figures(tokens: pa.Table, spectra: pa.Table) -> dict[str, float]:
    """A layer's geometry at a glance, per class, for its partition's page: the median cos(Δ_full, Δ_tok),
    the share of residual angles above 60° and the effective ranks of Δ_full, Δ_tok and r."""
    figures: dict[str, float] = {}
    for fn_class in dict.fromkeys(tokens["fn_class"].to_pylist()):
        mine = tokens.filter(pc.equal(tokens["fn_class"], fn_class))
        figures[f"cos_full_tok_median_{fn_class}"] = float(np.median(mine["cos_full_tok"].to_numpy()))
        figures[f"share_angle_gt60_{fn_class}"] = float(np.mean(mine["angle_full_res"].to_numpy() > 60))
        ranks = spectra.filter(pc.equal(spectra["fn_class"], fn_class))
        for which in ("full", "tok", "res"):
            rank = ranks.filter(pc.equal(ranks["which"], which))["effective_rank"]
            if len(rank):
                figures[f"effective_rank_{which}_{fn_class}"] = float(rank[0].as_py())
    return figures
