"""GX suites: each result is attributed to its expectation by configuration, whatever order GX
returns them in."""

from __future__ import annotations

import pandas as pd
import pytest

from updatelens.assets.expectations import Expect, between, row_count, validate

FRAME = pd.DataFrame({"seq": [0, 0, 1], "pos": [1, 2, 1], "kl": [0.1, -0.5, 0.2], "rel_err": [0.3, 0.4, 0.5]})
EXPECTATIONS = [row_count(3), *between("rel_err", 0.0, 1.0), *between("kl", 0.0)]


def test_the_failing_expectation_is_the_one_named() -> None:
    verdict = validate(FRAME, EXPECTATIONS)
    assert verdict.failures == ["ExpectColumnValuesToBeBetween(kl, min_value=0.0) failed: 1 unexpected rows"]
    assert verdict.offenders == [{"expectation": "ExpectColumnValuesToBeBetween", "seq": 0, "pos": 2, "kl": -0.5}]
    assert len(verdict.evaluated) == len(EXPECTATIONS)


def test_results_in_another_order_are_attributed_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Matching by position would blame rel_err's range for kl's failure once GX reorders its results."""
    from great_expectations.datasource.fluent.interfaces import Batch

    original = Batch.validate

    def reversed_results(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = original(self, *args, **kwargs)
        result.results = list(reversed(result.results))
        return result

    monkeypatch.setattr(Batch, "validate", reversed_results)
    verdict = validate(FRAME, EXPECTATIONS)
    assert verdict.failures == ["ExpectColumnValuesToBeBetween(kl, min_value=0.0) failed: 1 unexpected rows"]


def test_an_expectation_without_a_result_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from great_expectations.datasource.fluent.interfaces import Batch

    original = Batch.validate

    def dropped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = original(self, *args, **kwargs)
        result.results = [r for r in result.results if r.expectation_config.type != "expect_table_row_count_to_equal"]
        return result

    monkeypatch.setattr(Batch, "validate", dropped)
    verdict = validate(FRAME, [Expect("ExpectTableRowCountToEqual", {"value": 3}), *between("rel_err", 0.0)])
    assert verdict.failures == ["ExpectTableRowCountToEqual(value=3): GX returned no result for it"]


def test_geometry_values_missing_or_out_of_range_are_named_by_row_and_column() -> None:
    import numpy as np
    import pyarrow as pa

    from updatelens.assets.checks import check_geometry

    n = 6
    geometry = pa.table({"fn_class": ["lowrank"] * n, "seq": list(range(n)), "pos": [1] * n,
                         "cos_full_tok": [0.5, np.nan, 0.2, 0.1, 0.3, 0.4],
                         "angle_full_res": [10.0, 20.0, 200.0, 30.0, 40.0, 50.0],
                         "proj_res_m16": [0.1] * n})
    spectra = pa.table({"fn_class": ["lowrank"] * 2, "which": ["res"] * 2, "idx": [0, 1], "sigma": [2.0, 1.0],
                        "cum_energy": [0.8, 1.0]})
    verdict = check_geometry(geometry, spectra, n, ["lowrank"])
    assert not verdict.passed and len(verdict.failures) == 1 and "out_of_range" in verdict.failures[0]
    named = {(o["seq"], o["out_of_range"]) for o in verdict.offenders}
    assert named == {(1, "cos_full_tok"), (2, "angle_full_res")}
    fine = geometry.set_column(3, "cos_full_tok", pa.array([0.5] * n)).set_column(4, "angle_full_res", pa.array([9.0] * n))
    assert check_geometry(fine, spectra, n, ["lowrank"]).passed


def test_a_blown_up_fit_is_told_from_a_token_with_a_massive_update() -> None:
    """no_blown_up_fits: a residual 1.5 x its own update of 7 x the layer's 99th percentile (what Gemma 3
    270M's layer 4 stores for a massive-activation token) is a poor fit, not a blown one; a residual
    1,000 x the layer's updates is."""
    import numpy as np
    import pyarrow as pa

    from updatelens.assets.checks import CheckSettings, check_blown_up_fits

    rng = np.random.default_rng(0)
    n = 2000
    full = rng.uniform(100, 1000, n)
    res = full * rng.uniform(0.3, 1.0, n)
    full[5], res[5] = 7 * np.quantile(full, 0.99), 1.5 * 7 * np.quantile(full, 0.99)  # massive update, poor fit

    def table(res: np.ndarray) -> pa.Table:
        return pa.table({"fn_class": ["lowrank"] * n, "seq": np.arange(n) // 100, "pos": np.arange(n) % 100,
                         "norm_full": full, "norm_res": res})

    assert check_blown_up_fits(table(res), CheckSettings()).passed
    blown = res.copy()
    blown[7] = 1e3 * full.max()
    verdict = check_blown_up_fits(table(blown), CheckSettings())
    assert not verdict.passed and verdict.offenders[0]["seq"] == 0 and verdict.offenders[0]["pos"] == 7


def test_the_fits_against_the_exact_split_are_all_null_or_all_present_and_in_range() -> None:
    """The geometry's cos(r, a), share and cos(Δ_tok, Δ_ctl): null on every row where no self-and-first
    output was captured (passes); a row missing among present ones, or a share above 1, fails."""
    import pyarrow as pa

    from updatelens.assets.checks import check_geometry

    n = 4
    base = {"fn_class": ["lowrank"] * n, "seq": list(range(n)), "pos": [1] * n, "cos_full_tok": [0.5] * n}
    spectra = pa.table({"fn_class": ["lowrank"], "which": ["res"], "idx": [0], "sigma": [1.0], "cum_energy": [1.0]})
    absent = pa.table({**base, **{c: pa.nulls(n, pa.float64()) for c in ("cos_res_ctx", "res_share_ctx", "cos_tok_ctl")}})
    assert check_geometry(absent, spectra, n, ["lowrank"]).passed
    present = {"cos_res_ctx": [0.3, -0.2, 0.9, 0.1], "res_share_ctx": [0.09, 0.04, 0.81, 0.01], "cos_tok_ctl": [0.5] * n}
    assert check_geometry(pa.table({**base, **present}), spectra, n, ["lowrank"]).passed
    holed = pa.table({**base, **present, "cos_res_ctx": [0.3, None, 0.9, 0.1], "res_share_ctx": [0.09, 0.04, 1.5, 0.01]})
    verdict = check_geometry(holed, spectra, n, ["lowrank"])
    assert not verdict.passed
    assert {(o["seq"], o["out_of_range"]) for o in verdict.offenders} == {(1, "cos_res_ctx"), (2, "res_share_ctx")}
