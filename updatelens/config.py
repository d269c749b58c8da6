"""The analysis configuration: every knob of the method (docs/method.md), validated, hashed and recorded with results."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

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
CONTROLS = ("random", "crude", "identity")
# positive controls (docs/method.md, "Positive controls"): targets that are tokenwise by construction,
# fitted and measured like the real update on the same neighbours. self_only: block l run with each
# token attending to itself alone (attention architectures); linear: a ridge map x -> x + xB fitted to
# the real update without the token's document
POSITIVE_CONTROLS = ("self_only", "linear")
# settings that change how the work is batched, never the numbers: left out of config_id
EXECUTION_KEYS = ("anchor_chunk", "patch_batch", "capture_batch", "kl_block", "kl_budget_mb")


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
    n_seq: int = 16
    seq_len: int = 128
    corpus_offset: int = 0  # number of corpus windows skipped before the sample starts
    # at most this many windows from one document (0: no limit): windows of one article are not
    # independent, so the sample spreads over documents (the default 16 windows: 16 articles)
    windows_per_doc: int = 1
    skip_first_position: bool = True  # drop position 0 (the attention sink) from every statistic
    # neighbours
    k: int = 64
    metric: str = "cosine_centered"
    exclusion: str = "document"  # the anchor's own document is never its neighbour
    # "auto": exact search up to ann_threshold kept tokens per layer, the clustered approximate index
    # above (exact search costs N^2 d; `python -m bench --only knn` measures both against N)
    index: str = "auto"
    ann_threshold: int = 32768
    # fits
    classes: tuple[str, ...] = ("diagonal", "lowrank")
    rank: int = 8
    ridge: float = 1e-3  # times the mean eigenvalue of each fit's normal matrix
    fit_dtype: str = "float64"
    orthogonal_scale: bool = True
    max_cond: float = 1e10  # fits whose regularised system is worse are flagged degenerate
    folds: int = 2  # sequence folds for the per-layer classes (global_linear, mlp)
    mlp_hidden: int = 256
    mlp_steps: int = 300
    mlp_lr: float = 1e-3
    # anchors per batched solve: 32 measured fastest on the CPU with one chunk per worker thread
    # (SmolLM2, k=64: 1945 lowrank anchors/s vs 1853 at 64); raise it on a GPU
    anchor_chunk: int = 32
    # geometry
    subspace_ms: tuple[int, ...] = (1, 4, 16, 64)
    energy_threshold: float = 0.9
    # bootstrap over documents: resamples behind every finding's interval but finding 3's. The effective
    # ranks of finding 3 take a delete-a-group jackknife over documents instead (`jackknife_groups`
    # groups, each left out once; leave-one-out where there are fewer documents): an effective rank on
    # a resample drawn with replacement is biased low (repeated documents look like fewer directions),
    # so the bootstrap's percentile interval can miss its own point; the jackknife's is centred on it.
    # Each group costs five d x d eigendecompositions per class and layer (0: finding 3 without interval)
    bootstrap: int = 200
    jackknife_groups: int = 20
    bootstrap_unit: str = "document"  # the independent unit a resample draws with replacement
    # functional metrics
    patch_mode: str = "auto"
    single_positions: int = 4  # positions per sequence in "single" patch mode
    # positions per sequence whose total effect on the later positions is measured: the sum over the
    # positions after t of the KL when t alone has r removed, one patched pass each (0: none). 1 per
    # sequence (16 tokens a layer, 480 over SmolLM2's 30): 2 made the default job 1.57 x the job without
    # the control and the later effects (bench/records/calibration_cost-later_positions2-smollm2-135m.json)
    later_positions: int = 1
    controls: tuple[str, ...] = ("random", "crude")
    control_class: str = ""  # class whose residual the controls use; "" = the last class listed
    crude_class: str = "diagonal"
    # self_only by default (the linear control doubles the stage's cost: the calibration study runs
    # both); where the architecture has no self-only block, the linear control stands in for it
    positive_controls: tuple[str, ...] = ("self_only",)
    patch_batch: int = 8  # rows (variant x sequence) per patched forward pass (8: measured fastest on SmolLM2, CPU)
    # sequences whose unpatched distributions are held at once by the functional stage: its memory is
    # block x seq_len x vocabulary x 4 bytes, whatever n_seq, the block being kl_block capped by kl_budget_mb
    # below (SmolLM2: 10 x 128 x 49,152 x 4 bytes = 240 MiB)
    kl_block: int = 16
    # ... and at most this many MiB of them: a 262,144-token vocabulary (Gemma) makes one 128-token
    # sequence 128 MiB of float32 log-probabilities, so its block is 2 sequences (`kl_block_size`;
    # SmolLM2's 10), which keeps Gemma's default job within its 3 GiB memory target
    kl_budget_mb: int = 256
    # execution
    capture_batch: int = 8
    device: str = "cpu"
    seed: int = 0

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

        if self.n_seq < 1:
            bad(f"n_seq must be >= 1, got {self.n_seq}")
        if self.seq_len < 2:
            bad(f"seq_len must be >= 2, got {self.seq_len}")
        if max_positions is not None and self.seq_len > max_positions:
            bad(f"seq_len={self.seq_len} exceeds the model's context of {max_positions} positions; "
                f"lower seq_len")
        for c in self.classes:
            if c not in FN_CLASSES:
                bad(f"unknown function class {c!r}; choose from {', '.join(FN_CLASSES)}")
        if not self.classes:
            bad("classes is empty; list at least one function class")
        if len(set(self.classes)) != len(self.classes):
            bad(f"classes lists a class twice: {self.classes}")
        if self.metric not in METRICS:
            bad(f"unknown metric {self.metric!r}; choose from {', '.join(METRICS)}")
        if self.exclusion not in EXCLUSIONS:
            bad(f"unknown neighbour exclusion {self.exclusion!r}; choose from {', '.join(EXCLUSIONS)}")
        if self.index not in INDEXES:
            bad(f"unknown index {self.index!r}; choose from {', '.join(INDEXES)}")
        if self.fit_dtype not in DTYPES:
            bad(f"unknown fit_dtype {self.fit_dtype!r}; choose from {', '.join(DTYPES)}")
        if self.patch_mode not in PATCH_MODES:
            bad(f"unknown patch_mode {self.patch_mode!r}; choose from {', '.join(PATCH_MODES)}")
        for c in self.controls:
            if c not in CONTROLS:
                bad(f"unknown control {c!r}; choose from {', '.join(CONTROLS)}")
        for c in self.positive_controls:
            if c not in POSITIVE_CONTROLS:
                bad(f"unknown positive control {c!r}; choose from {', '.join(POSITIVE_CONTROLS)}")
        if len(set(self.positive_controls)) != len(self.positive_controls):
            bad(f"positive_controls lists a control twice: {self.positive_controls}")
        if self.k < 1:
            bad(f"k must be >= 1, got {self.k}")
        n_kept_per_seq = self.seq_len - (1 if self.skip_first_position else 0)
        doc_windows = min(self.windows_per_doc or self.n_seq, self.n_seq)
        candidates = self.n_seq * n_kept_per_seq - {"document": doc_windows * n_kept_per_seq,
                                                    "sequence": n_kept_per_seq, "self": 1, "none": 0}[self.exclusion]
        if any(c in LOCAL_CLASSES for c in self.classes) and self.k >= candidates:
            bad(f"k={self.k} must be below the number of candidate neighbours ({candidates} = kept "
                f"tokens minus those excluded by exclusion={self.exclusion!r}); lower k or sample "
                f"more sequences")
        if self.rank < 1:
            bad(f"rank must be >= 1, got {self.rank}")
        if d_model is not None and "lowrank" in self.classes and self.rank >= d_model:
            bad(f"rank={self.rank} must be below d_model={d_model}")
        if self.ridge < 0:
            bad(f"ridge must be >= 0, got {self.ridge}")
        if any(c in GLOBAL_CLASSES for c in self.classes):
            if self.folds < 2:
                bad(f"folds must be >= 2 for held-out fits, got {self.folds}")
            if self.n_seq < self.folds:
                bad(f"n_seq={self.n_seq} is below folds={self.folds}: each fold needs a held-out "
                    f"sequence")
        if self.windows_per_doc < 0:
            bad(f"windows_per_doc must be >= 0 (0: no limit), got {self.windows_per_doc}")
        if self.bootstrap_unit not in UNITS:
            bad(f"unknown bootstrap_unit {self.bootstrap_unit!r}; choose from {', '.join(UNITS)}")
        if self.bootstrap < 0 or self.jackknife_groups < 0:
            bad(f"bootstrap and jackknife_groups must be >= 0, got {self.bootstrap}, {self.jackknife_groups}")
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
        if not 0 < self.energy_threshold <= 1:
            bad(f"energy_threshold must be in (0, 1], got {self.energy_threshold}")
        if "crude" in self.controls:
            if self.crude_class not in FN_CLASSES:
                bad(f"unknown crude_class {self.crude_class!r}")
            if self.crude_class not in self.classes:
                bad(f"the crude control needs crude_class={self.crude_class!r} among classes "
                    f"{self.classes}; add it or drop 'crude' from controls")
        if self.control_class and self.control_class not in self.classes:
            bad(f"control_class={self.control_class!r} is not among classes {self.classes}")
        if self.later_positions < 0:
            bad(f"later_positions must be >= 0, got {self.later_positions}")
        if min(self.patch_batch, self.capture_batch, self.anchor_chunk, self.kl_block, self.kl_budget_mb) < 1:
            bad("patch_batch, capture_batch, anchor_chunk, kl_block and kl_budget_mb must be >= 1")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
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
