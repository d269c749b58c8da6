"""Stage 1: capture h_l and h_{l+1} for every requested layer with one forward pass per model.

The capture streams: each batch of sequences is appended to every requested layer's partition as
a row group, so memory holds one batch whatever the sample size or the number of layers; all the
partitions are committed together when the capture has finished (none appears if it fails).
"""

from contextlib import ExitStack

import pyarrow as pa

from updatelens.assets import checks
from updatelens.assets.common import StageRun, run_going, stage_asset
from updatelens.assets.resources import release_models
from updatelens.capture import capture_batches, self_first_layers
from updatelens.linear_control import made_controls
from updatelens.preflight import check_data_root
from updatelens.steps.activations import activation_rows, held_out_maps, provenance, token_rows


@stage_asset
def activations(run: StageRun) -> None:
    cfg, store, lens = run.cfg, run.store, run.lens
    check_data_root(store.root)
    for name in store.clean_abandoned_staging(run_going(run.context.instance)):
        run.context.log.info(f"removed staging dir {name} left by a crashed run")
    for model, layers in run.models():
        lm = lens.load(model)
        cfg.validate(d_model=lm.d_model, max_positions=lm.max_positions)
        bad = [layer for layer in layers if layer >= lm.n_layers]
        if bad:
            raise ValueError(f"{model} has {lm.n_layers} layers; partitions for layers {bad} cannot exist")
        sample = lens.sample(lm)
        run.context.log.info(f"{model}: capturing {sample.slice_desc} ({lm.n_layers} blocks, d={lm.d_model})")
        prov = provenance(lm, sample, cfg)
        self_first = self_first_layers(lm, cfg.positive_controls, layers, sample.first_token)
        maps = {}
        if "linear" in made_controls(cfg.positive_controls, bool(self_first)):  # one map per layer, fitted outside the sample
            held_out = lens.held_out_sample(lm, sample)
            run.context.log.info(f"{model}: fitting the linear control's map per layer on {held_out.slice_desc}")
            maps = held_out_maps(lm, held_out, layers, cfg)
        with ExitStack() as stack:
            sinks = {layer: stack.enter_context(store.partition("activations", model, layer).writer())
                     for layer in layers}
            token_sinks = {layer: stack.enter_context(store.partition("tokens", model, layer).writer())
                           for layer in layers}
            for batch in capture_batches(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch,
                                         last_block=max(layers), self_first=self_first, sources=True):
                text = token_rows(lm.tokenizer, batch.input_ids, 0, prov, batch.start)
                for layer, sink in sinks.items():
                    docs = sample.doc_index[batch.start : batch.start + len(batch.input_ids)]
                    sink.write(activation_rows(batch.states, batch.input_ids, batch.attention_mask, layer,
                                               cfg, prov, docs, batch.start, batch.self_first.get(layer),
                                               maps.get(layer), batch.sources.get(layer)))
                    token_sinks[layer].write(text.set_column(0, "layer", pa.array([layer] * len(text), pa.int32())))
        n_check = min(lens.checks.hidden_state_sequences, len(sample.input_ids))
        heads = {}
        for layer in layers:
            acts, tokens = store.partition("activations", model, layer), store.partition("tokens", model, layer)
            run.written.record(acts, sinks[layer].rows)
            run.written.record(tokens, token_sinks[layer].rows)
            run.written.note(model, layer, d_model=lm.d_model, n_tokens=sinks[layer].rows)
            verdict = run.judge("activations_valid", model, layer,
                                checks.check_activations(acts.parts(), cfg, lm.d_model, lens.checks))
            verdict.merge(checks.check_tokens(tokens.read(), acts.read(["seq", "pos", "token_id"]), cfg))
            heads[layer] = acts.seqs(0, n_check)
        for layer, verdict in checks.check_against_hidden_states(lm, sample.input_ids, heads, lens.checks).items():
            run.judge("activations_match_hidden_states", model, layer, verdict)
        run.extra["d_model"] = lm.d_model
        del lm
    release_models()  # the stages until the patched passes need no model
