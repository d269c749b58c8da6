"""The calibration study of one model as a kept record: every row of the `calibration` view (layer,
sample size, k, class, target: the real update or a positive control; median relative error and
cos(Δ_full, Δ_tok) with their intervals over documents; where the cosine lies against finding 1's
threshold), with the settings and the study's wall time and peak memory.

On the default's design (one window per article; 16, 64 and 96 articles, the embedded corpus holding
105 of at least 128 tokens):

    updatelens calibrate --model smollm2-135m --data-root /tmp/cal --layers 3,15,27 \
        --tokens 2048,8192,12288 | tee /tmp/cal.log
    python -m bench.calibration_record /tmp/cal smollm2-135m /tmp/cal.log updatelens/power/calibration-smollm2-135m.json \
        ["a note on the run, e.g. what else ran beside it"]

The record ships with the package: `updatelens run` and `updatelens report` read finding 1's power
from it where the root holds no calibration of the model (updatelens.power).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    note = argv[4] if len(argv) == 5 else ""  # e.g. what else ran beside the study
    from updatelens.storage import catalog

    root, model, log, out = argv[:4]
    rows = catalog.query(root, "SELECT layer, n_tokens, n_seq, n_docs, k, fn_class, target, n_anchors, rel_err_median, "
                               "rel_err_lo, rel_err_hi, cos_full_tok_median, cos_lo, cos_hi, finding_1, corpus_slice, "
                               "config_id, code_version FROM calibration WHERE model = $1 "
                               "ORDER BY layer, n_tokens, k, fn_class, target", [model])
    if rows.is_empty():
        print(f"no calibration rows for {model!r} under {root}", file=sys.stderr)
        return 2
    timing = re.search(r"calibrate wall time ([\d.]+) s, peak RSS ([\d.]+) GiB", Path(log).read_text())
    record = {"model": model, "wall_s": float(timing.group(1)) if timing else None,
              "peak_rss_gib": float(timing.group(2)) if timing else None, "device": "cpu", "note": note,
              "rows": rows.to_dicts()}
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(rows)} rows written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
