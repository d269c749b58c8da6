"""The analysis configuration: every knob of the method (docs/method.md), validated, hashed and recorded with results."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from updatelens.errors import ConfigError

LOCAL_CLASSES = ("diagonal", "psd_diagonal", "lowrank", "orthogonal")
GLOBAL_CLASSES = ("global_linear", "mlp")
FN_CLASSES = LOCAL_CLASSES + GLOBAL_CLASSES
METRICS = ("cosine_centered", "cosine", "l2")
EXCLUSIONS = ("document", "sequence", "self", "none")
UNITS = ("document", "sequence")  # what a bootstrap resample draws
INDEXES = ("auto", "exact", "clustered", "ivf", "ivf_batch", "hnsw")
DTYPES = ("float64", "float32")
# auto: "exact" where the architecture supports it (updatelens.single_position), else "all";
# exact: every position's effect when it alone is patched (one pass of the unpatched and patched
# streams); all: every position patched at once; single: one position per pass on a subsample
PATCH_MODES = ("auto", "exact", "all", "single")
# context: y replaced by the self-and-first output y_ctl (the exact split's part a removed: what attention to
# the context adds), where the activations hold it (attention models)
CONTROLS = ("random", "crude", "identity", "context")
# positive controls (docs/method.md, "Positive controls"): targets that are tokenwise by construction,
# fitted and measured like the real update on the same neighbours. self_first: block l run with each
# token attending to itself and the window's first position (attention architectures); linear: a ridge map x -> x + xB fitted to
# the real update without the token's document
POSITIVE_CONTROLS = ("self_first", "linear")
# settings that change how the work is batched, never the numbers: left out of config_id
EXECUTION_KEYS = ("anchor_chunk", "patch_batch", "capture_batch", "kl_block", "kl_budget_mb")


def setting(default: object, *, choices: tuple[str, ...] = (), minimum: float | None = None,
            maximum: float | None = None, above: float | None = None, what: str = "", flag: str = "",
            help: str = "") -> Any:
    """A field of AnalysisConfig with what checking, the Dagster launchpad and the command line need to
    know of it: `choices` (a string field's values, or a list field's items' values; `what` names them
    in the error), its range (`minimum` and `maximum` inclusive, `above` exclusive), `flag` (a flag of
    `updatelens run` of its own, e.g. "--k") and `help`. From these come the per-field checks of
    `validate`, the Dagster config's descriptions, the flags and `updatelens run --help`'s list of settings."""
    return dataclasses.field(default=default, metadata={"choices": choices, "minimum": minimum, "maximum": maximum,
                                                        "above": above, "what": what, "flag": flag, "help": help})


def json_object_env(name: str) -> dict[str, object] | None:
    """The JSON object held by environment variable `name`; None when it is unset or empty. A value
    that is not valid JSON, or not an object, is a ConfigError naming the variable."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"${name} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class AnalysisConfig:
    """Everything that determines the numbers. Hashed into `config_id`, written beside each result."""

    # sample
    n_seq: int = setting(16, minimum=1, flag="--n-seq", help="windows of the corpus in the sample")
    seq_len: int = setting(128, minimum=2, flag="--seq-len", help="tokens per window")
    corpus_offset: int = setting(0, minimum=0, help="corpus windows skipped before the sample starts")
    # windows of one article are not independent, so the sample spreads over documents (the default 16
    # windows: 16 articles)
    windows_per_doc: int = setting(1, minimum=0, help="at most this many windows from one document (0: no limit)")
    skip_first_position: bool = setting(True, help="drop position 0 (the attention sink) from every statistic")
    # neighbours
    k: int = setting(64, minimum=1, flag="--k", help="neighbours of each local fit")
    metric: str = setting("cosine_centered", choices=METRICS, what="metric", help="the neighbours' distance")
    exclusion: str = setting("document", choices=EXCLUSIONS, what="neighbour exclusion",
                             help="who may not be a token's neighbour: its document, sequence, itself, or none")
    # exact search costs N^2 d; `python -m bench --only knn` measures both against N
    index: str = setting("auto", choices=INDEXES, what="index",
                         help="the k-NN index; auto: exact up to ann_threshold kept tokens per layer, clustered above")
    ann_threshold: int = setting(32768, minimum=1, help="kept tokens per layer above which index=auto is approximate")
    # fits
    classes: tuple[str, ...] = setting(("diagonal", "lowrank"), choices=FN_CLASSES, what="function class",
                                       flag="--classes", help="function classes of T, comma-separated")
    rank: int = setting(8, minimum=1, flag="--rank", help="rank of the lowrank class")
    ridge: float = setting(1e-3, minimum=0, help="the fits' ridge, times the mean eigenvalue of each normal matrix")
    fit_dtype: str = setting("float64", choices=DTYPES, what="fit_dtype", help="the fits' solve precision")
    orthogonal_scale: bool = setting(True, help="the orthogonal class fits a scale too")
    max_cond: float = setting(1e10, minimum=1, maximum=1e300, help="fits whose regularised system is worse are "
                                                                    "flagged degenerate")
    folds: int = setting(2, help="sequence folds of the per-layer classes (global_linear, mlp)")
    mlp_hidden: int = setting(256, minimum=1, help="hidden width of the mlp class")
    mlp_steps: int = setting(300, minimum=1, help="training steps of the mlp class")
    mlp_lr: float = setting(1e-3, above=0, maximum=10, help="learning rate of the mlp class")
    # 32 measured fastest on the CPU with one chunk per worker thread (SmolLM2, k=64: 1945 lowrank
    # anchors/s vs 1853 at 64); raise it on a GPU
    anchor_chunk: int = setting(32, minimum=1, help="anchors per batched solve (batching only)")
    # geometry
    subspace_ms: tuple[int, ...] = setting((1, 4, 16, 64), help="top-m tokenwise subspaces projected on (must hold 16)")
    energy_threshold: float = setting(0.9, above=0, maximum=1, help="energy share that defines the dominant subspace")
    # The effective ranks of finding 3 take a delete-a-group jackknife over documents instead of the
    # bootstrap (each group left out once; leave-one-out where there are fewer documents): an effective
    # rank on a resample drawn with replacement is biased low (repeated documents look like fewer
    # directions), so the bootstrap's percentile interval can miss its own point; the jackknife's is
    # centred on it. Each group costs five d x d eigendecompositions per class and layer
    # the resamples' multiplicities are bootstrap x n_seq floats, and each resample is a weighted pass over
    # the layer's tokens: 10,000 bounds both (1e9 asked for 119 GiB before this bound)
    bootstrap: int = setting(200, minimum=0, maximum=10_000,
                             help="bootstrap resamples over documents behind the findings' intervals")
    jackknife_groups: int = setting(20, minimum=0, maximum=1000, help="jackknife groups of finding 3's interval (0: none)")
    bootstrap_unit: str = setting("document", choices=UNITS, what="bootstrap_unit",
                                  help="the independent unit a resample draws with replacement")
    # functional metrics
    patch_mode: str = setting("auto", choices=PATCH_MODES, what="patch_mode",
                              help="how the residual is removed for the KL (auto: exact where supported)")
    single_positions: int = setting(4, minimum=1, help="positions per sequence in the single patch mode")
    # the sum over the positions after t of the KL when t alone has r removed, one patched pass each. 1 per
    # sequence (16 tokens a layer, 480 over SmolLM2's 30): 2 made the default job 1.57 x the job without
    # the control and the later effects (bench/records/calibration_cost-later_positions2-smollm2-135m.json)
    later_positions: int = setting(1, minimum=0, help="positions per sequence whose effect on later positions is "
                                                      "measured (0: none)")
    # the effect on the later positions is the mean KL per later position over a fixed horizon, so it does not
    # grow with how early the token sits (a sum over every later position did); only positions with a whole
    # horizon after them are drawn
    later_horizon: int = setting(16, minimum=1, help="later positions over which each measured position's effect "
                                                     "is averaged (positions with fewer after them are not drawn)")
    # context costs one more patched pass per layer (the default job measured 727 s with it against 561 s
    # for the job before the exact split and the fitted null, the same day): asked for, not by default
    controls: tuple[str, ...] = setting(("random", "crude"), choices=CONTROLS, what="control",
                                        help="the functional controls, each a patched pass")
    control_class: str = setting("", help="class whose residual the controls use (empty: the last class listed)")
    crude_class: str = setting("diagonal", help="the crude control's class")
    # self_first by default (the linear control doubles the stage's cost: the calibration study runs
    # both); where the architecture has no self-and-first block, the linear control stands in for it
    positive_controls: tuple[str, ...] = setting(("self_first",), choices=POSITIVE_CONTROLS, what="positive control",
                                                 help="targets tokenwise by construction, measured like the layer")
    # 8: measured fastest on SmolLM2, CPU
    patch_batch: int = setting(8, minimum=1, help="rows (variant x sequence) per patched forward pass (batching only)")
    # the functional stage's memory is block x seq_len x vocabulary x 4 bytes, whatever n_seq, the block
    # being kl_block capped by kl_budget_mb (SmolLM2: 8 x 128 x 49,152 x 4 bytes = 192 MiB)
    kl_block: int = setting(16, minimum=1, help="sequences whose unpatched distributions are held at once")
    # a 262,144-token vocabulary (Gemma) makes one 128-token sequence 128 MiB of float32
    # log-probabilities, so its block is 1 sequence (`kl_block_size`; SmolLM2's 8): with 2 (256 MiB) the
    # Gemma default job's functional stage peaked at 3.07 GiB, above its 3 GiB target
    kl_budget_mb: int = setting(192, minimum=1, help="... and at most this many MiB of them")
    # execution
    capture_batch: int = setting(8, minimum=1, help="sequences per captured forward pass (batching only)")
    device: str = setting("cpu", help="cpu or cuda[:i]")
    seed: int = setting(0, minimum=0, maximum=2**31 - 1,
                        help="seed of every random draw (resamples, random directions, sampled positions, index training)")

    def __post_init__(self) -> None:
        # tuples survive JSON and Dagster config as lists; normalise so hashing is stable
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "subspace_ms", tuple(int(m) for m in self.subspace_ms))
        object.__setattr__(self, "controls", tuple(self.controls))
        object.__setattr__(self, "positive_controls", tuple(self.positive_controls))

    # ---- validation -------------------------------------------------------------------------
    def validate(self, d_model: int | None = None, max_positions: int | None = None) -> None:
        """Raise ConfigError naming the first problem. Cheap: call before any heavy work."""

        def bad(msg: str) -> None:
            raise ConfigError(msg)

        for f in dataclasses.fields(self):  # what each field declares (`setting`)
            value, meta = getattr(self, f.name), f.metadata
            for item in (value if isinstance(value, tuple) else (value,)):
                if meta.get("choices") and item not in meta["choices"]:
                    bad(f"unknown {meta['what']} {item!r}; choose from {', '.join(meta['choices'])}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value != value:
                bad(f"{f.name} must be a number, got {value}")  # NaN passes every comparison below
            if meta.get("minimum") is not None and value < meta["minimum"]:
                bad(f"{f.name} must be >= {meta['minimum']}, got {value}")
            if meta.get("maximum") is not None and value > meta["maximum"]:
                bad(f"{f.name} must be <= {meta['maximum']}, got {value}")
            if meta.get("above") is not None and not value > meta["above"]:
                bad(f"{f.name} must be > {meta['above']}, got {value}")
        if max_positions is not None and self.seq_len > max_positions:
            bad(f"seq_len={self.seq_len} exceeds the model's context of {max_positions} positions; "
                f"lower seq_len")
        if not self.classes:
            bad("classes is empty; list at least one function class")
        if len(set(self.classes)) != len(self.classes):
            bad(f"classes lists a class twice: {self.classes}")
        if len(set(self.positive_controls)) != len(self.positive_controls):
            bad(f"positive_controls lists a control twice: {self.positive_controls}")
        n_kept_per_seq = self.seq_len - (1 if self.skip_first_position else 0)
        doc_windows = min(self.windows_per_doc or self.n_seq, self.n_seq)
        candidates = self.n_seq * n_kept_per_seq - {"document": doc_windows * n_kept_per_seq,
                                                    "sequence": n_kept_per_seq, "self": 1, "none": 0}[self.exclusion]
        if any(c in LOCAL_CLASSES for c in self.classes) and self.k >= candidates:
            bad(f"k={self.k} must be below the number of candidate neighbours ({candidates} = kept "
                f"tokens minus those excluded by exclusion={self.exclusion!r}); lower k or sample "
                f"more sequences")
        if d_model is not None and "lowrank" in self.classes and self.rank >= d_model:
            bad(f"rank={self.rank} must be below d_model={d_model}")
        if any(c in GLOBAL_CLASSES for c in self.classes):
            if self.folds < 2:
                bad(f"folds must be >= 2 for held-out fits, got {self.folds}")
            if self.n_seq < self.folds:
                bad(f"n_seq={self.n_seq} is below folds={self.folds}: each fold needs a held-out "
                    f"sequence")
        if self.jackknife_groups == 1:
            bad("jackknife_groups must be 0 (no interval for finding 3) or at least 2, got 1")
        if not self.subspace_ms or min(self.subspace_ms) < 1:
            bad(f"subspace_ms must be positive integers, got {self.subspace_ms}")
        if 90 in self.subspace_ms:  # proj_*_m90 names the 90 %-energy subspace (updatelens.schemas)
            bad(f"subspace_ms may not include 90: the columns proj_*_m90 hold the projections on the "
                f"subspace with 90 % of the tokenwise energy, got {self.subspace_ms}")
        if 16 not in self.subspace_ms:  # the views read proj_*_m16 (finding "2 projection", layer_summary)
            bad(f"subspace_ms must include 16 (finding 2's projection and the per-layer summary read the "
                f"top-16 projections), got {self.subspace_ms}")
        if "crude" in self.controls:
            if self.crude_class not in FN_CLASSES:
                bad(f"unknown crude_class {self.crude_class!r}")
            if self.crude_class not in self.classes:
                bad(f"the crude control needs crude_class={self.crude_class!r} among classes "
                    f"{self.classes}; add it or drop 'crude' from controls")
        if self.control_class and self.control_class not in self.classes:
            bad(f"control_class={self.control_class!r} is not among classes {self.classes}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            bad(f"device must be 'cpu' or 'cuda[:i]', got {self.device!r}")

    # ---- identity ---------------------------------------------------------------------------
    @property
    def primary_class(self) -> str:
        return self.control_class or self.classes[-1]

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        for key, value in d.items():
            if isinstance(value, tuple):
                d[key] = list(value)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def config_id(self) -> str:
        """Short hash of everything that changes results (execution batch sizes excluded)."""
        d = self.to_dict()
        for key in EXECUTION_KEYS:
            d.pop(key)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> AnalysisConfig:
        """A configuration from plain values (JSON, CLI, Dagster config); ConfigError names an unknown
        key or a value of the wrong type (one line, before any work)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ConfigError(f"unknown configuration keys: {sorted(unknown)}; known: {', '.join(sorted(fields))}")
        for name, value in d.items():
            _check_type(name, fields[name].default, value)
        return cls(**d)  # type: ignore[arg-type]

    def kl_block_size(self, vocab: int) -> int:
        """Sequences whose unpatched distributions the functional stage holds at once: kl_block, fewer
        where their float32 log-probabilities (seq_len x vocab x 4 bytes each) exceed kl_budget_mb."""
        per_sequence = self.seq_len * vocab * 4
        return max(1, min(self.kl_block, (self.kl_budget_mb << 20) // per_sequence))

    def replace(self, **changes: object) -> AnalysisConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]



def field_help(f: dataclasses.Field) -> str:
    """A setting in one line: its help, its choices and its default (the launchpad's description, the
    flags' help and `updatelens run --help`)."""
    meta, default = f.metadata, f.default
    shown = (",".join(map(str, default)) if isinstance(default, tuple)
             else default if isinstance(default, str) and default else json.dumps(default))
    parts = [meta.get("help", "")] if meta.get("help") else []
    if meta.get("choices"):
        parts.append(f"one{' or more' if isinstance(default, tuple) else ''} of {', '.join(meta['choices'])}")
    if meta.get("minimum") is not None:
        parts.append(f">= {meta['minimum']}")
    if meta.get("above") is not None:
        parts.append(f"> {meta['above']}")
    if meta.get("maximum") is not None:
        parts.append(f"<= {meta['maximum']}")
    parts.append(f"default {shown}")
    return "; ".join(parts)


def settings_help() -> str:
    """Every setting with its help: the epilog of `updatelens run --help` (`--set NAME=VALUE`)."""
    return "settings (--set NAME=VALUE; a list as JSON or comma-separated):\n" + "\n".join(
        f"  {f.name}: {field_help(f)}" for f in dataclasses.fields(AnalysisConfig))


def flag_fields() -> list[dataclasses.Field]:
    """The settings with a flag of `updatelens run` of their own (e.g. --k)."""
    return [f for f in dataclasses.fields(AnalysisConfig) if f.metadata.get("flag")]


def parse_setting(name: str, text: str) -> object:
    """A setting's value from the command line: a list as JSON or comma-separated, a string as given,
    a number or true/false as JSON; its type is then checked by `AnalysisConfig.from_dict`."""
    fields = {f.name: f for f in dataclasses.fields(AnalysisConfig)}
    if name not in fields:
        raise ConfigError(f"unknown configuration keys: [{name!r}]; known: {', '.join(sorted(fields))}")
    default = fields[name].default
    if isinstance(default, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if isinstance(default, tuple):
            return [item.strip() for item in text.split(",") if item.strip()]
        return text  # the type check names it

def _check_type(name: str, default: object, value: object) -> None:
    """ConfigError unless `value` has the type of the field's default (an int is a float too; a
    tuple field takes a list or tuple of its items' type)."""

    def fits(expected: type, v: object) -> bool:
        if expected is float:
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if expected is int:
            return isinstance(v, int) and not isinstance(v, bool)
        return isinstance(v, expected)

    if isinstance(default, tuple):
        inner = type(default[0]) if default else str
        if not isinstance(value, (list, tuple)) or not all(fits(inner, v) for v in value):
            raise ConfigError(f"{name} must be a list of {inner.__name__} (e.g. {json.dumps(list(default))}), "
                              f"got {value!r}")
    elif not fits(type(default), value):
        raise ConfigError(f"{name} must be {type(default).__name__} (default {json.dumps(default)}), got {value!r}")


# Named starting points for `updatelens run --preset NAME` (explicit settings override them).
# study: a sample large enough for the paper's claims to settle (1024 windows of 128 tokens, at most 12 per article,
# 130,048 kept tokens per layer), the default classes and controls, intervals for every finding.
PRESETS: dict[str, dict[str, object]] = {
    "study": {"n_seq": 1024, "seq_len": 128, "classes": ["diagonal", "lowrank"], "controls": ["random", "crude"],
              "bootstrap": 200, "jackknife_groups": 50, "windows_per_doc": 12},
}


def preset_settings(name: str) -> dict[str, object]:
    """A preset's settings (a copy); ConfigError names an unknown preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def preset_layers(name: str, n_layers: int) -> list[int]:
    """The layers a preset analyses when none are given: the study takes the first, middle and last."""
    preset_settings(name)  # an unknown name is refused
    return sorted({0, n_layers // 2, n_layers - 1})
