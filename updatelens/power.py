"""Has any estimator the power to show finding 1 at this sample size? The calibration study's answer
(`updatelens.calibration`): at each sample size, class and k, how closely the fits recover the
self-and-first control, a layer that is tokenwise by construction and behaves like the real one. An
estimator that cannot bring that control to finding 1's threshold cannot show the real layer
tokenwise either, whatever the model does.

The rows come from the root's `calibration` view where the user ran `updatelens calibrate` for the
model, else from the record shipped for the default models (`updatelens/power/calibration-<model>.json`,
written by `bench/calibration_record.py` from such a run on the default's design: one window per
article). Light: polars and json only (the report and run printouts read it).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from updatelens.findings import BY_ID

POWER_DIR = Path(__file__).parent / "power"
CONTROL_TARGETS = ("self_first", "linear")  # the control the power is read on: self-and-first where measured
COLUMNS = ("layer", "n_tokens", "k", "fn_class", "target", "cos_full_tok_median", "finding_1")


def shipped_rows(model: str) -> pl.DataFrame | None:
    """The calibration rows shipped for `model` (None where no record ships)."""
    path = POWER_DIR / f"calibration-{model}.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    return pl.DataFrame(rows).select(COLUMNS) if rows else None


def _estimator(fn_class: str, k: int) -> str:
    return fn_class if k == 0 else f"{fn_class} k={k}"


def power_line(rows: pl.DataFrame, n_tokens: int, source: str) -> str:
    """One line on finding 1's power at a sample of `n_tokens` kept tokens, from calibration `rows`
    (COLUMNS). An estimator (class, k) recovers the control at a size when the control's cosine clears
    finding 1's threshold (its interval above it) at every measured layer; the sizes measured are the
    record's. The run's size is read as the largest measured size not above it (or the smallest)."""
    bound = BY_ID["1"].bound
    targets = [t for t in CONTROL_TARGETS if t in rows["target"].to_list()]
    if not targets:
        return f"finding 1's power: the calibration ({source}) measured no tokenwise control"
    target = targets[0]
    per = (rows.filter(pl.col("target") == target)
           .group_by("n_tokens", "fn_class", "k")
           .agg(pl.col("cos_full_tok_median").median().alias("cos"),
                (pl.col("finding_1") == "clears").all().alias("recovers"),
                pl.col("layer").unique().sort().alias("layers"))
           .sort("n_tokens", "cos", descending=[False, True]))
    sizes = sorted(per["n_tokens"].unique().to_list())
    at = max([s for s in sizes if s <= n_tokens * 1.05], default=sizes[0])
    layers = ", ".join(str(layer) for layer in sorted(rows["layer"].unique().to_list()))

    def best(size: int) -> dict:
        return per.filter(pl.col("n_tokens") == size).row(0, named=True)

    def recovering(size: int) -> list[str]:
        found = per.filter((pl.col("n_tokens") == size) & pl.col("recovers"))
        return [_estimator(r["fn_class"], r["k"]) for r in found.iter_rows(named=True)]

    head = (f"finding 1's power (calibration, {source}; the {target} control, layers {layers}, cos >= {bound:g} "
            f"needed at each): ")
    now = recovering(at)
    if now:
        return head + f"at {at:,} tokens (this run: {n_tokens:,}) {', '.join(now)} recover it"
    b = best(at)
    line = (head + f"at {at:,} tokens (this run: {n_tokens:,}) no estimator recovers it (best: "
            f"{_estimator(b['fn_class'], b['k'])}, median cos {b['cos']:.3f}); ")
    later = [s for s in sizes if s > at and recovering(s)]
    if later:
        return line + f"from {later[0]:,} tokens {', '.join(recovering(later[0]))} would"
    top = best(sizes[-1])
    return line + (f"none does up to {sizes[-1]:,} tokens, the largest measured (best there: "
                   f"{_estimator(top['fn_class'], top['k'])}, {top['cos']:.3f}); the exact split (estimator "
                   f"'exact') needs no estimator")
