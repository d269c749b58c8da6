"""Stage 5: KL(p_orig || p_patched) with block l's output replaced by T(h_l), the controls, and
Spearman(error, KL).

The stage streams over blocks of `kl_block` sequences (fewer where the vocabulary is large: see
AnalysisConfig.kl_block_size): a block's unpatched distributions are
computed once (resumed after the run's first layer from its captured output) and serve every
layer of the run, then dropped, so memory holds kl_block x seq_len
x vocabulary floats whatever the sample size; each layer's block of states and fits is read from
its partitions (row groups in sequence order) and only the per-token KL stays in memory.
"""

from dataclasses import dataclass, field

from updatelens.assets import checks
from updatelens.assets.checks import CheckSettings
from updatelens.assets.common import (
    StageRun,
    check_upstream,
    sample_index,
    stage_asset,
    stored_activations,
    stored_fits,
)
from updatelens.assets.resources import release_models
from updatelens.capture import block_output_is_tuple
from updatelens.models import LoadedModel
from updatelens.perturbation import OriginalOutput, original_output, vocab_size
from updatelens.steps.functional_metrics import (
    Measure,
    functional_bootstrap_table,
    functional_tables_from_rows,
    stream_functional,
)
from updatelens.steps.layer import LayerData, sample_docs
from updatelens.tables import Provenance


@stage_asset
def functional_metrics(run: StageRun) -> None:
    cfg, store, settings = run.cfg, run.store, run.lens.checks
    for model, layers in run.models():
        lm = run.lens.load(model)
        returns_tuple = block_output_is_tuple(lm)
        heads = {}
        for layer in layers:  # configuration and lineage of every input, before any heavy work
            heads[layer] = check_upstream(store, "activations", model, layer, cfg)
            check_upstream(store, "local_fits", model, layer, cfg)
        input_ids, kept = sample_index(store, model, layers[0])
        # the checks patch the first block of sequences only, so the reference covers no more of them
        # (Gemma: 1 sequence, 128 MiB of log-probabilities, not 2)
        checked = min(settings.identity_sequences, cfg.kl_block_size(vocab_size(lm)))
        identity = IdentityChecks(lm, original_output(lm, input_ids[:checked], cfg.patch_batch),
                                  cfg.patch_batch, returns_tuple, settings, layers[-1])
        measures = [Measure(layer, cfg, stored_fits(store, model, layer)) for layer in layers]
        found = stream_functional(lm, input_ids, kept, measures, stored_activations(store, model), cfg, returns_tuple,
                                  f"{model}: patched passes", identity)
        rows = dict(zip(layers, found))
        for layer in layers:
            prov = Provenance.of_rows(heads[layer], cfg, "functional_metrics")
            fm, fs = functional_tables_from_rows(rows.pop(layer), cfg, prov, layer)
            stored_fm = run.written.add(store.partition("functional_metrics", model, layer), fm)
            stored_fs = run.written.add(store.partition("functional_summary", model, layer), fs)
            docs = sample_docs(store.partition("activations", model, layer).read(["seq", "doc"]))
            run.written.add(store.partition("functional_bootstrap", model, layer),
                            functional_bootstrap_table(stored_fm, cfg, prov, layer, docs))
            for row in stored_fs.to_pylist():
                if row["variant"] == "patch":
                    run.written.note(model, layer, **{f"kl_mean_{row['fn_class']}": row["kl_mean"],
                                                      f"spearman_relerr_kl_{row['fn_class']}": row["spearman_relerr_kl"]})
            verdict = checks.check_functional(stored_fm, stored_fs, settings)
            verdict.merge(identity.verdicts[layer])
            run.judge("functional_valid", model, layer, verdict)
        del lm, identity
    release_models()  # before the commit and the catalog's refresh


@dataclass
class IdentityChecks:
    """Each layer's identity patch on its first block, against `reference`, a full forward of the first
    sequences (the unpatched passes resume after a block: this checks they give the model's output);
    the reference's memory goes after the last layer's check."""

    lm: LoadedModel
    reference: OriginalOutput | None
    patch_batch: int
    returns_tuple: bool
    settings: CheckSettings
    last_layer: int
    verdicts: dict[int, checks.Verdict] = field(default_factory=dict)

    def __call__(self, layer: int, data: LayerData) -> None:
        assert self.reference is not None, "the identity checks run on each layer's first block only"
        self.verdicts[layer] = checks.check_identity_patch(self.lm, data, self.reference, self.patch_batch,
                                                           self.returns_tuple, self.settings)
        if layer == self.last_layer:
            self.reference = None
