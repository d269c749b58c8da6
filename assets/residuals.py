"""Stage 3: the decomposition Δ_full = Δ_tok + r, residual vectors, norms and relative errors.

Streams over blocks of whole sequences: memory holds one block whatever the sample size."""

import numpy as np
import pyarrow.compute as pc

from updatelens.assets import checks
from updatelens.assets.common import StageRun, check_upstream, read_block, seq_blocks, stage_asset
from updatelens.steps.residuals import residuals_table
from updatelens.storage.integrity import partition_error
from updatelens.storage.store import Partition
from updatelens.tables import Provenance

SCALARS = ["fn_class", "seq", "pos", "rel_err", "norm_full", "norm_tok", "norm_res"]


@stage_asset
def residuals(run: StageRun) -> None:
    cfg, store, settings = run.cfg, run.store, run.lens.checks
    for model, layers in run.models():
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(store, "activations", model, layer, cfg), cfg, "residuals")
            check_upstream(store, "local_fits", model, layer, cfg)
            target = store.partition("residuals", model, layer)
            previous = _previous_quantiles(target.committed, cfg.config_id)
            n_kept = 0
            with target.writer() as sink:
                for lo, hi in seq_blocks(cfg):
                    data, fits = read_block(store, model, layer, lo, hi)
                    sink.write(residuals_table(data, fits, prov))
                    n_kept += int(data.kept.sum())
            run.written.record(target, sink.rows)
            gaps = checks.Verdict()  # the stored residual vectors, read back block by block, against the fits
            for lo, hi in seq_blocks(cfg):
                data, fits = read_block(store, model, layer, lo, hi)
                gaps.merge(checks.check_reconstruction_gap(target.seqs(lo, hi), data, fits, settings))
            stored = target.read(SCALARS)
            run.judge("residuals_match_fits", model, layer, checks.check_reconstruction(stored, n_kept, cfg, gaps))
            run.judge("rel_err_within_bounds", model, layer, checks.check_rel_err_bounds(stored, settings))
            run.judge("rel_err_drift", model, layer, checks.check_rel_err_drift(stored, previous, settings))
            run.judge("no_blown_up_fits", model, layer, checks.check_blown_up_fits(stored, settings))
            for fn_class in cfg.classes:
                part = stored.filter(pc.equal(stored["fn_class"], fn_class))
                run.written.note(model, layer, **{f"rel_err_median_{fn_class}": float(np.median(part["rel_err"].to_numpy()))})


def _previous_quantiles(part: Partition, config_id: str) -> dict[str, list[float]] | None:
    """The relative error quantiles of the partition this run replaces, if it verifies and has the
    same configuration (read before it is replaced)."""
    if partition_error(part.file) is not None:
        return None
    old = part.read(["fn_class", "rel_err", "config_id"])
    if not len(old) or old["config_id"][0].as_py() != config_id:
        return None
    return checks.rel_err_quantiles(old)
