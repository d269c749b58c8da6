"""How long `updatelens sql` takes beside plain DuckDB on the same catalog: a measurement, run by hand
on an idle machine after `make run` (the default root).

Each query is answered in a fresh process, as a user typing the command gets it: `updatelens sql
QUERY` against `python -c "import duckdb; duckdb.connect(CATALOG, read_only=True).sql(QUERY).fetchall()"`
on the catalog file the command keeps under the root, alternated, `--reps` times each; the record
gives the medians and their ratio. The catalog is brought up to date first (one `updatelens sql`), so
what is timed is the answer, not a first build. Targets (issue "One definition of everything"):
`SELECT 1` <= 1 s and the README's findings query <= 1.5 s.

    python -m bench.sql_latency --data-root data bench/records/sql_latency-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from updatelens import CODE_VERSION
from updatelens.storage.catalog import catalog_path

QUERIES = {
    "select_1": "SELECT 1",
    # the README's findings query
    "findings": "SELECT finding, fn_class, value, ci_lo, ci_hi, threshold, null_value, verdict FROM findings",
}
DUCKDB = "import duckdb, sys; duckdb.connect(sys.argv[1], read_only=True).sql(sys.argv[2]).fetchall()"


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed: {done.stderr.strip()}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data-root", type=Path, default=Path("data"))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    catalog = catalog_path(args.data_root)
    sql = [sys.executable, "-m", "updatelens.orchestration.cli", "sql", "--data-root", str(args.data_root)]
    wall([*sql, "SELECT 1"])  # the catalog brought up to date
    assert catalog is not None and catalog.exists(), f"no catalog under {args.data_root}"
    record: dict[str, object] = {"code_version": CODE_VERSION, "python": platform.python_version(),
                                 "cpus": os.cpu_count(), "reps": args.reps, "data_root": str(args.data_root),
                                 "queries": {}}
    for name, query in QUERIES.items():
        ours, plain = [], []
        for _ in range(args.reps):  # alternated: a slow moment of the machine hits both
            ours.append(wall([*sql, query]))
            plain.append(wall([sys.executable, "-c", DUCKDB, str(catalog), query]))
        row = {"query": query, "updatelens_sql_s": [round(t, 3) for t in ours],
               "plain_duckdb_s": [round(t, 3) for t in plain],
               "updatelens_sql_median_s": round(statistics.median(ours), 3),
               "plain_duckdb_median_s": round(statistics.median(plain), 3),
               "ratio": round(statistics.median(ours) / statistics.median(plain), 2)}
        record["queries"][name] = row  # type: ignore[index]
        print(f"{name}: updatelens sql {row['updatelens_sql_median_s']} s, plain duckdb "
              f"{row['plain_duckdb_median_s']} s (x{row['ratio']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
