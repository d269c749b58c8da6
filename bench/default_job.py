"""The default job of one model against its forward-pass floor and its memory target, as a record.

Run the default job with `--summary-json` and the floor bench of the same model in the same session
(nothing else running), then join them:

    python -m bench --only floor --model gemma3-270m --data-root /tmp/bench
    updatelens run --model gemma3-270m --summary-json /tmp/gemma.json
    python bench/default_job.py /tmp/gemma.json /tmp/bench/bench/bench_floor-gemma3-270m.json \
        bench/records/default_job-gemma3-270m.json

The record: the pipeline's wall time against the floor (target <= 1.3 x), its peak RSS (target
<= 3 GiB), and the floor's own records (the matmul rate it was measured at).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIME_RATIO_TARGET = 1.3
RSS_TARGET_GIB = 3.0


def record(summary: dict, floor: list[dict]) -> list[dict]:
    floor_s = next(r["value"] for r in floor if r["name"] == "default_job_forward_floor_s")
    ratio = summary["pipeline_s"] / floor_s
    where = (f"`updatelens run --model {summary['model']}` (config {summary['config_id']}, layers "
             f"{summary['layers'][0]}-{summary['layers'][-1]})")
    return [
        {"name": "default_job_wall_s", "value": summary["pipeline_s"], "unit": "s", "reference": floor_s,
         "ratio": ratio, "target": f"<= {TIME_RATIO_TARGET} x the forward-pass floor",
         "met": ratio <= TIME_RATIO_TARGET, "note": f"{where}; reference: its forward-pass floor, same session",
         "device": "cpu"},
        {"name": "default_job_peak_rss_gib", "value": summary["peak_rss_gib"], "unit": "GiB", "reference": None,
         "ratio": None, "target": f"<= {RSS_TARGET_GIB:g} GiB", "met": summary["peak_rss_gib"] <= RSS_TARGET_GIB,
         "note": where, "device": "cpu"},
        *floor,
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    summary = json.loads(Path(argv[0]).read_text())
    floor = json.loads(Path(argv[1]).read_text())
    rows = record(summary, floor)
    Path(argv[2]).write_text(json.dumps({"model": summary["model"], "records": rows}, indent=1) + "\n")
    for row in rows:
        print(f"{row['name']:32} {row['value']:10.2f} {row['unit']:8} ratio {row['ratio'] or '':<8} "
              f"target {row['target'] or '-'}  met {row['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
