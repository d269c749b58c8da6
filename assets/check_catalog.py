"""The check catalogue: what each data-quality check is (CHECK_DEFS) and which stage runs it, the
checks' thresholds (CheckSettings), their Dagster specs, and how one check's verdicts on a run's
partitions become Dagster evaluations (Outcome). The checks themselves, as functions of the written
tables, are in checks.py, which re-exports these names for the stage assets (`checks.Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dagster as dg

from updatelens.assets.expectations import Verdict
from updatelens.stages import STAGES


class CheckSettings(dg.Config):
    """Thresholds of the data-quality checks (configuration, recorded in check metadata)."""

    max_state_norm: float = 1e6  # any hidden-state norm above this is a blow-up
    # captured vs output_hidden_states, relative to each row's scale (pos > 0): the reference pass batches
    # the sequences otherwise, and float32 sums in another order differ by up to 1.16e-4 on SmolLM2's
    # layers 22-24 (measured in a default run that 1e-4 failed); a hook on the wrong tensor is off by O(1),
    # and the planted fault of 1e-3 at one position (tests/pipeline/test_checks.py) stays 2.5 x beyond
    hidden_state_tol: float = 4e-4
    hidden_state_sequences: int = 2  # sequences recomputed for that comparison
    reconstruction_tol: float = 1e-5  # |y - T(x) - r| relative to ||y||
    audit_anchors: int = 32  # anchors per local class re-fitted from their stored neighbours
    audit_tol: float = 1e-4  # re-fitted vs stored T(x), relative to ||T(x)|| (stored as float32)
    max_degenerate_frac: float = 0.05  # share of ill-conditioned or non-finite fits per class
    max_best_rel_err_median: float = 1.0  # the best class must explain part of the update
    rel_err_drift_tol: float = 0.05  # relative error quantiles vs the partition's previous materialization
    max_residual_ratio: float = 10.0  # ||r|| over the layer's 99th percentile ||Δ_full||: above it a fit blew up
    min_tokens_spearman: int = 20  # Spearman must be defined (and in [-1, 1]) with this many tokens
    identity_kl_tol: float = 1e-6  # KL of the identity patch (patched = true state)
    kl_rounding_tol: float = 1e-5  # how far below 0 a KL may fall before the clamp (rounding)
    min_random_kl: float = 1e-6  # random control mean KL: above rounding (a patch not applied gives ~1e-8)
    identity_sequences: int = 2  # sequences patched with their own state, per layer


@dataclass(frozen=True)
class CheckDef:
    name: str
    blocking: bool
    description: str


# What each check is; which stage runs it is in updatelens.stages (a stage names its checks).
CHECK_DEFS: dict[str, CheckDef] = {c.name: c for c in [
    CheckDef("activations_valid", True, "row count = tokens of the sample, vector length = d_model, "
             "no NaN/Inf, norms within bounds; `tokens` has a text for every token, with the same ids"),
    CheckDef("activations_match_hidden_states", True, "captured states equal the model's "
             "output_hidden_states (all but the last) on a sample of sequences"),
    CheckDef("fits_valid", True, "one finite T(x) of length d_model per kept token and class; "
             "degenerate share under its bound"),
    CheckDef("fits_refit_audit", True, "a random sample of anchors per local class, re-fitted from "
             "the stored neighbours and states outside the stage's batched path, gives the stored T(x)"),
    CheckDef("residuals_match_fits", True, "the stored residuals, read back, equal y - T(x) of the stored "
             "states and fits to float tolerance (a damaged or misaligned file, not a fit error); relative "
             "errors finite and >= 0"),
    CheckDef("rel_err_within_bounds", False, "median relative error of the best class is "
             "below its configured bound"),
    CheckDef("no_blown_up_fits", False, "no residual longer than 10 x both the layer's 99th-percentile "
             "update and its own update (a fit that blew up on an ill-conditioned neighbourhood)"),
    CheckDef("rel_err_drift", False, "per class, the 10/50/90 % quantiles of the relative error within "
             "5 % of the partition's previous materialization under the same configuration (a changed "
             "solver or stage shows; nothing to compare on a first materialization)"),
    CheckDef("geometry_ranges", False, "one row per kept token and class, each once; every value present and "
             "finite: cosines in [-1, 1], angles in [0, 180], projection energies and shares in [0, 1] (the fits "
             "against the exact split: null on every row where no self-and-first output was captured); singular "
             "values >= 0, cumulative energies in [0, 1], and the spectrum of the update holding every kept "
             "token's update once"),
    CheckDef("controls_valid", False, "every configured control the architecture has, the null target and the "
             "exact split present, each measured as geometry_ranges measures the real layer; the exact split's "
             "context_split: one row per kept token in order, ||Δ_full|| the activations' ||y - x||, Δ_ctl + a "
             "adding up to Δ_full, values in range; context_heads: a row per head, the heads together and "
             "each distance bin, each share the activations' sources give, the distance parts adding up to a, "
             "each head's attention mass to 1"),
    CheckDef("functional_valid", False, "KL finite and, before its clamp at 0, not below -rounding; "
             "the random-direction control moves the output (patches are applied); Spearman in [-1, 1] "
             "with enough tokens; the identity patch gives KL 0"),
]}
# by stage, in the stage description's order (a name without a definition fails here, at import)
CHECKS: dict[str, list[CheckDef]] = {s.name: [CHECK_DEFS[c] for c in s.checks] for s in STAGES}


def specs(asset: str) -> list[dg.AssetCheckSpec]:
    return [dg.AssetCheckSpec(c.name, asset=asset, blocking=c.blocking, description=c.description)
            for c in CHECKS[asset]]


def _metadata(verdict: Verdict, partitions: int, settings: CheckSettings) -> dict[str, Any]:
    evaluated = sorted(set(verdict.evaluated))
    n_failed = len(verdict.failures)
    metadata: dict[str, Any] = {
        "partitions_checked": partitions,
        "expectations": dg.MetadataValue.json(evaluated),
        "expectations_evaluated": len(verdict.evaluated),
        "expectations_failed": n_failed,
        "expectations_passed": len(verdict.evaluated) - n_failed,
        "thresholds": dg.MetadataValue.json(settings.model_dump()),
    }
    if verdict.measured:
        metadata["measured"] = dg.MetadataValue.json(verdict.measured)
    if verdict.not_checked:
        metadata["not_checked"] = dg.MetadataValue.md("\n".join(f"- {n}" for n in verdict.not_checked[:50]))
    if n_failed:
        metadata["failures"] = dg.MetadataValue.md("\n".join(f"- {f}" for f in verdict.failures[:50]))
        metadata["worst_offenders"] = dg.MetadataValue.json(verdict.offenders[:20])
    return metadata


@dataclass
class Outcome:
    """One check's verdicts on the partitions a run wrote: an evaluation per partition (its own
    expectations and offenders) and the run's result, which passes iff every partition passes (what
    blocks the downstream steps of a blocking check)."""

    asset: str
    name: str
    verdicts: dict[str, Verdict]  # partition key -> verdict
    settings: CheckSettings

    @property
    def blocking(self) -> bool:
        return next(c.blocking for c in CHECKS[self.asset] if c.name == self.name)

    @property
    def severity(self) -> dg.AssetCheckSeverity:
        return dg.AssetCheckSeverity.ERROR if self.blocking else dg.AssetCheckSeverity.WARN

    def evaluations(self) -> list[dg.AssetCheckEvaluation]:
        """One per partition, in partition order, the passing ones first: the UI takes the check's
        last evaluation for its status, so a failure anywhere is what it shows."""
        return [dg.AssetCheckEvaluation(asset_key=dg.AssetKey(self.asset), check_name=self.name, passed=v.passed,
                                        metadata=_metadata(v, 1, self.settings), severity=self.severity,
                                        description=_description(v), blocking=self.blocking, partition=key)
                for key, v in sorted(self.verdicts.items(), key=lambda kv: (not kv[1].passed, kv[0]))]

    def result(self) -> dg.AssetCheckResult:
        """The run's result over its partitions (failures prefixed by their partition)."""
        total = Verdict()
        for partition, v in sorted(self.verdicts.items()):
            total.merge(v, prefix=f"{partition}: " if len(self.verdicts) > 1 else "")
        return dg.AssetCheckResult(asset_key=self.asset, check_name=self.name, passed=total.passed,
                                   severity=self.severity, metadata=_metadata(total, len(self.verdicts), self.settings),
                                   description=_description(total))


def _description(verdict: Verdict) -> str | None:
    """The first failures; else, where something could not be checked, what and why."""
    if verdict.failures:
        return "; ".join(verdict.failures[:3])
    if verdict.not_checked:
        return "passed; not checked: " + "; ".join(verdict.not_checked[:3])
    return None
