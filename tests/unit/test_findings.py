"""The findings view against a hand computation on a small fixture written as Parquet partitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from storage import catalog
from storage.layout import write_partition

LAYERS, CLASSES, TOKENS = 3, ("diagonal", "lowrank"), 5
PROV = {"config_id": "c1", "model_revision": "r", "corpus_slice": "s", "k": 8, "rank": 2, "dtype": "float64",
        "code_version": "v"}


def fixture(root: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}
    for c_i, fn_class in enumerate(CLASSES):
        shape = (LAYERS, TOKENS)
        values[f"rel_err/{fn_class}"] = rng.uniform(0.2, 0.6, shape) + 0.3 * (1 - c_i)  # lowrank is better
        values[f"cos/{fn_class}"] = rng.uniform(0.3, 1.0, shape)
        values[f"cos_map/{fn_class}"] = rng.uniform(0.8, 1.0, shape)
        values[f"angle/{fn_class}"] = rng.uniform(10, 120, shape)
        values[f"proj_res/{fn_class}"] = rng.uniform(0, 0.5, shape)
        values[f"rho/{fn_class}"] = rng.uniform(-0.2, 0.9, LAYERS)
        for which in ("tok", "full", "res"):
            values[f"rank_{which}/{fn_class}"] = rng.uniform(5, 50, LAYERS) * (3 if which == "res" else 1)
    for layer in range(LAYERS):
        geo, fs, spec = [], [], []
        for fn_class in CLASSES:
            n = TOKENS
            geo.append(pa.table({
                "model": ["m"] * n, "layer": pa.array([layer] * n, pa.int32()), "fn_class": [fn_class] * n,
                "rel_err": values[f"rel_err/{fn_class}"][layer], "cos_full_tok": values[f"cos/{fn_class}"][layer],
                "cos_full_tok_map": values[f"cos_map/{fn_class}"][layer], "cos_full_res": np.zeros(n),
                "angle_full_res": values[f"angle/{fn_class}"][layer], "proj_full_m16": np.zeros(n),
                "proj_tok_m16": np.zeros(n), "proj_res_m16": values[f"proj_res/{fn_class}"][layer],
                "m90_tok": pa.array([1] * n, pa.int32()), **{k: [v] * n for k, v in PROV.items()}}))
            fs.append(pa.table({
                "model": ["m"], "layer": pa.array([layer], pa.int32()), "fn_class": [fn_class], "variant": ["patch"],
                "kl_mean": [0.1], "kl_median": [0.1], "spearman_relerr_kl": [values[f"rho/{fn_class}"][layer]],
                "spearman_normres_kl": [0.0], **{k: [v] for k, v in PROV.items()}}))
            spec.append(pa.table({
                "model": ["m"] * 6, "layer": pa.array([layer] * 6, pa.int32()), "fn_class": [fn_class] * 6,
                "which": ["tok", "tok", "full", "full", "res", "res"], "idx": pa.array([0, 1] * 3, pa.int32()),
                "effective_rank": [values[f"rank_{w}/{fn_class}"][layer] for w in ("tok", "tok", "full", "full", "res", "res")],
                **{k: [v] * 6 for k, v in PROV.items()}}))
        write_partition(root, "geometry", "m", layer, pa.concat_tables(geo))
        write_partition(root, "functional_summary", "m", layer, pa.concat_tables(fs))
        write_partition(root, "spectra", "m", layer, pa.concat_tables(spec))
    return values


def test_findings_match_a_hand_computation(tmp_path: Path) -> None:
    v = fixture(tmp_path)
    rows = {r["finding"]: r for r in catalog.query(tmp_path, "SELECT * FROM findings").to_dicts()}
    per_layer_median = {c: np.median(v[f"rel_err/{c}"], axis=1) for c in CLASSES}
    err = {c: np.median(per_layer_median[c]) for c in CLASSES}
    best = min(err, key=err.get)
    assert best == "lowrank" and all(r["fn_class"] == best for r in rows.values())
    expected = {
        "1": np.median(np.median(v[f"cos/{best}"], axis=1)),
        "1 map": np.median(np.median(v[f"cos_map/{best}"], axis=1)),
        "2 angle": np.mean((v[f"angle/{best}"] > 60).mean(axis=1)),
        "2 projection": np.mean(v[f"proj_res/{best}"]),
        "3": max(v[f"rank_full/{best}"].mean(), v[f"rank_tok/{best}"].mean()) / v[f"rank_res/{best}"].mean(),
        "4": np.median(v[f"rho/{best}"]),
        "5": err["diagonal"] - err["lowrank"],
        "6": per_layer_median[best][1] - np.mean(per_layer_median[best][[0, 2]]),
    }
    assert set(rows) == set(expected)
    for finding, value in expected.items():
        assert rows[finding]["value"] == pytest.approx(value, rel=1e-9), finding
    assert rows["5"]["holds"] == (expected["5"] <= 0.05)
    assert rows["4"]["holds"] == (expected["4"] >= 0.7)
    assert rows["2 angle"]["threshold"] == ">= 0.5"
