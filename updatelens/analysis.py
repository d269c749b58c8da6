"""One layer, or a model, through every stage in memory: the notebook and the tests.

The stages' computations live in `updatelens.steps` (one module per stage); the Dagster assets stream
blocks of sequences through the same functions and storage. This module only composes them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from updatelens.capture import capture, self_first_layers
from updatelens.config import AnalysisConfig
from updatelens.corpus import Sample, make_sample
from updatelens.errors import CorpusError
from updatelens.linear_control import made_controls
from updatelens.models import LoadedModel, window_first_token
from updatelens.perturbation import OriginalOutput, original_output
from updatelens.registry import CorpusEntry
from updatelens.stages import TABLES
from updatelens.steps.activations import activations_table, held_out_maps, provenance, token_rows
from updatelens.steps.controls import CONTROL_TABLES, control_layer_tables
from updatelens.steps.functional_metrics import functional_bootstrap_table, functional_tables
from updatelens.steps.geometry import geometry_tables
from updatelens.steps.layer import LayerData, layer_data, sample_docs
from updatelens.steps.local_fits import compute_fits, fits_table
from updatelens.steps.residuals import residuals_table
from updatelens.tables import Provenance


@dataclass
class LayerResult:
    layer: int
    tables: dict[str, pa.Table]


def model_sample(lm: LoadedModel, corpus: CorpusEntry, cfg: AnalysisConfig) -> Sample:
    """The sample `updatelens run` analyses for this model and configuration: n_seq windows of seq_len
    tokens from the corpus (from cfg.corpus_offset, at most cfg.windows_per_doc per document), each
    starting with the model's window-first token (models.window_first_token)."""
    return make_sample(corpus, lm.tokenizer, cfg.n_seq, cfg.seq_len, cfg.corpus_offset, cfg.windows_per_doc,
                       window_first_token(lm.adapter, lm.tokenizer))


def held_out_sample(lm: LoadedModel, corpus: CorpusEntry, cfg: AnalysisConfig, sample: Sample) -> Sample:
    """The windows the linear control's map is fitted on: the n_seq windows after the sample, less any
    cut from a document the sample holds (so the map never saw the sample's articles; with the default
    one window per article, none is dropped)."""
    after = make_sample(corpus, lm.tokenizer, cfg.n_seq, cfg.seq_len, cfg.corpus_offset + cfg.n_seq,
                        cfg.windows_per_doc, window_first_token(lm.adapter, lm.tokenizer))
    keep = ~np.isin(after.doc_index, sample.doc_index)
    if not keep.any():
        raise CorpusError(f"the linear control fits its map on windows outside the sample; the {cfg.n_seq} windows "
                          f"after it ({after.slice_desc}) all come from the sample's documents")
    dropped = int((~keep).sum())
    return replace(after, input_ids=after.input_ids[keep], attention_mask=after.attention_mask[keep],
                   doc_index=after.doc_index[keep],
                   slice_desc=after.slice_desc + (f" less {dropped} windows of the sample's documents" if dropped else ""))


def analyse_layer(lm: LoadedModel, data: LayerData, orig: OriginalOutput, cfg: AnalysisConfig, prov: Provenance,
                  returns_tuple: bool = False, tables: Collection[str] = TABLES,
                  y_ctl: np.ndarray | None = None) -> dict[str, pa.Table]:
    """The tables of the stages after the capture for one layer, in memory, in the stages' order
    (updatelens.stages); only what `tables` asks for is built. The assets run the same steps stage by
    stage, streaming blocks of sequences through storage. `y_ctl` [n_seq, T, d]: the layer's
    self-and-first block outputs (the positive control; None where the architecture has none)."""
    fits, neighbours = compute_fits(data, cfg)
    out: dict[str, pa.Table] = {}
    if "local_fits" in tables:
        out["local_fits"] = fits_table(data, fits, neighbours, prov.for_stage("local_fits"))
    if "residuals" in tables:
        out["residuals"] = residuals_table(data, fits, prov.for_stage("residuals"))
    if {"geometry", "spectra", "geometry_bootstrap"} & set(tables):
        out["geometry"], out["spectra"], out["geometry_bootstrap"] = geometry_tables(data, fits, cfg, prov.for_stage("geometry"))
    if {"functional_metrics", "functional_summary", "functional_bootstrap"} & set(tables):
        fm, fs = functional_tables(lm, data, fits, orig, cfg, prov.for_stage("functional_metrics"), returns_tuple)
        out["functional_metrics"], out["functional_summary"] = fm, fs
        if "functional_bootstrap" in tables:
            out["functional_bootstrap"] = functional_bootstrap_table(fm, cfg, prov.for_stage("functional_metrics"),
                                                                     data.layer, sample_docs(data))
    if set(CONTROL_TABLES) & set(tables):
        out.update(control_layer_tables(data, y_ctl, neighbours, cfg, prov.for_stage("controls")))
    return {name: out[name] for name in TABLES if name in tables and name in out}


def analyse_model(lm: LoadedModel, sample: Sample, cfg: AnalysisConfig,
                  layers: list[int] | None = None, held_out: Sample | None = None) -> Iterator[LayerResult]:
    """Every stage for each layer, in memory, one layer at a time (for notebooks and tests). `held_out`
    (`held_out_sample`): the windows the linear control's map is fitted on, needed where that control
    is made (asked for, or standing in for the self-and-first one: Mamba)."""
    cfg.validate(d_model=lm.d_model, max_positions=lm.max_positions)
    prov = provenance(lm, sample, cfg)
    chosen = list(layers) if layers is not None else list(range(lm.n_layers))
    self_first = self_first_layers(lm, cfg.positive_controls, chosen, sample.first_token)
    maps: dict[int, np.ndarray] = {}
    if "linear" in made_controls(cfg.positive_controls, bool(self_first)):
        if held_out is None:
            raise ValueError("the linear control is made here: pass held_out=held_out_sample(lm, corpus, cfg, sample)")
        maps = held_out_maps(lm, held_out, chosen, cfg)
    cap = capture(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch, self_first=self_first,
                  sources=True)
    orig = original_output(lm, sample.input_ids, cfg.patch_batch)
    for layer in chosen:
        act = activations_table(cap, layer, cfg, prov, sample.doc_index, maps.get(layer))
        tables = {"activations": act, "tokens": token_rows(lm.tokenizer, sample.input_ids, layer, prov)}
        tables.update(analyse_layer(lm, layer_data(act), orig, cfg, prov, cap.block_returns_tuple,
                                    y_ctl=cap.self_first.get(layer)))
        yield LayerResult(layer, tables)
