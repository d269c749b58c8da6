"""What a piece of work costs the default job: the job on this code against the same job on the code
before the work (a commit checked out in its own worktree and virtual environment), run one after the
other on the same machine with nothing else running, as a record.

    git worktree add /work/base f7eb09e && make -C /work/base install
    (cd /work/base && updatelens run --model gemma3-270m --no-report --data-root /tmp/base --summary-json /tmp/base.json)
    updatelens run --model gemma3-270m --no-report --data-root /tmp/new --summary-json /tmp/new.json
    python -m bench.code_cost /tmp/base.json /tmp/new.json /tmp/base /tmp/new \
        bench/records/yardsticks_cost-gemma3-270m.json f7eb09e 1.25

The record: the job's wall time against the earlier code's (the target ratio given), the peak RSS of
each (target <= 3 GiB) and each step's time on both (from each root's own Dagster home).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.controls_cost import per_step

RSS_TARGET_GIB = 3.0


def record(base: dict[str, Any], new: dict[str, Any], base_steps: list[dict], new_steps: list[dict],
           base_code: str, target: float) -> list[dict]:
    where = f"`updatelens run --model {new['model']}` (config {new['config_id']}, layers {new['layers'][0]}-{new['layers'][-1]})"
    reference = f"the same job on the code of {base_code} (config {base['config_id']}), run beside it on the same machine"
    ratio = new["pipeline_s"] / base["pipeline_s"]
    rows = [
        {"name": "default_job_wall_s", "value": new["pipeline_s"], "unit": "s", "reference": base["pipeline_s"],
         "ratio": ratio, "target": f"<= {target:g} x the job on {base_code}", "met": ratio <= target,
         "note": f"{where}; reference: {reference}", "device": "cpu"},
        {"name": "default_job_peak_rss_gib", "value": new["peak_rss_gib"], "unit": "GiB",
         "reference": base["peak_rss_gib"], "ratio": new["peak_rss_gib"] / base["peak_rss_gib"],
         "target": f"<= {RSS_TARGET_GIB:g} GiB", "met": new["peak_rss_gib"] <= RSS_TARGET_GIB,
         "note": f"{where}; reference: {reference}", "device": "cpu"},
    ]
    before, after = per_step(base_steps), per_step(new_steps)
    for step in sorted(set(before) | set(after)):
        seconds, earlier = after.get(step), before.get(step)
        rows.append({"name": f"step_{step}_s", "value": seconds, "unit": "s", "reference": earlier,
                     "ratio": seconds / earlier if seconds is not None and earlier else None, "target": "",
                     "met": None, "note": f"{where}: the {step} step (all layers); reference: the same step on "
                                          f"{base_code}", "device": "cpu"})
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 7:
        print(__doc__, file=sys.stderr)
        return 2
    from bench.driver import step_times
    from updatelens.orchestration.runner import root_dagster_home

    base, new = (json.loads(Path(name).read_text()) for name in argv[:2])
    base_steps, new_steps = (step_times(root_dagster_home(root)) for root in argv[2:4])
    rows = record(base, new, base_steps, new_steps, argv[5], float(argv[6]))
    Path(argv[4]).write_text(json.dumps({"model": new["model"], "base_code": argv[5], "records": rows,
                                         "steps": {"base": base_steps, "new": new_steps}}, indent=1) + "\n")
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        value = f"{row['value']:10.2f}" if row["value"] is not None else f"{'-':>10}"
        print(f"{row['name']:40} {value} {row['unit']:4} ratio {ratio:>6}  target {row['target'] or '-'}  met {row['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
