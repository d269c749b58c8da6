"""What the calibration's additions cost the default job: the job with them against the job without
them, run one after the other in the same session on the same machine (nothing else running), as a
record. The additions: the positive control (`positive_controls`) and the effects of one position's
residual on the later positions (`later_positions`); the reference leaves out what `--set` removes.

    updatelens run --data-root /tmp/base --set 'positive_controls=[]' --set later_positions=0 \
        --summary-json /tmp/base.json
    updatelens run --data-root /tmp/new --summary-json /tmp/new.json
    python -m bench.controls_cost /tmp/base.json /tmp/new.json /tmp/base /tmp/new \
        bench/records/calibration_cost-smollm2-135m.json "positive_controls=[], later_positions=0"

(bench/records/controls_cost-smollm2-135m.json is the earlier record of the control alone.)

The record: the default job's wall time against the same job without the additions (target <= 1.5 x,
issue "Calibrated verdicts"), its peak RSS (target <= 3 GiB), and each run's step times (from each
root's own Dagster home), so the controls step and the capture's extra block passes show apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TIME_RATIO_TARGET = 1.5
RSS_TARGET_GIB = 3.0


def record(base: dict[str, Any], new: dict[str, Any], base_steps: list[dict], new_steps: list[dict],
           without: str = "positive_controls=[]") -> list[dict]:
    ratio = new["pipeline_s"] / base["pipeline_s"]
    where = f"`updatelens run --model {new['model']}` (config {new['config_id']}, layers {new['layers'][0]}-{new['layers'][-1]})"
    rows = [
        {"name": "default_job_with_controls_wall_s", "value": new["pipeline_s"], "unit": "s",
         "reference": base["pipeline_s"], "ratio": ratio, "target": f"<= {TIME_RATIO_TARGET} x the job with {without}",
         "met": ratio <= TIME_RATIO_TARGET,
         "note": f"{where}; reference: the same job with {without} (config {base['config_id']}), "
                 f"run just before it on the same machine", "device": "cpu"},
        {"name": "default_job_with_controls_peak_rss_gib", "value": new["peak_rss_gib"], "unit": "GiB",
         "reference": base["peak_rss_gib"], "ratio": new["peak_rss_gib"] / base["peak_rss_gib"],
         "target": f"<= {RSS_TARGET_GIB:g} GiB", "met": new["peak_rss_gib"] <= RSS_TARGET_GIB, "note": where,
         "device": "cpu"},
    ]
    before, after = per_step(base_steps), per_step(new_steps)
    for step, seconds in after.items():
        reference = before.get(step)
        rows.append({"name": f"step_{step}_s", "value": seconds, "unit": "s", "reference": reference,
                     "ratio": seconds / reference if reference else None, "target": "", "met": None,
                     "note": f"{where}: the {step} step (all layers); reference: the same step with "
                             f"{without}", "device": "cpu"})
    return rows


def per_step(steps: list[dict]) -> dict[str, float]:
    """Seconds per step name, summed over the runs of a root (the analysis, then its reports)."""
    total: dict[str, float] = {}
    for step in steps:
        total[step["step"]] = total.get(step["step"], 0.0) + float(step["seconds"])
    return total


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    from bench.driver import step_times
    from updatelens.orchestration.runner import root_dagster_home

    base, new = (json.loads(Path(name).read_text()) for name in argv[:2])
    base_steps, new_steps = (step_times(root_dagster_home(root)) for root in argv[2:4])
    rows = record(base, new, base_steps, new_steps, *argv[5:])
    Path(argv[4]).write_text(json.dumps({"model": new["model"], "records": rows,
                                         "reference_settings": argv[5] if len(argv) > 5 else "positive_controls=[]",
                                         "steps": {"without_controls": base_steps, "with_controls": new_steps}},
                                        indent=1) + "\n")
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{row['name']:40} {row['value']:10.2f} {row['unit']:4} ratio {ratio:>6}  target {row['target'] or '-'}"
              f"  met {row['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
