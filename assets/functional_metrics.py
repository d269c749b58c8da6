"""Stage 5: KL(p_orig || p_patched) with block l's output replaced by T(h_l), the controls, and
Spearman(error, KL).

The stage streams over blocks of `kl_block` sequences (fewer where the vocabulary is large: see
AnalysisConfig.kl_block_size): a block's unpatched distributions are
computed once (resumed after the run's first layer from its captured output) and serve every
layer of the run, then dropped, so memory holds kl_block x seq_len
x vocabulary floats whatever the sample size; each layer's block of states and fits is read from
its partitions (row groups in sequence order) and only the per-token KL stays in memory.
"""

import dagster as dg

from updatelens.assets import checks
from updatelens.assets.common import Finished, Written, check_upstream, each_model, finish, stage_asset
from updatelens.assets.resources import UpdateLensResource
from updatelens.capture import block_output_is_tuple
from updatelens.perturbation import OriginalOutput, original_output, vocab_size
from updatelens.progress import progress
from updatelens.steps.functional_metrics import (
    FunctionalRows,
    functional_bootstrap_table,
    functional_rows,
    functional_tables_from_rows,
    single_positions,
)
from updatelens.steps.layer import layer_data, sample_docs
from updatelens.steps.local_fits import fits_from_table
from updatelens.tables import Provenance


@stage_asset
def functional_metrics(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> Finished:
    cfg = lens.config()
    store = lens.store
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, store):
        lm = lens.load(model)
        returns_tuple = block_output_is_tuple(lm)
        heads = {}
        for layer in layers:  # configuration and lineage of every input, before any heavy work
            heads[layer] = check_upstream(store, "activations", model, layer, cfg)
            check_upstream(store, "local_fits", model, layer, cfg)
        index = store.partition("activations", model, layers[0]).read(["seq", "pos", "token_id", "kept"])
        index = index.sort_by([("seq", "ascending"), ("pos", "ascending")])
        n_seq = int(index["seq"].to_numpy().max()) + 1
        input_ids = index["token_id"].to_numpy().reshape(n_seq, -1)
        kept = index["kept"].to_numpy(zero_copy_only=False).reshape(n_seq, -1)
        positions = single_positions(kept, cfg.single_positions, cfg.seed) if cfg.patch_mode == "single" else None
        rows: dict[int, FunctionalRows] = {layer: [] for layer in layers}
        first = layers[0]
        # the unpatched pass of a block resumes after the first layer of the run from its captured
        # output (the patched passes resume there or later); a full forward of the first sequences
        # is the reference every layer's identity patch is checked against
        reference: OriginalOutput | None = original_output(lm, input_ids[: lens.checks.identity_sequences],
                                                           cfg.patch_batch)
        with progress(f"{model}: patched passes", n_seq * len(layers), "seq x layer") as bar:
            block = cfg.kl_block_size(vocab_size(lm))
            for lo in range(0, n_seq, block):
                hi = min(n_seq, lo + block)
                blocks = {layer: layer_data(store.partition("activations", model, layer).seqs(lo, hi))
                          for layer in layers}
                orig = original_output(lm, input_ids[lo:hi], cfg.patch_batch, resume=(first, blocks[first].y_full),
                                       returns_tuple=returns_tuple)
                for layer in layers:
                    data = blocks.pop(layer)
                    fits = fits_from_table(store.partition("local_fits", model, layer).seqs(lo, hi), data)
                    rows[layer] += functional_rows(lm, data, fits, orig, cfg, returns_tuple, positions)
                    if lo == 0:
                        verdicts[f"{model}:{layer:02d}"] = checks.check_identity_patch(
                            lm, data, reference, cfg.patch_batch, returns_tuple, lens.checks)
                    bar.update(hi - lo)
                del orig
                reference = None  # the identity checks ran on the first block: its memory goes
        for layer in layers:
            prov = Provenance.of_rows(heads[layer], cfg, "functional_metrics")
            fm, fs = functional_tables_from_rows(rows.pop(layer), cfg, prov, layer)
            stored_fm = written.add(store.partition("functional_metrics", model, layer), fm)
            stored_fs = written.add(store.partition("functional_summary", model, layer), fs)
            docs = sample_docs(store.partition("activations", model, layer).read(["seq", "doc"]))
            written.add(store.partition("functional_bootstrap", model, layer),
                        functional_bootstrap_table(stored_fm, cfg, prov, layer, docs))
            for row in stored_fs.to_pylist():
                if row["variant"] == "patch":
                    written.note(model, layer, **{f"kl_mean_{row['fn_class']}": row["kl_mean"],
                                                  f"spearman_relerr_kl_{row['fn_class']}": row["spearman_relerr_kl"]})
            verdict = checks.check_functional(stored_fm, stored_fs, lens.checks)
            verdict.merge(verdicts[f"{model}:{layer:02d}"])
            verdicts[f"{model}:{layer:02d}"] = verdict
    return finish(store, cfg, written, outcomes=[
        checks.Outcome("functional_metrics", "functional_valid", verdicts, lens.checks)])
