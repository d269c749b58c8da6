"""Stage 5: KL(p_orig || p_patched) with block l's output replaced by T(h_l), the controls, and
Spearman(error, KL)."""

import dagster as dg

from assets import checks
from assets.common import Written, each_model, finish, provenance_from, read_layer, read_upstream, stage_asset
from assets.geometry import geometry
from orchestration.resources import UpdateLensResource
from updatelens.analysis import functional_tables
from updatelens.capture import block_output_is_tuple
from updatelens.perturbation import original_output


@stage_asset(
    "Per token KL of the next-token distribution when block l's output is replaced by "
    "T(h_l) (residual removed), plus random-direction and cruder-class controls; per layer "
    "Spearman(error, KL) in table `functional_summary`.",
    kinds={"pytorch", "parquet"},
    deps=(geometry,),
    pool="model",
)
def functional_metrics(context: dg.AssetExecutionContext, lens: UpdateLensResource) -> dg.MaterializeResult:
    cfg = lens.config()
    written = Written()
    verdicts: dict[str, checks.Verdict] = {}
    for model, layers in each_model(context, lens.root):
        lm = lens.load(model)
        returns_tuple = block_output_is_tuple(lm)
        orig = None
        for layer in layers:
            act, data, fits = read_layer(lens.root, model, layer, cfg)
            read_upstream(lens.root, "geometry", model, layer, cfg)  # lineage and config check
            if orig is None:  # the sample is the same for every layer of the model
                orig = original_output(lm, data.input_ids, cfg.patch_batch)
            fm, fs = functional_tables(lm, data, fits, orig, cfg, provenance_from(act, cfg), returns_tuple)
            stored_fm = written.add(lens.root, "functional_metrics", model, layer, fm)
            stored_fs = written.add(lens.root, "functional_summary", model, layer, fs)
            for row in stored_fs.to_pylist():
                if row["variant"] == "patch":
                    written.note(model, layer, **{f"kl_mean_{row['fn_class']}": row["kl_mean"],
                                                  f"spearman_relerr_kl_{row['fn_class']}": row["spearman_relerr_kl"]})
            verdict = checks.check_functional(stored_fm, stored_fs, lens.checks)
            verdict.merge(checks.check_identity_patch(lm, data, orig, cfg.patch_batch, returns_tuple, lens.checks))
            verdicts[f"{model}:{layer:02d}"] = verdict
            context.log.info(f"{model} layer {layer}: patched forwards done")
    return finish(lens.root, cfg, written, check_results=[
        checks.result("functional_metrics", "functional_valid", verdicts, lens.checks)])
