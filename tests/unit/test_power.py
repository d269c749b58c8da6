"""Finding 1's power line, from planted calibration rows: the run's size, then the sizes above it."""

from __future__ import annotations

import polars as pl

from updatelens.power import power_line


def rows(recovering: dict[int, str]) -> pl.DataFrame:
    """Three layers, three sizes; lowrank k=64 and mlp; at the sizes named in `recovering`, that class
    clears 0.9 at every layer, elsewhere every control misses."""
    out = []
    for n_tokens in (2032, 8128, 32512):
        for layer in (3, 15, 27):
            for fn_class, k, cos in (("lowrank", 64, 0.70), ("mlp", 0, 0.74)):
                clears = recovering.get(n_tokens) == fn_class
                out.append({"layer": layer, "n_tokens": n_tokens, "k": k, "fn_class": fn_class, "target": "self_first",
                            "cos_full_tok_median": 0.95 if clears else cos, "finding_1": "clears" if clears else "misses"})
            out.append({"layer": layer, "n_tokens": n_tokens, "k": 64, "fn_class": "lowrank", "target": "real",
                        "cos_full_tok_median": 0.99, "finding_1": "clears"})  # the real update never counts
    return pl.DataFrame(out)


def test_no_estimator_at_the_runs_size_and_none_up_to_the_largest() -> None:
    line = power_line(rows({}), 2032, "planted")
    assert "at 2,032 tokens (this run: 2,032) no estimator recovers it (best: mlp, median cos 0.740)" in line
    assert "none does up to 32,512 tokens, the largest measured (best there: mlp, 0.740)" in line
    assert "the self_first control, layers 3, 15, 27" in line


def test_a_larger_size_that_would_have_the_power_is_named() -> None:
    line = power_line(rows({32512: "lowrank"}), 2032, "planted")
    assert "no estimator recovers it" in line and "from 32,512 tokens lowrank k=64 would" in line


def test_the_runs_size_is_the_largest_measured_not_above_it() -> None:
    assert "at 8,128 tokens (this run: 9,000) mlp recover it" in power_line(rows({8128: "mlp"}), 9000, "planted")
    assert "at 2,032 tokens (this run: 500)" in power_line(rows({}), 500, "planted")


def test_a_layer_that_misses_means_the_estimator_does_not_recover_it() -> None:
    planted = rows({2032: "mlp"}).with_columns(
        pl.when((pl.col("layer") == 15) & (pl.col("fn_class") == "mlp") & (pl.col("n_tokens") == 2032))
        .then(pl.lit("straddles")).otherwise(pl.col("finding_1")).alias("finding_1"))
    assert "no estimator recovers it" in power_line(planted, 2032, "planted")


def test_without_a_control_it_says_so() -> None:
    line = power_line(rows({}).filter(pl.col("target") == "real"), 2032, "planted")
    assert line.endswith("measured no tokenwise control")


def test_the_record_shipped_for_the_default_model_is_read() -> None:
    from updatelens.power import shipped_rows
    from updatelens.registry import DEFAULT_MODEL

    rows = shipped_rows(DEFAULT_MODEL)
    assert rows is not None and {"self_first", "real"} <= set(rows["target"].to_list())
    assert {"lowrank", "global_linear", "mlp"} <= set(rows["fn_class"].to_list())
    assert "the self_first control, layers 3, 15, 27" in power_line(rows, 2032, "shipped")
    assert shipped_rows("no-such-model") is None
