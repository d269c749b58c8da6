"""The default job of one model against its forward-pass floor and its memory target, as a record.

Run the default job with `--summary-json` and the floor bench of the same model in the same session
(nothing else running), then join them:

    python -m bench --only floor --model gemma3-270m --data-root /tmp/bench
    updatelens run --model gemma3-270m --summary-json /tmp/gemma.json
    python -m bench --only floor --model gemma3-270m --data-root /tmp/bench2   # again, after the run
    python -m bench.default_job /tmp/gemma.json \
        /tmp/bench/bench/bench_floor-gemma3-270m.json,/tmp/bench2/bench/bench_floor-gemma3-270m.json \
        bench/records/default_job-gemma3-270m.json [DATA_ROOT]

The record: the pipeline's wall time against the mean of the floors (target <= 1.3 x; SmolLM2's
<= 1.25 x), its peak RSS (target <= 3 GiB), and the floors' own records (the matmul rate each was
measured at). With the run's data root, also every step's time (from the root's own Dagster home)
and the time of the steps that hold no model (`updatelens.stages.MODEL_STEPS`: the fits, residuals,
geometry and reports) against the time the target leaves over the floor: where they alone take more, no
forward pass however fast meets the target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from updatelens.stages import MODEL_STEPS

TIME_RATIO_TARGETS = {"smollm2-135m": 1.25}  # issue targets; other models (Gemma 3 270M): 1.3
TIME_RATIO_TARGET = 1.3
RSS_TARGET_GIB = 3.0


def record(summary: dict, floors: list[list[dict]], steps: list[dict] | None = None) -> list[dict]:
    """`floors`: the floor bench's records, measured once or more in the same session (before and after
    the run: the machine's speed drifts); the reference is their mean."""
    values = [next(r["value"] for r in floor if r["name"] == "default_job_forward_floor_s") for floor in floors]
    floor_s = sum(values) / len(values)
    target = TIME_RATIO_TARGETS.get(summary["model"], TIME_RATIO_TARGET)
    ratio = summary["pipeline_s"] / floor_s
    where = (f"`updatelens run --model {summary['model']}` (config {summary['config_id']}, layers "
             f"{summary['layers'][0]}-{summary['layers'][-1]})")
    measured = " and ".join(f"{v:.1f} s" for v in values)
    return [
        {"name": "default_job_wall_s", "value": summary["pipeline_s"], "unit": "s", "reference": floor_s,
         "ratio": ratio, "target": f"<= {target} x the forward-pass floor",
         "met": ratio <= target, "note": f"{where}; reference: its forward-pass floor, same session "
                                         f"(the mean of {measured}, measured before and after the run)",
         "device": "cpu"},
        {"name": "default_job_peak_rss_gib", "value": summary["peak_rss_gib"], "unit": "GiB", "reference": None,
         "ratio": None, "target": f"<= {RSS_TARGET_GIB:g} GiB", "met": summary["peak_rss_gib"] <= RSS_TARGET_GIB,
         "note": where, "device": "cpu"},
        *[row for floor in floors for row in floor],
        *(step_records(steps, floor_s, target, where) if steps else []),
    ]


def step_records(steps: list[dict], floor_s: float, target: float, where: str) -> list[dict]:
    """Each step's seconds in the run, and the steps that hold no model against the margin the time
    target leaves over the forward-pass floor ((target - 1) x floor)."""
    rows = [{"name": f"default_job_step_{s['step']}_s", "value": s["seconds"], "unit": "s", "reference": None,
             "ratio": None, "target": "", "met": None, "note": f"{where}: the {s['step']} step", "device": "cpu"}
            for s in steps]
    model_free = [s for s in steps if s["step"] not in MODEL_STEPS]
    no_forward = sum(float(s["seconds"]) for s in model_free)
    margin = (target - 1) * floor_s
    rows.append({"name": "default_job_no_forward_steps_s", "value": no_forward, "unit": "s", "reference": margin,
                 "ratio": no_forward / margin, "target": "<= 1 for the time target to be reachable", "met": no_forward <= margin,
                 "note": f"{where}: the steps that run no model ({', '.join(s['step'] for s in model_free)}) against "
                         f"the time the target leaves over the forward-pass floor ({target - 1:.2f} x the floor)",
                 "device": "cpu"})
    return rows


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    summary = json.loads(Path(argv[0]).read_text())
    floors = [json.loads(Path(name).read_text()) for name in argv[1].split(",")]
    steps = None
    if len(argv) == 4:
        from bench.driver import step_times
        from updatelens.orchestration.runner import root_dagster_home

        steps = step_times(root_dagster_home(argv[3]))
    rows = record(summary, floors, steps)
    Path(argv[2]).write_text(json.dumps({"model": summary["model"], "records": rows, "steps": steps}, indent=1) + "\n")
    for row in rows:
        print(f"{row['name']:32} {row['value']:10.2f} {row['unit']:8} ratio {row['ratio'] or '':<8} "
              f"target {row['target'] or '-'}  met {row['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
