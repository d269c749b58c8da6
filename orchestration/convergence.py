"""Convergence study: nested samples of one model (the first n windows for growing n), each analysed in
full under `<data root>/convergence/n_seq=<n>/`; the SQL view `convergence` lists every finding at every
size with its interval. Run from the CLI (`updatelens converge`) or as the Dagster job `converge`.

(No `from __future__ import annotations`: Dagster reads the op's config annotation at definition time.)"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dagster as dg
import polars as pl

from updatelens.assets.common import frame_table
from updatelens.assets.resources import AnalysisSettings, UpdateLensResource
from updatelens.config import preset_layers, preset_settings
from updatelens.errors import ConfigError
from updatelens.orchestration.runner import (
    check_inputs,
    failure_message,
    materialize_model,
    root_instance,
    run_groups,
    stale_layers,
)
from updatelens.preflight import Preflight, check_data_root, estimate_bytes
from updatelens.registry import DEFAULT_MODEL
from updatelens.storage.layout import convergence_root
from updatelens.storage.location import url

DEFAULT_TOKENS = (2048, 8192, 32768, 131072)


@dataclass
class ConvergencePlan:
    model: str
    sizes: list[tuple[int, UpdateLensResource]]  # (tokens, the lens of that size's data root)
    layers: list[int]
    report: Preflight


def plan_convergence(model: str, lens: UpdateLensResource, tokens: Sequence[int],
                     layers: Sequence[int] | None = None, preset: str = "") -> ConvergencePlan:
    """Every size's lens, checked before any weight is loaded (ConfigError names the problem).
    Layers default to the first, middle and last. `preset`: named settings over the lens's (the
    study's by default in the CLI and the job, so the largest size is the study preset's run)."""
    named = {key: value for key, value in preset_settings(preset).items() if key != "n_seq"} if preset else {}
    # AnalysisSettings is made by pydantic.create_model: mypy cannot see its methods
    analysis = {**lens.analysis.model_dump(), **named}  # type: ignore[attr-defined]
    lens = UpdateLensResource(**{**lens.model_dump(), "analysis": AnalysisSettings(**analysis)})
    base = lens.config()
    sizes = sorted(set(tokens))
    if not sizes:
        raise ConfigError("no sample size given")
    bad = [t for t in sizes if t < base.seq_len or t % base.seq_len]
    if bad:
        raise ConfigError(f"sample sizes {bad}: each must be a multiple of seq_len={base.seq_len}")
    plans = []
    for n_tokens in sizes:
        settings = {**lens.analysis.model_dump(), "n_seq": n_tokens // base.seq_len}  # type: ignore[attr-defined]
        # a new resource, not model_copy: inside a run, Dagster's initialised copy ignores copied fields
        sub = UpdateLensResource(**{**lens.model_dump(), "analysis": AnalysisSettings(**settings),
                                    "data_root": url(convergence_root(lens.root, n_tokens // base.seq_len))})
        sub.config().validate()
        plans.append((n_tokens, sub))
    report = check_inputs(model, plans[-1][1], list(layers) if layers else None, preset="study")
    chosen = sorted(set(layers)) if layers else preset_layers("study", report.n_layers)
    # every size's root lies under this one: the disk must hold them all
    check_data_root(lens.root, sum(estimate_bytes(sub.config(), len(chosen), report.d_model) for _, sub in plans))
    return ConvergencePlan(model, plans, chosen, report)


def run_convergence(plan: ConvergencePlan, force: bool = False, log: Callable[[str], None] = print) -> str | None:
    """Analyse every size's stale layers (all with `force`), smallest first, each contiguous range of
    layers one in-process run; the first failure's message, or None. Each size is a data root of its
    own and its runs go to that root's Dagster instance (`root_instance`), so they never show as the
    main root's materializations."""
    for n_tokens, sub in plan.sizes:
        todo = stale_layers(sub, plan.model, plan.layers, force=force)
        log(f"converge: {n_tokens} tokens ({sub.config().n_seq} sequences), layers "
            f"{','.join(map(str, todo)) or 'up to date'}")
        if not todo:
            continue
        with root_instance(sub.data_root) as instance:
            for stages, layer_range in run_groups(todo):
                result = materialize_model(plan.model, sub, instance, layers=layer_range, log_level="INFO",
                                           raise_on_error=False, report=plan.report, stages=stages)
                if not result.success:
                    return failure_message(result)
    return None


def convergence_table(lens: UpdateLensResource, model: str) -> pl.DataFrame:
    """The model's rows of the `convergence` view (a polars frame), values rounded for display."""
    store = lens.store
    store.refresh()
    return store.query("SELECT finding, fn_class, n_tokens, round(value, 3) AS value, "
                       "round(ci_lo, 3) AS ci_lo, round(ci_hi, 3) AS ci_hi, verdict, threshold "
                       "FROM convergence WHERE model = $1 ORDER BY finding, fn_class, n_tokens", [model])


class ConvergeConfig(dg.Config):
    """The study to run: model, sample sizes in tokens (multiples of seq_len), layers (empty: first,
    middle and last), the named settings applied over the resource's ("study" by default, so the
    largest size is the study preset; "" for the resource's own), and whether to recompute sizes
    already up to date."""

    model: str = DEFAULT_MODEL
    tokens: list[int] = list(DEFAULT_TOKENS)
    layers: list[int] = []
    preset: str = "study"
    force: bool = False


@dg.op(description="Analyse nested samples of one model under <data root>/convergence/n_seq=<n>/ (each size a "
                   "data root with its own Dagster instance, <size root>/_dagster, so its runs never mix with "
                   "this root's history) and list each finding against the sample size.")
def converge_sizes(context: dg.OpExecutionContext, config: ConvergeConfig, lens: UpdateLensResource) -> None:
    plan = plan_convergence(config.model, lens, config.tokens, config.layers or None, config.preset)
    failure = run_convergence(plan, config.force, log=context.log.info)
    if failure is not None:
        raise dg.Failure(f"a convergence run failed: {failure}")
    table = convergence_table(lens, config.model)
    context.add_output_metadata({
        "sizes": ", ".join(str(t) for t, _ in plan.sizes),
        "layers": ", ".join(map(str, plan.layers)),
        "rows": len(table),
        "convergence": frame_table(table),
    })


@dg.job(name="converge", description="Convergence study of one model: nested samples (2k to 131k tokens by "
                                      "default), each analysed in full; SQL view `convergence`.")
def converge_job() -> None:
    converge_sizes()
