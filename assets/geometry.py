"""Stage 4: alignment, angles, projection on the dominant tokenwise subspace, singular spectra.

Two passes over blocks of whole sequences (engine: `LayerGeometry`): the first accumulates d x d
Gram matrices (the dominant subspace and the spectra come from them), the second writes the
per-token geometry block by block; memory holds a block whatever the sample size."""

import dagster as dg

from updatelens.assets import checks
from updatelens.tables import Provenance
from updatelens.assets.common import (
    Written,
    check_upstream,
    each_model,
    finish,
   
    read_block,
    seq_blocks,
    stage_asset,
)
from updatelens.assets.resources import UpdateLensResource
from updatelens.storage.layout import partition_file, partition_writer, read_partition_columns
from updatelens.analysis import LayerGeometry


@stage_asset
def geometry(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, lens.root):
        for layer in layers:
            prov = Provenance.of_rows(check_upstream(lens.root, "activations", model, layer, cfg), cfg)
            for table in ("local_fits", "residuals"):  # lineage and config check
                check_upstream(lens.root, table, model, layer, cfg)
            blocks = seq_blocks(cfg)
            geo = None
            for lo, hi in blocks:
                data, fits = read_block(lens.root, model, layer, lo, hi)
                geo = geo or LayerGeometry(cfg, list(fits), data.x_full.shape[-1])
                geo.accumulate(data, fits)
            assert geo is not None
            geo.finish()
            with partition_writer(lens.root, "geometry", model, layer) as sink:
                for lo, hi in blocks:
                    sink.write(geo.token_table(*read_block(lens.root, model, layer, lo, hi), prov))
            written.record(partition_file(lens.root, "geometry", model, layer), "geometry", model, layer, sink.rows)
            stored_spec = written.add(lens.root, "spectra", model, layer, geo.spectra_table(prov, layer))
            written.add(lens.root, "geometry_bootstrap", model, layer, geo.bootstrap_table(prov, layer))
            stored_geo = read_partition_columns(lens.root, "geometry", model, layer)
            verdicts[f"{model}:{layer:02d}"] = checks.check_geometry(stored_geo, stored_spec)
    return finish(lens.root, cfg, written, check_results=[
        checks.result("geometry", "geometry_ranges", verdicts, lens.checks)])
