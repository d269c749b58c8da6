"""The findings view against a hand computation on a small fixture written as Parquet partitions."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import scipy.stats

from updatelens import findings, views
from updatelens.findings import GEOMETRY_STATISTICS
from updatelens.storage import catalog
from updatelens.storage.layout import convergence_root, sweep_root, write_partition, write_sweep_run
from updatelens.views import t975_sql

LAYERS, CLASSES, TOKENS = 6, ("diagonal", "lowrank"), 5
MIDDLE, OUTER = [2, 3], [0, 1, 4, 5]  # the thirds of a 6-layer model
PROV = {"config_id": "c1", "model_revision": "r", "weights": "GGUF Q4_1 dequantized to float32", "corpus_slice": "s",
        "k": 8, "rank": 2, "dtype": "float64", "code_version": "v"}


def context_columns(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """The geometry's columns of the estimator against the exact split (geometry.CONTEXT_COLUMNS)."""
    cos_res_ctx = rng.uniform(-1, 1, n)
    return {"cos_res_ctx": cos_res_ctx, "res_share_ctx": cos_res_ctx ** 2, "cos_tok_ctl": rng.uniform(-1, 1, n)}


def by_layer(root: Path, sql: str) -> dict[int, pa.Table]:
    """Each layer's rows of one query, all read before anything is written: a query after a write
    verifies the root and rebuilds its views anew (half a second each)."""
    whole = catalog.query(root, sql).to_arrow()
    return {layer: whole.filter(pc.equal(whole["layer"], layer)) for layer in range(LAYERS)}


def fixture(root: Path, config_id: str = "c1", seed: int = 0, n_seq: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    extra = np.random.default_rng(seed + 1)  # columns no finding reads: drawn apart, the others' draws unchanged
    prov = {**PROV, "config_id": config_id, "config_json": json.dumps({"n_seq": n_seq, "seq_len": 128})}
    values: dict[str, np.ndarray] = {}
    for c_i, fn_class in enumerate(CLASSES):
        shape = (LAYERS, TOKENS)
        values[f"rel_err/{fn_class}"] = rng.uniform(0.2, 0.6, shape) + 0.3 * (1 - c_i)  # lowrank is better
        values[f"cos/{fn_class}"] = rng.uniform(0.3, 1.0, shape)
        values[f"cos_map/{fn_class}"] = rng.uniform(0.8, 1.0, shape)
        values[f"angle/{fn_class}"] = rng.uniform(10, 120, shape)
        values[f"angle_tok/{fn_class}"] = rng.uniform(10, 120, shape)
        values[f"proj_res/{fn_class}"] = rng.uniform(0, 0.5, shape)
        values[f"rho/{fn_class}"] = rng.uniform(-0.2, 0.9, LAYERS)
        values[f"rho_norm/{fn_class}"] = rng.uniform(-0.2, 0.9, LAYERS)
        for which in ("tok", "full", "res", "full_null", "res_null"):
            values[f"rank_{which}/{fn_class}"] = rng.uniform(5, 50, LAYERS) * (3 if "res" in which else 1)
        for name in NULL_COLUMNS:
            values[f"{name}/{fn_class}"] = rng.uniform(0, 90, shape) if "angle" in name else rng.uniform(0, 1, shape)
        values[f"rho_null/{fn_class}"] = rng.uniform(-0.2, 0.9, LAYERS)
        values[f"rho_norm_null/{fn_class}"] = rng.uniform(-0.2, 0.9, LAYERS)
        values[f"ratio/{fn_class}"] = rng.uniform(0.5, 3.0, LAYERS)
        for which in ("tok", "full", "res", "full_null", "res_null"):  # the centred spectra's: drawn apart
            values[f"rank_{which}_centred/{fn_class}"] = extra.uniform(5, 50, LAYERS) * (3 if "res" in which else 1)
    for layer in range(LAYERS):
        geo, fs, spec = [], [], []
        for fn_class in CLASSES:
            n = TOKENS
            geo.append(pa.table({
                "model": ["m"] * n, "layer": pa.array([layer] * n, pa.int32()), "fn_class": [fn_class] * n,
                "rel_err": values[f"rel_err/{fn_class}"][layer], "cos_full_tok": values[f"cos/{fn_class}"][layer],
                "cos_full_tok_map": values[f"cos_map/{fn_class}"][layer], "cos_full_res": np.zeros(n),
                "angle_full_res": values[f"angle/{fn_class}"][layer],
                "angle_tok_res": values[f"angle_tok/{fn_class}"][layer], "proj_full_m16": np.zeros(n),
                "proj_tok_m16": np.zeros(n), "proj_res_m16": values[f"proj_res/{fn_class}"][layer],
                "m90_tok": pa.array([1] * n, pa.int32()), "model_layers": pa.array([LAYERS] * n, pa.int32()),
                **{name: values[f"{name}/{fn_class}"][layer] for name in NULL_COLUMNS},
                **context_columns(extra, n),
                **{k: [v] * n for k, v in prov.items()}}))
            fs.append(pa.table({
                "model": ["m"] * 2, "layer": pa.array([layer] * 2, pa.int32()), "fn_class": [fn_class] * 2,
                "variant": ["patch", "random"], "kl_mean": [0.1, 0.1], "kl_median": [0.1, 0.1],
                "spearman_relerr_kl": [values[f"rho/{fn_class}"][layer], values[f"rho_null/{fn_class}"][layer]],
                "spearman_normres_kl": [values[f"rho_norm/{fn_class}"][layer], values[f"rho_norm_null/{fn_class}"][layer]],
                "kl_ratio_random": [values[f"ratio/{fn_class}"][layer], None],
                "n_later": pa.array([2, 0], pa.int32()), "kl_later_mean": [0.3, None],
                "kl_at_mean_on_later": [0.1, None], "spearman_kl_later": [0.5, None],
                "kl_later_random_mean": [0.2, None], "later_ratio_median": [1.5, None],
                **{k: [v] * 2 for k, v in prov.items()}}))
            whiches = [w for w in ("tok", "full", "res", "full_null", "res_null") for _ in range(2)]
            spec.append(pa.table({
                "model": ["m"] * 10, "layer": pa.array([layer] * 10, pa.int32()), "fn_class": [fn_class] * 10,
                "which": whiches, "idx": pa.array([0, 1] * 5, pa.int32()),
                "effective_rank": [values[f"rank_{w}/{fn_class}"][layer] for w in whiches],
                "effective_rank_centred": [values[f"rank_{w}_centred/{fn_class}"][layer] for w in whiches],
                **{k: [v] * 10 for k, v in prov.items()}}))
        write_partition(root, "geometry", "m", layer, pa.concat_tables(geo))
        write_partition(root, "functional_summary", "m", layer, pa.concat_tables(fs))
        write_partition(root, "spectra", "m", layer, pa.concat_tables(spec))
    return values


NULL_COLUMNS = ("cos_full_tok_null", "cos_full_tok_map_null", "angle_full_res_null", "angle_tok_res_null",
                "proj_null_m16")


def hand_nulls(v: dict[str, np.ndarray], fn_class: str) -> dict[str, float]:
    """The nulls of every finding but 6 (a permutation: tested on its own) and 1 and 1 map (fitted on the
    controls stage's null target, which this fixture does not store: tests/unit/test_controls.py)."""
    lowrank = np.median(np.median(v["rel_err/lowrank"], axis=1))
    return {
        "2 angle": np.mean((v[f"angle_full_res_null/{fn_class}"] > 60).mean(axis=1)),
        "2 angle vs tok": np.mean((v[f"angle_tok_res_null/{fn_class}"] > 60).mean(axis=1)),
        "2 projection": np.mean(v[f"proj_null_m16/{fn_class}"]),
        "3": max(v[f"rank_full_null/{fn_class}"].mean(), v[f"rank_tok/{fn_class}"].mean())
        / v[f"rank_res_null/{fn_class}"].mean(),
        "3 centred": max(v[f"rank_full_null_centred/{fn_class}"].mean(), v[f"rank_tok_centred/{fn_class}"].mean())
        / v[f"rank_res_null_centred/{fn_class}"].mean(),
        "4": np.median(v[f"rho_null/{fn_class}"]),
        "4 norm": np.median(v[f"rho_norm_null/{fn_class}"]),
        "4 direction": 1.0,
        "5": 1.0 - lowrank,
    }


def hand_findings(v: dict[str, np.ndarray], fn_class: str) -> dict[str, float]:
    per_layer_median = {c: np.median(v[f"rel_err/{c}"], axis=1) for c in CLASSES}
    err = {c: np.median(per_layer_median[c]) for c in CLASSES}
    return {
        "1": np.median(np.median(v[f"cos/{fn_class}"], axis=1)),
        "1 map": np.median(np.median(v[f"cos_map/{fn_class}"], axis=1)),
        "2 angle": np.mean((v[f"angle/{fn_class}"] > 60).mean(axis=1)),
        "2 angle vs tok": np.mean((v[f"angle_tok/{fn_class}"] > 60).mean(axis=1)),
        "2 projection": np.mean(v[f"proj_res/{fn_class}"]),
        "3": max(v[f"rank_full/{fn_class}"].mean(), v[f"rank_tok/{fn_class}"].mean()) / v[f"rank_res/{fn_class}"].mean(),
        "3 centred": max(v[f"rank_full_centred/{fn_class}"].mean(), v[f"rank_tok_centred/{fn_class}"].mean())
        / v[f"rank_res_centred/{fn_class}"].mean(),
        "4": np.median(v[f"rho/{fn_class}"]),
        "4 norm": np.median(v[f"rho_norm/{fn_class}"]),
        "4 direction": np.median(v[f"ratio/{fn_class}"]),
        "5": err["diagonal"] - err["lowrank"],
        "6": np.mean(per_layer_median[fn_class][MIDDLE]) - np.mean(per_layer_median[fn_class][OUTER]),
        "6 inner": None,  # 6 layers: without the two first and two last, no outer layer is left
    }


def same(found: object, expected: float | None) -> bool:
    return found is None if expected is None else found == pytest.approx(expected, rel=1e-9)


def test_findings_match_a_hand_computation(tmp_path: Path) -> None:
    v = fixture(tmp_path)
    rows = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings").to_dicts()}
    assert {r["weights"] for r in rows.values()} == {PROV["weights"]}  # what the model ran with, beside each finding
    err = {c: np.median(np.median(v[f"rel_err/{c}"], axis=1)) for c in CLASSES}
    best = min(err, key=err.get)
    assert best == "lowrank" and all(r["fn_class"] == best for r in rows.values())
    expected = hand_findings(v, best)
    assert set(rows) == set(expected)
    for finding, value in expected.items():
        assert same(rows[finding]["value"], value), finding
    assert "besides the two first and two last" in rows["6 inner"]["note"]
    nulls = hand_nulls(v, best)
    for finding, value in nulls.items():
        assert rows[finding]["null_value"] == pytest.approx(value, rel=1e-9), finding
        assert rows[finding]["null_source"] == findings.BY_ID[finding].null_source
    assert rows["1"]["null_value"] is None and rows["1 map"]["null_value"] is None  # no null target stored
    assert rows["5"]["holds"] == (expected["5"] <= 0.05 and expected["5"] < nulls["5"])
    assert rows["4"]["holds"] == (expected["4"] >= 0.7 and expected["4"] > nulls["4"])
    assert rows["2 angle"]["threshold"] == ">= 0.5"
    assert rows["1"]["layers"] == "0,1,2,3,4,5" and rows["1"]["n_layers"] == LAYERS and rows["1"]["note"] is None


def test_the_views_render_the_findings_declared_in_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every declared finding is a row with its threshold and source; a finding added to the
    declaration shows up in the views with no change to storage."""
    fixture(tmp_path)
    rows = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings").to_dicts()}
    assert set(rows) == set(findings.BY_ID)
    for finding in findings.FINDINGS:
        assert rows[finding.id]["threshold"] == finding.threshold
        assert rows[finding.id]["threshold_source"] == finding.source and finding.source
    extra = findings.Finding("7", "a planted claim", "max over layers of the median relative error",
                             "max(rel_err_median)", "<=", 10.0, "the test", "max(rel_err_median) + 1", "one more")
    monkeypatch.setattr(views, "FINDINGS", (*findings.FINDINGS, extra))
    catalog.refresh(tmp_path)  # a changed declaration is a new code version: the catalog is rebuilt
    planted = catalog.query(tmp_path, "SELECT fn_class, value, holds FROM findings_by_class WHERE finding = '7'")
    assert sorted(planted["fn_class"].to_list()) == sorted(CLASSES) and all(planted["holds"])


def test_findings_by_class_cover_every_class(tmp_path: Path) -> None:
    v = fixture(tmp_path)
    frame = catalog.query(tmp_path, "SELECT fn_class, finding, value FROM findings_by_class")
    for fn_class in CLASSES:
        got = {r["finding"]: r["value"] for r in frame.filter(frame["fn_class"] == fn_class).to_dicts()}
        expected = hand_findings(v, fn_class)
        assert set(got) == set(expected)
        for finding, value in expected.items():
            assert same(got[finding], value), (fn_class, finding)


def test_sensitivity_against_hand_computation(tmp_path: Path) -> None:
    """A baseline config and one varying k, stored as a sweep: each finding's move and flips."""
    base = fixture(sweep_root(tmp_path, "c1"), "c1", seed=0)
    other = fixture(sweep_root(tmp_path, "c2"), "c2", seed=1)
    base_reps = replicate_fixture(sweep_root(tmp_path, "c1"), config_id="c1", seed=5)
    other_reps = replicate_fixture(sweep_root(tmp_path, "c2"), config_id="c2", seed=6)
    for cid, convention, setting in (("c1", "baseline", "default"), ("c2", "k", "32")):
        write_sweep_run(tmp_path, "m", cid, pa.table({"model": ["m"], "config_id": [cid], "base_config_id": ["c1"],
                                                      "convention": [convention], "setting": [setting]}))
    rows = catalog.query(tmp_path, "SELECT * FROM sensitivity").to_dicts()
    err = {c: np.median(np.median(base[f"rel_err/{c}"], axis=1)) for c in CLASSES}
    best = min(err, key=err.get)
    hand_base, hand_other = hand_findings(base, best), hand_findings(other, best)
    by_key = {(r["finding"], r["convention"], r["setting"]): r for r in rows}
    for finding in ("1", "2 angle", "2 projection", "3", "4", "5", "6"):
        row = by_key[(finding, "k", "32")]
        assert row["fn_class"] == best and row["config_id"] == "c2"
        assert row["value"] == pytest.approx(hand_other[finding], rel=1e-9)
        assert row["baseline_value"] == pytest.approx(hand_base[finding], rel=1e-9)
        assert row["delta"] == pytest.approx(hand_other[finding] - hand_base[finding], rel=1e-6, abs=1e-12)
        assert row["flips"] == (row["verdict"] != row["baseline_verdict"] and row["separates"])
        assert row["separates"] == (row["delta_ci_lo"] > 0 or row["delta_ci_hi"] < 0)
    # the paired interval of the difference: resample b of the setting against resample b of the baseline
    for finding, stat, how in (("1", "cos_full_tok_median", np.median), ("2 projection", "proj_res_m16", np.mean)):
        diff = how(other_reps[f"{stat}/{best}"], axis=1) - how(base_reps[f"{stat}/{best}"], axis=1)
        row = by_key[(finding, "k", "32")]
        assert row["delta_ci_lo"] == pytest.approx(np.quantile(diff, 0.025), rel=1e-9)
        assert row["delta_ci_hi"] == pytest.approx(np.quantile(diff, 0.975), rel=1e-9)
    # the measurement conventions re-measure a finding on the baseline
    assert by_key[("1", "alignment form", "map: cos(y, T(x))")]["value"] == pytest.approx(hand_base["1 map"])
    assert by_key[("4", "error measure", "‖r‖")]["value"] == pytest.approx(hand_base["4 norm"])
    assert by_key[("2 angle", "angle reference", "against Δ_tok")]["value"] == pytest.approx(hand_base["2 angle vs tok"])
    # the class convention: every class of the baseline configuration
    for fn_class in CLASSES:
        assert by_key[("1", "class", fn_class)]["value"] == pytest.approx(hand_findings(base, fn_class)["1"])
    # the sweep never leaks into the main findings
    with duckdb.connect() as con:
        views = catalog.create_views(con, tmp_path)
    assert "findings" not in views and {"sweep_findings", "sensitivity"} <= set(views)


N_JACK = 8  # jackknife replicates of the effective ranks in the replicate fixture
RANK_RANGES = (("rank_full", 5, 20), ("rank_tok", 5, 20), ("rank_res", 30, 60), ("rank_full_null", 5, 20),
               ("rank_res_null", 30, 60))


def replicate_fixture(root: Path, n_rep: int = 40, seed: int = 5, config_id: str = "c1",
                      n_seq: int = 4) -> dict[str, np.ndarray]:
    """Per-layer statistics of bootstrap resamples (the tables the geometry and functional stages write)."""
    rng, extra = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    prov = {**PROV, "config_id": config_id, "config_json": json.dumps({"n_seq": n_seq, "seq_len": 128})}
    reps: dict[str, np.ndarray] = {}
    for fn_class in CLASSES:
        for name, low, high in (("rel_err_median", 0.2, 0.9), ("cos_full_tok_median", 0.8, 1.0),
                                ("cos_full_tok_map_median", 0.8, 1.0), ("frac_res_angle_gt60", 0.0, 1.0),
                                ("frac_res_tok_angle_gt60", 0.0, 1.0), ("proj_res_m16", 0.3, 0.5),
                                ("spearman_relerr_kl", 0.5, 0.9), ("spearman_normres_kl", 0.5, 0.9),
                                *((f"{n}_null", 0.0, 1.0) for n in ("cos_full_tok_median", "cos_full_tok_map_median",
                                                                     "frac_res_angle_gt60", "frac_res_tok_angle_gt60",
                                                                     "proj_res_m16", "spearman_relerr_kl",
                                                                     "spearman_normres_kl")),
                                ("kl_ratio_random", 0.8, 2.0)):
            reps[f"{name}/{fn_class}"] = rng.uniform(low, high, (n_rep, LAYERS))
        for name, low, high in RANK_RANGES:  # the effective ranks: on the jackknife replicates only
            reps[f"{name}/{fn_class}"] = rng.uniform(low, high, (N_JACK, LAYERS))
        for name, low, high in RANK_RANGES:  # the centred spectra's: drawn apart, the others' draws unchanged
            reps[f"{name}_centred/{fn_class}"] = extra.uniform(low, high, (N_JACK, LAYERS))
        for name in GEOMETRY_STATISTICS:  # statistics no finding reads: drawn apart, the others' draws unchanged
            reps.setdefault(f"{name}/{fn_class}", extra.uniform(0.0, 1.0, (n_rep, LAYERS)))
    n = n_rep + N_JACK
    for layer in range(LAYERS):
        geo, fun = [], []
        for fn_class in CLASSES:
            ids = {"model": ["m"] * n_rep, "layer": pa.array([layer] * n_rep, pa.int32()), "fn_class": [fn_class] * n_rep,
                   "replicate": pa.array(np.arange(n_rep), pa.int32()), **{k: [v] * n_rep for k, v in prov.items()}}
            both = {**ids, "fn_class": [fn_class] * n, "layer": pa.array([layer] * n, pa.int32()),
                    "replicate": pa.array(np.concatenate([np.arange(n_rep), -2 - np.arange(N_JACK)]), pa.int32()),
                    **{k: [v] * n for k, v in prov.items()}, "model": ["m"] * n}
            geo.append(pa.table({**both, "model_layers": pa.array([LAYERS] * n, pa.int32()),
                                 **{name: pa.array(np.concatenate([reps[f"{name}/{fn_class}"][:, layer],
                                                                   np.full(N_JACK, np.nan)]), from_pandas=True)
                                    for name in GEOMETRY_STATISTICS},
                                 **{name: pa.array(np.concatenate([np.full(n_rep, np.nan),
                                                                   reps[f"{name}/{fn_class}"][:, layer]]), from_pandas=True)
                                    for name in findings.RANK_STATISTICS}}))
            fun.append(pa.table({**ids, **{name: reps[f"{name}/{fn_class}"][:, layer] for name in
                                           ("spearman_relerr_kl", "spearman_normres_kl", "spearman_relerr_kl_null",
                                            "spearman_normres_kl_null", "kl_ratio_random")},
                                 **{name: extra.uniform(0.0, 1.0, n_rep) for name in
                                    ("kl_later_mean", "kl_later_random_mean", "later_ratio_median")}}))
        write_partition(root, "geometry_bootstrap", "m", layer, pa.concat_tables(geo))
        write_partition(root, "functional_bootstrap", "m", layer, pa.concat_tables(fun))
    return reps


def test_intervals_are_quantiles_of_the_findings_on_each_resample(tmp_path: Path) -> None:
    v = fixture(tmp_path)
    reps = replicate_fixture(tmp_path)
    rows = {(r["fn_class"], r["finding"]): r for r in catalog.query(tmp_path, "SELECT * FROM findings_by_class").to_dicts()}
    for fn_class in CLASSES:
        per_rep = {
            "1": np.median(reps[f"cos_full_tok_median/{fn_class}"], axis=1),
            "2 projection": reps[f"proj_res_m16/{fn_class}"].mean(axis=1),
            "4": np.median(reps[f"spearman_relerr_kl/{fn_class}"], axis=1),
            "4 direction": np.median(reps[f"kl_ratio_random/{fn_class}"], axis=1),
            "5": np.median(reps["rel_err_median/diagonal"], axis=1) - np.median(reps["rel_err_median/lowrank"], axis=1),
            "6": reps[f"rel_err_median/{fn_class}"][:, MIDDLE].mean(axis=1)
            - reps[f"rel_err_median/{fn_class}"][:, OUTER].mean(axis=1),
        }
        null_rep = {"2 projection": reps[f"proj_res_m16_null/{fn_class}"].mean(axis=1),
                    "4": np.median(reps[f"spearman_relerr_kl_null/{fn_class}"], axis=1),
                    "4 direction": np.ones(40),
                    "5": 1.0 - np.median(reps["rel_err_median/lowrank"], axis=1)}
        for finding, nulls in null_rep.items():
            row = rows[(fn_class, finding)]
            assert row["null_value"] == pytest.approx(np.median(nulls), rel=1e-9)
            assert row["null_ci_lo"] == pytest.approx(np.quantile(nulls, 0.025), rel=1e-9)
            diff = per_rep[finding] - nulls
            assert row["diff_ci_lo"] == pytest.approx(np.quantile(diff, 0.025), rel=1e-9, abs=1e-12)
            assert row["diff_ci_hi"] == pytest.approx(np.quantile(diff, 0.975), rel=1e-9, abs=1e-12)
        # finding 3: the point +- t(0.975, G - 1) times the jackknife's standard error, for the value, the
        # null and their difference, each interval centred on its point
        t = scipy.stats.t.ppf(0.975, N_JACK - 1)

        def half(values: np.ndarray, t: float = t) -> float:
            return float(t * np.sqrt((N_JACK - 1) / N_JACK * ((values - values.mean()) ** 2).sum()))

        for finding, suffix in (("3", ""), ("3 centred", "_centred")):  # on the uncentred and the centred spectra
            jack = {name: reps[f"{name}{suffix}/{fn_class}"].mean(axis=1) for name, _, _ in RANK_RANGES}
            value_j = np.maximum(jack["rank_full"], jack["rank_tok"]) / jack["rank_res"]
            null_j = np.maximum(jack["rank_full_null"], jack["rank_tok"]) / jack["rank_res_null"]
            row = rows[(fn_class, finding)]
            point, null = hand_findings(v, fn_class)[finding], hand_nulls(v, fn_class)[finding]
            assert row["interval"] == "jackknife" and row["n_resamples"] == N_JACK
            assert row["value"] == pytest.approx(point, rel=1e-9) and row["null_value"] == pytest.approx(null, rel=1e-9)
            for lo, hi, centre, width in ((row["ci_lo"], row["ci_hi"], point, half(value_j)),
                                          (row["null_ci_lo"], row["null_ci_hi"], null, half(null_j)),
                                          (row["diff_ci_lo"], row["diff_ci_hi"], point - null, half(value_j - null_j))):
                # t(0.975, G - 1) is tabled to 6 decimals: the bounds agree to 1e-6 of the width
                tol = 1e-6 * width
                assert lo == pytest.approx(centre - width, abs=tol) and hi == pytest.approx(centre + width, abs=tol)
                assert lo <= centre <= hi
        for finding, values in per_rep.items():
            row = rows[(fn_class, finding)]
            lo, hi = np.quantile(values, [0.025, 0.975])
            assert row["ci_lo"] == pytest.approx(lo, rel=1e-9) and row["ci_hi"] == pytest.approx(hi, rel=1e-9)
            assert row["n_resamples"] == 40
            assert row["value"] == pytest.approx(hand_findings(v, fn_class)[finding], rel=1e-9)
        # the verdict: where the interval lies against the threshold, then against the null
        for (cls, finding), row in rows.items():
            bound = float(row["threshold"].split()[1])
            above = row["threshold"].startswith(">=")
            lo, hi, dlo, dhi = row["ci_lo"], row["ci_hi"], row["diff_ci_lo"], row["diff_ci_hi"]
            if lo is None:  # not measured (6 inner on 6 layers): no interval, no verdict
                assert row["verdict"] is None and row["note"], (cls, finding)
                continue
            clears = lo >= bound if above else hi <= bound
            if clears and dlo is not None and (dlo > 0 if above else dhi < 0):
                expected = "holds"
            elif not clears and findings.BY_ID[finding].control_role in ("positive", "floor"):
                expected = "no control"  # no control stored here to tell a failure from the estimator's limit
            elif dlo is not None and (dhi < 0 if above else dlo > 0):
                expected = "opposite"  # beyond the null on the wrong side of the claim
            elif (hi < bound if above else lo > bound):
                expected = "fails"
            elif not (lo >= bound if above else hi <= bound) or dlo is None:
                expected = "undecided"
            else:
                expected = "holds" if (dlo > 0 if above else dhi < 0) else "indistinct"
            assert row["verdict"] == expected, (cls, finding)
    verdicts = {r["verdict"] for r in rows.values()}
    assert {"no control", "undecided", "holds"} <= verdicts, verdicts  # "indistinct": the planted test below


def test_the_t_quantiles_of_the_jackknife_are_scipys() -> None:
    for nu in (1, 2, 7, 15, 30, 31, 49, 200):
        got = duckdb.sql(f"SELECT {t975_sql(str(nu))} AS t").fetchone()[0]  # type: ignore[index]
        assert got == pytest.approx(scipy.stats.t.ppf(0.975, nu), rel=1e-6, abs=1e-6), nu


def test_layer_bands_are_the_per_layer_intervals_of_the_resamples(tmp_path: Path) -> None:
    fixture(tmp_path)
    reps = replicate_fixture(tmp_path)
    bands = {(r["fn_class"], r["layer"]): r for r in catalog.query(tmp_path, "SELECT * FROM layer_bands").to_dicts()}
    assert len(bands) == len(CLASSES) * LAYERS
    for (fn_class, layer), row in bands.items():
        assert row["n_resamples"] == 40
        for stat in ("rel_err_median", "proj_res_m16_null", "spearman_relerr_kl"):
            lo, hi = np.quantile(reps[f"{stat}/{fn_class}"][:, layer], [0.025, 0.975])
            assert row[f"{stat}_lo"] == pytest.approx(lo, rel=1e-9) and row[f"{stat}_hi"] == pytest.approx(hi, rel=1e-9)
        # an effective rank: its jackknife replicates' mean +- t(0.975, G - 1) times their standard error
        jack = reps[f"rank_res/{fn_class}"][:, layer]
        half = scipy.stats.t.ppf(0.975, N_JACK - 1) * np.sqrt((N_JACK - 1) * jack.var())
        assert row["rank_res_lo"] == pytest.approx(jack.mean() - half, abs=1e-6 * half)  # t to 6 decimals
        assert row["rank_res_hi"] == pytest.approx(jack.mean() + half, abs=1e-6 * half)


def test_without_resamples_there_is_no_interval_and_no_verdict(tmp_path: Path) -> None:
    fixture(tmp_path)
    frame = catalog.query(tmp_path, "SELECT ci_lo, ci_hi, verdict, n_resamples FROM findings")
    assert frame["ci_lo"].is_null().all() and frame["verdict"].is_null().all()
    assert (frame["n_resamples"] == 0).all()


def test_convergence_lists_each_finding_at_each_sample_size(tmp_path: Path) -> None:
    """Nested samples stored as data roots under convergence/: one row per (finding, class, size)."""
    for n_seq, cid, seed in ((16, "c16", 0), (64, "c64", 1)):
        fixture(convergence_root(tmp_path, n_seq), cid, seed=seed, n_seq=n_seq)
        replicate_fixture(convergence_root(tmp_path, n_seq), config_id=cid, seed=seed, n_seq=n_seq)
    rows = catalog.query(tmp_path, "SELECT * FROM convergence WHERE model = $1", ["m"]).to_dicts()
    assert {r["n_tokens"] for r in rows} == {16 * 128, 64 * 128}
    by_size = {(r["finding"], r["fn_class"], r["n_tokens"]): r for r in rows}
    small = hand_findings(fixture(tmp_path / "again", "x", seed=0), "lowrank")
    assert by_size[("4", "lowrank", 2048)]["value"] == pytest.approx(small["4"], rel=1e-9)
    assert by_size[("4", "lowrank", 2048)]["ci_lo"] <= by_size[("4", "lowrank", 2048)]["ci_hi"]
    assert by_size[("1", "diagonal", 8192)]["layers"] == "0,1,2,3,4,5"
    with duckdb.connect() as con:  # the main views stay empty: nothing was stored outside convergence/
        views = catalog.create_views(con, tmp_path)
    assert "findings" not in views and "convergence" in views


def test_convergence_figure_draws_every_finding_even_one_without_values(tmp_path: Path) -> None:
    import polars as pl

    from updatelens.reports import figures

    rows = pl.DataFrame({
        "finding": ["1", "1", "6", "6"], "fn_class": ["lowrank"] * 4, "n_tokens": [2048, 8192] * 2,
        "value": [0.7, 0.8, None, None], "ci_lo": [0.6, 0.75, None, None], "ci_hi": [0.8, 0.85, None, None],
        "threshold": [">= 0.9", ">= 0.9", ">= 0", ">= 0"]}, schema_overrides={"value": pl.Float64,
                                                                        "ci_lo": pl.Float64, "ci_hi": pl.Float64})
    figure = figures.convergence(rows, "m")
    figure.savefig(tmp_path / "convergence.png")
    assert (tmp_path / "convergence.png").stat().st_size > 0
    assert [ax.get_title() for ax in figure.axes[:2]] == ["finding 1 (>= 0.9)", "finding 6 (>= 0)"]


def test_a_finding_holds_only_beyond_its_null_and_is_indistinct_when_noise_passes_too(tmp_path: Path) -> None:
    """Planted resamples of finding 2 angle vs tok: for lowrank more residuals lie at large angles from
    the tokenwise update than random residuals of the same length do (the structure); for diagonal the
    residual is such a random direction (the measure equals its null). Both clear the threshold."""
    fixture(tmp_path)
    reps = replicate_fixture(tmp_path)
    rng = np.random.default_rng(11)
    structured = rng.uniform(0.95, 0.99, (40, LAYERS))
    noise = rng.uniform(0.92, 0.99, (40, LAYERS))
    planted = {"lowrank": (structured, structured - 0.06), "diagonal": (noise, noise + rng.normal(0, 1e-3, noise.shape))}
    stored = by_layer(tmp_path, "SELECT * FROM geometry_bootstrap WHERE replicate >= 0 ORDER BY layer, fn_class, replicate")
    for layer in range(LAYERS):
        table = stored[layer].drop_columns(["layer", "model"])
        columns = {}
        for name in ("frac_res_tok_angle_gt60", "frac_res_tok_angle_gt60_null"):
            columns[name] = np.concatenate([planted[c][name.endswith("_null")][:, layer] for c in ("diagonal", "lowrank")])
        for name, values in columns.items():
            table = table.set_column(table.schema.get_field_index(name), name, pa.array(values))
        write_partition(tmp_path, "geometry_bootstrap", "m", layer,
                        table.append_column("model", pa.array(["m"] * len(table)))
                        .append_column("layer", pa.array([layer] * len(table), pa.int32())))
    assert reps  # the other statistics stay as the fixture drew them
    sql = "SELECT * FROM findings_by_class WHERE finding = '2 angle vs tok'"
    verdicts = {r["fn_class"]: r for r in catalog.query(tmp_path, sql).to_dicts()}
    assert verdicts["lowrank"]["ci_lo"] >= 0.5 and verdicts["diagonal"]["ci_lo"] >= 0.5  # both pass the threshold
    assert verdicts["lowrank"]["verdict"] == "holds" and verdicts["lowrank"]["diff_ci_lo"] > 0
    assert verdicts["diagonal"]["verdict"] == "indistinct"
    assert verdicts["diagonal"]["diff_ci_lo"] <= 0 <= verdicts["diagonal"]["diff_ci_hi"]


def test_finding_6_null_shifts_the_depths_round_keeping_neighbours_together(tmp_path: Path) -> None:
    """Each resample's null labels the layers by a circular shift of their depths (by 1 to n - 1
    places): with rel_err_median equal to the layer's index, the null's gap is one of the rotations'."""
    fixture(tmp_path)
    replicate_fixture(tmp_path)
    stored = by_layer(tmp_path, "SELECT * FROM geometry_bootstrap")
    for layer in range(LAYERS):
        table = stored[layer]
        table = table.set_column(table.schema.get_field_index("rel_err_median"), "rel_err_median",
                                 pa.array(np.full(len(table), float(layer))))
        write_partition(tmp_path, "geometry_bootstrap", "m", layer, table)
    rotations = set()
    for shift in range(1, LAYERS):
        label = {layer: (layer + shift) % LAYERS for layer in range(LAYERS)}  # layer -> the depth it is given
        middle = [layer for layer in range(LAYERS) if label[layer] in MIDDLE]
        outer = [layer for layer in range(LAYERS) if label[layer] in OUTER]
        rotations.add(round(np.mean(middle) - np.mean(outer), 9))
    nulls = catalog.query(tmp_path, "SELECT round(null_value, 9) AS v, count(*) AS n FROM finding_replicates "
                                    "WHERE finding = '6' AND fn_class = 'lowrank' AND replicate >= 0 GROUP BY v").to_dicts()
    # every shift in turn: 40 resamples over 5 shifts, 8 each (two shifts may give the same gap)
    assert {r["v"] for r in nulls} == rotations, (nulls, rotations)
    assert sum(r["n"] for r in nulls) == 40 and all(r["n"] % 8 == 0 for r in nulls)


@pytest.mark.parametrize("profile", ["random", "middle peak", "middle trough"])
def test_finding_6_p_is_the_share_of_all_shifts_whose_gap_reaches_the_real_one(tmp_path: Path, profile: str) -> None:
    """`null_p`: the point estimate's gap under each of the n circular shifts of the depths (the
    identity included), against the real one: 1 / n where the middle layers' residuals are the largest
    (no shift does better), 1 where they are the smallest; other findings have none."""
    v = fixture(tmp_path)
    if profile != "random":
        stored = by_layer(tmp_path, "SELECT * FROM geometry")
        for layer in range(LAYERS):
            table = stored[layer]
            peak = (1.0 if layer in MIDDLE else 0.1 * layer) * (1 if profile == "middle peak" else -1)
            column = table["rel_err"].to_numpy() * 0 + peak + np.arange(len(table)) * 1e-3
            table = table.set_column(table.schema.get_field_index("rel_err"), "rel_err", pa.array(column))
            write_partition(tmp_path, "geometry", "m", layer, table)
            for fn_class in CLASSES:
                v[f"rel_err/{fn_class}"][layer] = np.sort(column[table["fn_class"].to_numpy() == fn_class])
    rows = {(r["fn_class"], r["finding"]): r for r in catalog.query(tmp_path, "SELECT * FROM findings_by_class").to_dicts()}
    for fn_class in CLASSES:
        per_layer = np.median(v[f"rel_err/{fn_class}"], axis=1)

        labels = [(np.arange(LAYERS) + shift) % LAYERS for shift in range(LAYERS)]
        gaps = [per_layer[np.isin(label, MIDDLE)].mean() - per_layer[np.isin(label, OUTER)].mean() for label in labels]
        expected = np.mean([g >= gaps[0] - 1e-12 for g in gaps])
        assert rows[(fn_class, "6")]["null_p"] == pytest.approx(expected), fn_class
        if profile == "middle peak":
            assert expected == pytest.approx(1 / LAYERS)
        if profile == "middle trough":
            assert expected == 1.0
        assert rows[(fn_class, "1")]["null_p"] is None and rows[(fn_class, "6 inner")]["null_p"] is None


def test_finding_6_uses_the_models_depth_and_is_null_with_a_reason_when_too_few_layers(tmp_path: Path) -> None:
    import shutil

    from updatelens.storage.layout import partition_dir

    fixture(tmp_path)
    for layer in (0, 1, 4):  # left: layers 2, 3, 5 of 6: one outer layer only
        for table in ("geometry", "functional_summary", "spectra"):
            shutil.rmtree(partition_dir(tmp_path, table, "m", layer))
    rows = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings").to_dicts()}
    assert rows["6"]["value"] is None and rows["6"]["null_value"] is None
    assert "2 analysed layers in the middle third" in rows["6"]["note"] and "(layers analysed: 2,3,5 of 6)" in rows["6"]["note"]
    assert rows["1"]["value"] is not None and rows["1"]["layers"] == "2,3,5"


def test_findings_across_models_pair_the_resamples_of_two_models(tmp_path: Path) -> None:
    """Two models stored side by side: each finding of one against the other, with the interval of
    the difference from resample b of one against resample b of the other."""
    v = fixture(tmp_path)
    reps = replicate_fixture(tmp_path)
    other = tmp_path / "other"
    fixture(other, seed=3)
    replicate_fixture(other, seed=9)
    for table in ("geometry", "functional_summary", "spectra", "geometry_bootstrap", "functional_bootstrap"):
        for layer in range(LAYERS):
            moved = catalog.query(other, f"SELECT * FROM {table} WHERE layer = $1", [layer]).drop(["model", "layer"])
            moved = moved.to_arrow().append_column("model", pa.array(["n"] * len(moved))) \
                .append_column("layer", pa.array([layer] * len(moved), pa.int32()))
            write_partition(tmp_path, table, "n", layer, moved)
    rows = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings_across_models").to_dicts()}
    assert set(rows) == set(findings.BY_ID) and rows["4"]["model_a"] == "m" and rows["4"]["model_b"] == "n"
    mine = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings WHERE model = 'm'").to_dicts()}
    assert rows["4"]["value_a"] == pytest.approx(mine["4"]["value"]) == pytest.approx(hand_findings(v, "lowrank")["4"])
    per_rep_m = np.median(reps["spearman_relerr_kl/lowrank"], axis=1)
    theirs = catalog.query(tmp_path, "SELECT replicate, value FROM finding_replicates WHERE model = 'n' AND finding = '4' "
                                     "AND fn_class = $1 AND replicate >= 0 ORDER BY replicate", [rows["4"]["class_b"]])
    diff = per_rep_m - theirs["value"].to_numpy()
    assert rows["4"]["diff_ci_lo"] == pytest.approx(np.quantile(diff, 0.025))
    assert rows["4"]["diff_ci_hi"] == pytest.approx(np.quantile(diff, 0.975)) and rows["4"]["n_resamples"] == 40


def test_findings_across_models_pair_resamples_only_where_the_models_sampled_the_same_documents(
        tmp_path: Path) -> None:
    """With the documents stored (the activations' `doc` per window): two models that sampled the same
    documents are paired resample by resample; two that sampled different ones are set against
    independent resamples (b against b + 1), and `same_documents` says which."""
    test_findings_across_models_pair_the_resamples_of_two_models(tmp_path)

    def windows(model: str, docs: list[int]) -> None:
        for layer in range(LAYERS):
            n = len(docs)
            write_partition(tmp_path, "activations", model, layer, pa.table({
                "model": [model] * n, "layer": pa.array([layer] * n, pa.int32()), "config_id": ["c1"] * n,
                "corpus": ["wiki"] * n, "seq": pa.array(range(n), pa.int32()), "doc": pa.array(docs, pa.int32())}))

    def row() -> dict:
        return catalog.query(tmp_path, "SELECT * FROM findings_across_models WHERE finding = '4'").to_dicts()[0]

    def replicates(model: str, fn_class: str) -> np.ndarray:
        return catalog.query(tmp_path, "SELECT value FROM finding_replicates WHERE model = $1 AND finding = '4' "
                                       "AND fn_class = $2 AND replicate >= 0 ORDER BY replicate",
                             [model, fn_class])["value"].to_numpy()

    windows("m", [0, 1, 2, 3])
    windows("n", [0, 1, 2, 3])
    same = row()
    a, b = replicates("m", same["class_a"]), replicates("n", same["class_b"])
    assert same["same_documents"] is True and same["resampling"] == "paired (same documents)"
    assert same["diff_ci_lo"] == pytest.approx(np.quantile(a - b, 0.025))
    windows("n", [0, 1, 2, 7])  # another article in the last window
    other = row()
    assert other["same_documents"] is False and other["resampling"] == "independent (different documents)"
    assert other["diff_ci_lo"] == pytest.approx(np.quantile(a - np.roll(b, -1), 0.025))
    assert other["diff_ci_hi"] == pytest.approx(np.quantile(a - np.roll(b, -1), 0.975)) and other["n_resamples"] == 40


def test_findings_across_models_give_the_jackknife_finding_an_interval_paired_or_independent(tmp_path: Path) -> None:
    """Finding 3 is read from delete-a-group jackknife replicates (no bootstrap resamples): across models
    its difference gets the jackknife interval of the paired difference (group g against group g) where
    the documents are the same or not stored, and the two half-widths in quadrature where they differ;
    centred on the difference of the points."""
    test_findings_across_models_pair_resamples_only_where_the_models_sampled_the_same_documents(tmp_path)
    t = scipy.stats.t.ppf(0.975, N_JACK - 1)

    def half(values: np.ndarray) -> float:
        return float(t * np.sqrt((N_JACK - 1) / N_JACK * ((values - values.mean()) ** 2).sum()))

    def jack(model: str, fn_class: str) -> np.ndarray:
        return catalog.query(tmp_path, "SELECT value FROM finding_replicates WHERE model = $1 AND finding = '3' "
                                       f"AND fn_class = $2 AND replicate <= {findings.JACKKNIFE_FIRST} "
                                       "ORDER BY replicate DESC", [model, fn_class])["value"].to_numpy()

    def row() -> dict:
        return catalog.query(tmp_path, "SELECT * FROM findings_across_models WHERE finding = '3'").to_dicts()[0]

    different = row()  # the last state of the test above: model n sampled another article
    a, b = jack("m", different["class_a"]), jack("n", different["class_b"])
    assert len(a) == len(b) == N_JACK and different["n_resamples"] == 0
    diff = different["value_a"] - different["value_b"]
    assert different["diff"] == pytest.approx(diff)
    width = np.hypot(half(a), half(b))
    assert different["resampling"] == "independent jackknifes (different documents)"
    assert different["diff_ci_lo"] == pytest.approx(diff - width) and different["diff_ci_hi"] == pytest.approx(diff + width)
    for layer in range(LAYERS):  # the same documents again
        write_partition(tmp_path, "activations", "n", layer, pa.table({
            "model": ["n"] * 4, "layer": pa.array([layer] * 4, pa.int32()), "config_id": ["c1"] * 4,
            "corpus": ["wiki"] * 4, "seq": pa.array(range(4), pa.int32()), "doc": pa.array(range(4), pa.int32())}))
    same = row()
    assert same["resampling"] == "paired jackknife (same documents)" and same["same_documents"] is True
    assert same["diff_ci_lo"] == pytest.approx(diff - half(a - b)) and same["diff_ci_hi"] == pytest.approx(diff + half(a - b))
    assert half(a - b) != pytest.approx(width)  # the pairing is read, not the quadrature


def test_results_of_an_older_version_without_a_new_column_leave_the_derived_views_out(tmp_path: Path) -> None:
    """While a rerun replaces stale results, files that predate a column the views read must not
    break the catalog (every stage refreshes it): the per-table views answer, the derived ones wait."""
    fixture(tmp_path)
    for layer in range(LAYERS):
        old = catalog.query(tmp_path, "SELECT * EXCLUDE (model_layers) FROM geometry WHERE layer = $1", [layer])
        old = old.drop(["model", "layer"]).to_arrow()
        write_partition(tmp_path, "geometry", "m", layer, old.append_column("model", pa.array(["m"] * len(old)))
                        .append_column("layer", pa.array([layer] * len(old), pa.int32())))
    views = catalog.refresh(tmp_path)
    assert "geometry" in views and "layer_summary" not in views and "findings" not in views
    assert catalog.query(tmp_path, "SELECT count(*) AS n FROM geometry")["n"][0] == LAYERS * len(CLASSES) * TOKENS


def test_each_layer_statistic_is_one_definition_the_point_is_the_resample_with_unit_weights(tmp_path: Path) -> None:
    """`layer_summary`'s statistics of the findings are rendered from findings.GEOMETRY_STATISTIC_DEFS,
    which the bootstrap recomputes on every resample: with unit weights the resample is the point,
    for an odd token count (the fixture's 5) and an even one (6, where the median interpolates)."""
    from updatelens.bootstrap import geometry_replicates

    fixture(tmp_path)
    columns = sorted({column for _, column, _ in findings.GEOMETRY_STATISTIC_DEFS})
    summary = catalog.query(tmp_path, "SELECT * FROM layer_summary ORDER BY layer, fn_class").to_dicts()
    assert len(summary) == LAYERS * len(CLASSES)
    for row in summary:
        tokens = catalog.query(tmp_path, f"SELECT {', '.join(columns)} FROM geometry WHERE layer = $1 AND fn_class = $2",
                               [row["layer"], row["fn_class"]])
        metrics = {c: tokens[c].to_numpy() for c in columns}
        resample = geometry_replicates(np.zeros(len(tokens), np.int64), metrics, np.ones((1, 1)))
        for name in GEOMETRY_STATISTICS:
            assert resample[name][0] == pytest.approx(row[name], abs=1e-12), (name, row["layer"])
    rng = np.random.default_rng(1)
    even = {c: rng.uniform(0, 120, 6) for c in columns}
    con = duckdb.connect()
    con.register("tokens", pa.table(even))
    point = con.execute("SELECT " + ", ".join(f"{findings.aggregate_sql(column, how)} AS {name}"
                                              for name, column, how in findings.GEOMETRY_STATISTIC_DEFS)
                        + " FROM tokens").fetchone()
    resample = geometry_replicates(np.repeat([0, 1], 3), even, np.ones((1, 2)))
    assert point is not None
    for name, value in zip(GEOMETRY_STATISTICS, point):
        assert resample[name][0] == pytest.approx(value, abs=1e-12), name
    with pytest.raises(ValueError, match="unknown aggregate 'mode'"):
        findings.aggregate_sql("rel_err", "mode")


def test_the_functional_statistics_are_declared_once_and_the_tables_carry_them() -> None:
    """Each functional statistic reads a column that `functional_summary` stores, and exactly the resampled
    ones are the columns `functional_bootstrap` stores on every resample, so the views rendered from the
    declaration read what the stage writes (a statistic added in one place and not the other fails here)."""
    from updatelens.findings import FUNCTIONAL_STATISTICS, RESAMPLED_FUNCTIONAL, STATISTICS
    from updatelens.schemas import columns

    summary = {c.name for c in columns("functional_summary")}
    assert {stat.column for stat in FUNCTIONAL_STATISTICS} <= summary
    bootstrap = [c.name for c in columns("functional_bootstrap") if c.name.startswith(("spearman", "kl_", "later_"))]
    assert tuple(bootstrap) == RESAMPLED_FUNCTIONAL
    assert set(RESAMPLED_FUNCTIONAL) <= set(STATISTICS) and len(set(STATISTICS)) == len(STATISTICS)
