"""Stage 1, activations: a capture's transitions and tokens as rows (the asset streams batches of
sequences through `activation_rows` and `token_rows`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from updatelens.capture import Captured, capture_batches, kept_mask
from updatelens.config import AnalysisConfig
from updatelens.context_sources import SourceAttribution
from updatelens.corpus import Sample
from updatelens.linear_control import HeldOutMaps, linear_outputs
from updatelens.models import LoadedModel
from updatelens.steps.layer import source_columns
from updatelens.tables import Provenance, vector_column, with_provenance


def held_out_maps(lm: LoadedModel, held_out: Sample, layers: list[int], cfg: AnalysisConfig) -> dict[int, np.ndarray]:
    """The linear control's B per layer: the ridge regression of h_{l+1} - h_l on h_l over the kept
    tokens of the held-out windows (`corpus.held_out_sample`), one capture streamed batch by batch."""
    maps = HeldOutMaps(layers, lm.d_model)
    for batch in capture_batches(lm, held_out.input_ids, held_out.attention_mask, cfg.capture_batch,
                                 last_block=max(layers)):
        kept = kept_mask(batch.attention_mask, cfg.skip_first_position)
        maps.rows += int(kept.sum())
        for layer in layers:
            maps.add(layer, batch.states[layer][kept], batch.states[layer + 1][kept])
    return maps.maps(cfg.ridge)


def provenance(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig) -> Provenance:
    prov = Provenance.of(lm.slug, lm.revision, sample.corpus, sample.slice_desc, cfg, lm.n_layers, lm.weights)
    return prov.for_stage("activations")



def activation_rows(states: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray, layer: int,
                    cfg: AnalysisConfig, prov: Provenance, docs: np.ndarray, seq_offset: int = 0,
                    self_first: np.ndarray | None = None, linear_map: np.ndarray | None = None,
                    sources: SourceAttribution | None = None) -> pa.Table:
    """Transition l for a batch of sequences: x = h_l, y = h_{l+1}, every position (kept flags the
    ones in statistics). `states` [L+1, b, T, d]; the rows are sequences seq_offset.. of the sample,
    `docs` [b] the document each was cut from; `self_first` [b, T, d]: block l with each token
    attending to itself and the window's first position (null where not made: an architecture without attention, or not asked);
    `linear_map` [d, d]: the linear control's B, fitted on held-out windows (`y_lin` = x + xB; null where not made);
    `sources`: where the context part a = y - y_ctl comes from (`ctx_*`, `attn_mass`, `top_source_*`; null where
    not made)."""
    n_seq, seq_len = input_ids.shape
    kept = kept_mask(attention_mask, cfg.skip_first_position)
    d = states.shape[-1]
    cols = {
        "seq": pa.array(np.repeat(np.arange(seq_offset, seq_offset + n_seq), seq_len), pa.int32()),
        "doc": pa.array(np.repeat(np.asarray(docs), seq_len), pa.int32()),
        "pos": pa.array(np.tile(np.arange(seq_len), n_seq), pa.int32()),
        "token_id": pa.array(input_ids.reshape(-1), pa.int64()),
        "attention_mask": pa.array(attention_mask.reshape(-1), pa.int8()),
        "kept": pa.array(kept.reshape(-1)),
        "x": vector_column(states[layer].reshape(-1, d)),
        "y": vector_column(states[layer + 1].reshape(-1, d)),
        "y_ctl": (vector_column(self_first.reshape(-1, d)) if self_first is not None
                   else pa.nulls(n_seq * seq_len, pa.list_(pa.float32(), d))),
        "y_lin": (vector_column(linear_outputs(states[layer].reshape(-1, d), linear_map)) if linear_map is not None
                  else pa.nulls(n_seq * seq_len, pa.list_(pa.float32(), d))),
        **source_columns(sources, n_seq * seq_len),
    }
    return with_provenance(cols, prov, layer)


CONTEXT_TOKENS = 8  # the left context of a token in the tokens table: it and the 7 before it


def token_rows(tokenizer: object, input_ids: np.ndarray, layer: int, prov: Provenance, seq_offset: int = 0,
               context: int = CONTEXT_TOKENS) -> pa.Table:
    """Which text each (seq, pos) of a batch is: the token decoded alone and a short left context
    ending with it (the `context` tokens up to and including it), so SQL answers with words."""
    n_seq, seq_len = input_ids.shape
    ids = input_ids.tolist()
    windows = [row[max(0, p - context + 1) : p + 1] for row in ids for p in range(seq_len)]
    decode = tokenizer.batch_decode  # type: ignore[attr-defined]
    cols = {
        "seq": pa.array(np.repeat(np.arange(seq_offset, seq_offset + n_seq), seq_len), pa.int32()),
        "pos": pa.array(np.tile(np.arange(seq_len), n_seq), pa.int32()),
        "token_id": pa.array(input_ids.reshape(-1), pa.int64()),
        "token": pa.array(decode([[t] for t in input_ids.reshape(-1).tolist()]), pa.string()),
        "context": pa.array(decode(windows), pa.string()),
    }
    return with_provenance(cols, prov, layer)


def activations_table(cap: Captured, layer: int, cfg: AnalysisConfig, prov: Provenance, docs: np.ndarray,
                      linear_map: np.ndarray | None = None) -> pa.Table:
    """Transition l of a whole in-memory capture (notebooks, tests); `docs`: the sample's doc_index;
    `linear_map`: the linear control's B for this layer (`held_out_maps`)."""
    return activation_rows(cap.states, cap.input_ids, cap.attention_mask, layer, cfg, prov, docs,
                           self_first=cap.self_first.get(layer), linear_map=linear_map, sources=cap.sources.get(layer))
