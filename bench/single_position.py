"""What the exact single-position effects cost against patching every position at once, on the
default job's data and settings (SmolLM2, the default 16 x 128-token sample, the default classes
and controls: 4 patched versions of a layer's output), at the first, middle and last layers.

Both measure the same 4 variants over the same sequences with the product's batch sizes: patch-all
runs 4 patched streams (patch_batch rows per pass), the exact single-position effects run those 4
plus the unpatched stream in one batch (updatelens.single_position). Each timing is the median of 3
runs in this process, nothing else running. Writes a JSON record:

    python bench/single_position.py bench/records/single_position-smollm2.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from updatelens.capture import capture
from updatelens.config import AnalysisConfig
from updatelens.corpus import make_sample
from updatelens.models import load_model
from updatelens.perturbation import Variant, original_output, patched_kl
from updatelens.registry import DEFAULT_CORPUS, DEFAULT_MODEL, get_corpus, get_model
from updatelens.single_position import all_single_position_kl


def median_time(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(out: Path) -> None:
    cfg = AnalysisConfig()
    lm = load_model(get_model(DEFAULT_MODEL))
    sample = make_sample(get_corpus(DEFAULT_CORPUS), lm.tokenizer, cfg.n_seq, cfg.seq_len, 0, cfg.windows_per_doc)
    cap = capture(lm, sample.input_ids, sample.attention_mask, cfg.capture_batch)
    orig = original_output(lm, sample.input_ids, cfg.patch_batch)
    rng = np.random.default_rng(0)
    record: dict[str, object] = {"model": lm.slug, "n_seq": cfg.n_seq, "seq_len": cfg.seq_len, "variants": 4,
                                 "torch_threads": torch.get_num_threads(), "layers": {}}
    for layer in (0, lm.n_layers // 2, lm.n_layers - 1):
        y = cap.states[layer + 1]
        update = np.linalg.norm(y - cap.states[layer], axis=-1, keepdims=True)
        variants = []
        for i in range(4):  # residual-sized perturbations, like the patch and its controls
            noise = rng.standard_normal(y.shape).astype(np.float32)
            variants.append(Variant(f"v{i}", "-", y + 0.3 * update * noise / np.linalg.norm(noise, axis=-1, keepdims=True)))
        every = median_time(lambda at=layer, vs=variants: patched_kl(lm, sample.input_ids, at, vs, orig, cfg.patch_batch))
        exact = median_time(lambda at=layer, vs=variants, out=y: all_single_position_kl(lm, sample.input_ids, at, vs, out,
                                                                                         orig, cfg.patch_batch * 2))
        record["layers"][str(layer)] = {"patch_all_s": round(every, 3), "exact_single_s": round(exact, 3),  # type: ignore[index]
                                        "ratio": round(exact / every, 3), "target": "<= 1.5"}
        print(f"layer {layer}: patch-all {every:.2f} s, exact single-position {exact:.2f} s, ratio {exact / every:.2f}",
              flush=True)
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
