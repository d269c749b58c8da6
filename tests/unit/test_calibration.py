"""The power study's rows: local classes per k, the global ones (one map per layer) beside them, and
whether each recovers a target that is tokenwise by construction."""

from __future__ import annotations

import numpy as np

from updatelens.calibration import LayerSample, calibrate_layer
from updatelens.config import AnalysisConfig


def planted(n_seq: int = 12, per_seq: int = 40, d: int = 6, seed: int = 0) -> LayerSample:
    """x random; the real update a tokenwise map plus noise from the context; the self-and-first
    control an exactly tokenwise linear map of x (so a global linear map recovers it)."""
    rng = np.random.default_rng(seed)
    n = n_seq * per_seq
    x = rng.standard_normal((n, d)).astype(np.float32)
    b = 0.5 * rng.standard_normal((d, d))
    y_ctl = (x + x @ b).astype(np.float32)
    y = (y_ctl + 0.8 * rng.standard_normal((n, d))).astype(np.float32)
    seq = np.repeat(np.arange(n_seq), per_seq).astype(np.int32)
    return LayerSample(x=x, y=y, y_ctl=y_ctl, seq=seq, doc=seq.copy())


def test_the_global_classes_stand_beside_the_local_ones_and_the_mlp_fits_the_control_only() -> None:
    data = planted()
    cfg = AnalysisConfig(n_seq=12, seq_len=41, k=16, rank=2, bootstrap=50, mlp_steps=200)
    rows = calibrate_layer(data, 12, (8, 16), cfg, ("lowrank", "global_linear", "mlp"), 200, ("self_first",))
    seen = {(r["fn_class"], r["k"], r["target"]) for r in rows}
    assert seen == {*(("lowrank", k, t) for k in (8, 16) for t in ("real", "self_first")),
                    *(("global_linear", 0, t) for t in ("real", "self_first")), ("mlp", 0, "self_first")}
    by = {(r["fn_class"], r["k"], r["target"]): r for r in rows}
    # one linear map recovers the linear tokenwise control: its interval clears finding 1's 0.9
    recovered = by[("global_linear", 0, "self_first")]
    assert recovered["cos_full_tok_median"] > 0.98 and recovered["finding_1"] == "clears"
    # the real update carries noise no tokenwise map can fit: it misses
    assert by[("global_linear", 0, "real")]["cos_full_tok_median"] < 0.9
    assert all(r["n_tokens"] == 480 and r["n_docs"] == 12 and r["n_anchors"] == 200 for r in rows)
    # the smaller size: the first 6 windows only
    half = calibrate_layer(data, 6, (8,), cfg, ("global_linear",), 500, ("self_first",))
    assert {r["n_tokens"] for r in half} == {240} and {r["n_anchors"] for r in half} == {240}
