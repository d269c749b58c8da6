"""One schema per stored table, declared once: every column's Arrow type and what it means.

The writer validates every table against its schema before a byte is written (`check`), the DuckDB
catalog puts the descriptions on its views (`COMMENT ON COLUMN`) and the Dagster assets show them as
their column schema. A few columns depend on the configuration: the projection energies of the
geometry table exist for each `subspace_ms` (and for the 90 %-energy subspace, `m90`); vector columns
have the model's width, and `neighbours` has `k` entries.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pyarrow as pa

from updatelens.config import AnalysisConfig
from updatelens.findings import GEOMETRY_STATISTIC_DEFS, RANK_DEFS, SPLIT_STATISTICS

VECTOR = "vector"  # FixedSizeList<float32>[d_model]
NEIGHBOURS = "neighbours"  # FixedSizeList<int32>[k]
FLOATS = "floats"  # FixedSizeList<float32>[n]: a few numbers per row, n fixed by the model (its heads, say)
INTS = "ints"  # FixedSizeList<int32>[n]


class SchemaError(ValueError):
    """A table that does not match its declared schema (named column, expected and found types)."""


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType | str  # an Arrow type, or VECTOR / NEIGHBOURS / FLOATS / INTS (fixed-size lists)
    description: str


def _c(name: str, typ: pa.DataType | str, description: str) -> Column:
    return Column(name, typ, description)


I32, I64, F64, STR, BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()

LAYER = _c("layer", I32, "block index l: the row describes the update h_l -> h_{l+1} of block l")
SEQ = _c("seq", I32, "sequence index in the corpus sample (windows of seq_len tokens)")
POS = _c("pos", I32, "token position within its sequence (0 is BOS or the first token, never analysed)")
FN_CLASS = _c("fn_class", STR, "function class of the fit T: diagonal, psd_diagonal, lowrank, orthogonal, global_linear or mlp")
REPLICATE = _c("replicate", I32, "bootstrap resample over documents (0 .. bootstrap-1); in geometry_bootstrap "
                                 "also -2, -3, ...: the jackknife replicates of the effective ranks")

PROVENANCE: tuple[Column, ...] = (
    _c("model", STR, "model name in the registry"),
    _c("model_revision", STR, "the model's revision (hub commit or file digest)"),
    _c("corpus", STR, "corpus name"),
    _c("corpus_slice", STR, "which documents and windows of the corpus were read"),
    _c("config_id", STR, "digest of the analysis configuration (config_json)"),
    _c("k", I32, "neighbours per local fit"),
    _c("rank", I32, "rank of the low-rank class"),
    _c("dtype", STR, "floating type of the fits"),
    _c("code_version", STR, "code version that wrote the row: its stage's (updatelens.versions), or the whole tree's for a "
       "study's rows (calibration)"),
    _c("config_json", STR, "the whole analysis configuration, as JSON"),
    _c("model_layers", I32, "the model's depth (the analysed layers may be fewer)"),
    _c("weights", STR, "the weights the model ran with: a GGUF's quantization (file type, tensors per type) "
                       "dequantized to the run's dtype, or the checkpoint's dtype and the run's"),
)

_GEOMETRY_PARTS = {"full": "Δ_full = y - x", "tok": "Δ_tok = T(x) - x", "res": "the residual r = y - T(x)"}


def _projections(cfg: AnalysisConfig | None) -> list[Column]:
    """proj_{full,tok,res}_m{m} for each configured m and for m90, then the null's top-16 projection."""
    ms = [f"m{m}" for m in (cfg.subspace_ms if cfg else AnalysisConfig().subspace_ms)] + ["m90"]
    out = []
    for label in ms:
        size = "the smallest m holding 90 % of Δ_tok's energy (m90_tok)" if label == "m90" else label[1:]
        for part, what in _GEOMETRY_PARTS.items():
            out.append(_c(f"proj_{part}_{label}", F64, f"share of the energy of {what} on the layer's top "
                                                       f"{size} tokenwise directions (uncentred SVD of Δ_tok)"))
    return out


def _bootstrap_geometry() -> list[Column]:
    how = {"median": "median of", "share_gt60": "share of tokens with", "mean": "mean of"}
    out = []
    for name, column, agg in GEOMETRY_STATISTIC_DEFS:
        extra = " > 60°" if agg == "share_gt60" else ""
        out.append(_c(name, F64, f"{how[agg]} {column}{extra} on the resample"))
    what = {"full": "Δ_full", "tok": "Δ_tok", "res": "the residual",
            "full_null": "Δ_full with the random-direction residual", "res_null": "the random-direction residual"}
    out += [_c(name, F64, f"effective rank of {what[which]}{' less its mean (centred)' if centred else ''} on the "
                          f"jackknife replicate (replicate <= -2; null on the bootstrap resamples)")
            for name, which, centred in RANK_DEFS]
    return out


_NULL_WITHOUT = " (null where y_ctl is)"
# where a = y - y_ctl comes from, per token (updatelens.context_sources; heads H, distance bins 1, 2-4, 5-16, >16)
_SOURCE_COLUMNS: tuple[Column, ...] = (
    _c("ctx_head_dot", FLOATS, "per head h, <a_h, a>: a_h = y_h - y_ctl, y_h the block with head h attending as in the "
                               "model and the others to themselves and the first position" + _NULL_WITHOUT),
    _c("ctx_head_norm", FLOATS, "per head h, ||a_h||" + _NULL_WITHOUT),
    _c("ctx_dist_dot", FLOATS, "per source-distance bin (1, 2-4, 5-16, >16 positions back), <c_d, a>: c_d what the "
                               "bin's sources add to the nearer ones (the context restored nearest first; the c_d "
                               "add up to a)" + _NULL_WITHOUT),
    _c("ctx_dist_norm", FLOATS, "per source-distance bin, ||c_d||" + _NULL_WITHOUT),
    _c("attn_mass", FLOATS, "per head (head-major), its attention mass on the first position, itself and the sources "
                            "1, 2-4, 5-16, >16 positions back: 6 numbers a head, each head's adding up to 1"
       + _NULL_WITHOUT),
    _c("top_source_pos", INTS, "the 3 positions (not the first, not the token's) with the most attention averaged "
                               "over heads, most first; -1 where fewer exist" + _NULL_WITHOUT),
    _c("top_source_weight", FLOATS, "their head-mean attention (0 where top_source_pos is -1)" + _NULL_WITHOUT),
)

CONTROL = _c("control", STR, "the target that replaced the real y: a positive control, tokenwise by "
                            "construction (self_first: block l with each token attending to itself and the "
                            "window's first position; linear: x + xB fitted without the token's document), or "
                            "the null target (unrelated: x + the update of a token of another document, "
                            "findings 1's null)")
CONTROL_PREFIX = "control_"  # the positive controls' tables: the geometry stage's, with a `control` column


def columns(table: str, cfg: AnalysisConfig | None = None) -> tuple[Column, ...]:
    """The declared columns of `table` under `cfg` (the default configuration when None), in order,
    provenance last."""
    if table.startswith(CONTROL_PREFIX):
        layer, *rest = columns(table[len(CONTROL_PREFIX):], cfg)
        return (layer, CONTROL, *rest)
    body: list[Column]
    if table == "activations":
        body = [SEQ, _c("doc", I32, "the corpus document the sequence was cut from (the bootstrap's unit)"), POS,
                _c("token_id", I64, "input token id"),
                _c("attention_mask", pa.int8(), "1 where the position holds a token"),
                _c("kept", BOOL, "analysed: not position 0, not padding"),
                _c("x", VECTOR, "h_l, the block's input hidden state"),
                _c("y", VECTOR, "h_{l+1}, the block's output hidden state"),
                _c("y_ctl", VECTOR, "block l run on h_l with each token attending to itself and the window's first position: the "
                                     "positive control's target, tokenwise by construction (null where the "
                                     "architecture has no attention or the control was not asked for)"),
                _c("y_lin", VECTOR, "x + xB: the linear control's target, B one ridge map of the layer fitted on "
                                    "held-out windows (documents outside the sample; null where the control is not "
                                    "made)"),
                *_SOURCE_COLUMNS]
    elif table == "tokens":
        body = [SEQ, POS, _c("token_id", I64, "input token id"), _c("token", STR, "the token's text"),
                _c("context", STR, "a short left context ending with the token")]
    elif table == "local_fits":
        body = [FN_CLASS, SEQ, POS, _c("tx", VECTOR, "T(x): the local fit evaluated at the token (out of sample)"),
                _c("fit_cond", F64, "condition number of the fit's normal equations"),
                _c("degenerate", BOOL, "ill-conditioned or non-finite fit"),
                _c(NEIGHBOURS, NEIGHBOURS, "row indices of the k nearest neighbours (other sequences) it was fitted on")]
    elif table == "residuals":
        body = [FN_CLASS, SEQ, POS, _c("residual", VECTOR, "r = y - T(x)"),
                _c("norm_full", F64, "||Δ_full|| = ||y - x||"), _c("norm_tok", F64, "||Δ_tok|| = ||T(x) - x||"),
                _c("norm_res", F64, "||r||"), _c("rel_err", F64, "relative error ||r|| / ||Δ_full||")]
    elif table == "geometry":
        body = [FN_CLASS, SEQ, POS, _c("rel_err", F64, "relative error ||r|| / ||Δ_full||"),
                _c("cos_full_tok", F64, "cos(Δ_full, Δ_tok)"), _c("cos_full_res", F64, "cos(Δ_full, r)"),
                _c("cos_tok_res", F64, "cos(Δ_tok, r)"), _c("cos_full_tok_map", F64, "cos(y, T(x)): the map form"),
                _c("angle_full_tok", F64, "angle(Δ_full, Δ_tok) in degrees"),
                _c("angle_full_res", F64, "angle(Δ_full, r) in degrees"),
                _c("angle_tok_res", F64, "angle(Δ_tok, r) in degrees"), *_projections(cfg),
                _c("cos_full_tok_null", F64, "cos_full_tok with the residual turned to a random direction (same length)"),
                _c("cos_full_tok_map_null", F64, "the map form's null: cos(y, x), the identity map in place of T"),
                _c("angle_full_res_null", F64, "angle_full_res with the random-direction residual"),
                _c("angle_tok_res_null", F64, "angle_tok_res with the random-direction residual"),
                _c("proj_null_m16", F64, "proj_res_m16 of the random-direction residual"),
                _c("cos_res_ctx", F64, "cos(r, a), a = y - y_ctl the exact split's context part (null without y_ctl)"),
                _c("res_share_ctx", F64, "cos(r, a)^2: the share of ||r||^2 along a (null without y_ctl)"),
                _c("cos_tok_ctl", F64, "cos(Δ_tok, Δ_ctl), Δ_ctl = y_ctl - x the exact tokenwise update "
                                       "(null without y_ctl)"),
                _c("m90_tok", I32, "the smallest m holding 90 % of the layer's Δ_tok energy")]
    elif table == "spectra":
        body = [FN_CLASS, _c("which", STR, "the stacked vectors: full, tok, res (and their nulls)"),
                _c("idx", I32, "singular value index, by decreasing size"), _c("sigma", F64, "singular value"),
                _c("cum_energy", F64, "share of the energy in the first idx+1 values"),
                _c("effective_rank", F64, "exp of the entropy of the normalised energies"),
                _c("effective_rank_centred", F64, "effective_rank of the same rows less their mean (the centred "
                                                  "spectrum's; its singular values are not stored)"),
                _c("m_energy", I32, "values holding 90 % of the energy")]
    elif table == "geometry_bootstrap":
        body = [FN_CLASS, REPLICATE, *_bootstrap_geometry()]
    elif table == "functional_metrics":
        body = [FN_CLASS, _c("variant", STR, "the patch: tokenwise (T(x)), random (same-size random "
                                             "perturbation in the residuals' shape), crude (a cruder class), "
                                             "identity, context (y -> y_ctl: the exact split's a removed; its "
                                             "rel_err and norm_res are ||a|| / ||Δ_full|| and ||a||)"),
                _c("patch_mode", STR, "exact: every position's single-position effect in one pass; "
                                      "single: one position patched per pass; all: every position at once"),
                SEQ, POS, _c("kl", F64, "KL(original || patched) of the next-token distribution at the token's "
                                         "own position, in nats (>= 0); exact and single: only that position patched "
                                         "(its own effect, not that on later positions)"),
                _c("rel_err", F64, "the patched state's relative error"), _c("norm_res", F64, "the patched state's ||r||"),
                _c("kl_later", F64, "the mean KL per later position over the `later_horizon` positions after this "
                                    "one when only this position has r removed (its effect on the rest of the "
                                    "sequence), on `later_positions` tokens per sequence of the main patch of the "
                                    "primary class; NaN elsewhere"),
                _c("kl_later_random", F64, "kl_later with this position moved as far as removing r moves it, in a "
                                           "random direction of the residuals' shape (the random control) instead; "
                                           "NaN where kl_later is, or without the random control")]
    elif table == "functional_summary":
        body = [FN_CLASS, _c("variant", STR, "the patch (see functional_metrics)"),
                _c("patch_mode", STR, "exact, single or all"), _c("n_tokens", I32, "tokens patched"),
                _c("kl_mean", F64, "mean KL"), _c("kl_median", F64, "median KL"), _c("kl_max", F64, "largest KL"),
                _c("kl_raw_min", F64, "smallest KL before its clamp at 0 (rounding shows here)"),
                _c("spearman_relerr_kl", F64, "Spearman correlation of rel_err and KL over tokens"),
                _c("spearman_relerr_kl_p", F64, "its p-value (tokens taken as independent: see the bootstrap)"),
                _c("spearman_normres_kl", F64, "Spearman correlation of ||r|| and KL over tokens"),
                _c("spearman_normres_kl_p", F64, "its p-value"),
                _c("kl_ratio_random", F64, "median over tokens of KL(remove r) / KL(random perturbation of the "
                                           "same norm) at the same position (the patch of the random control's "
                                           "class; on the context row, KL(remove a) / KL(context_random); NaN "
                                           "for other rows)"),
                _c("n_later", I32, "tokens whose effect on the later positions was measured"),
                _c("kl_at_mean_on_later", F64, "mean over the same tokens of the KL at the patched position"),
                _c("spearman_kl_later", F64, "Spearman correlation over them of the KL at the patched position "
                                             "and kl_later"),
                _c("kl_later_mean", F64, "mean over them of kl_later (the mean KL per later position over the horizon)"),
                _c("kl_later_random_mean", F64, "mean over them of kl_later_random (the random control's move)"),
                _c("later_ratio_median", F64, "median over them of the paired ratio kl_later / kl_later_random")]
    elif table == "functional_bootstrap":
        body = [FN_CLASS, REPLICATE,
                _c("spearman_relerr_kl", F64, "Spearman(rel_err, KL) on the resample"),
                _c("spearman_normres_kl", F64, "Spearman(||r||, KL) on the resample"),
                _c("spearman_relerr_kl_null", F64, "Spearman(rel_err, KL of the same-size random patch) on the resample"),
                _c("spearman_normres_kl_null", F64, "Spearman(||r||, KL of the same-size random patch) on the resample"),
                _c("kl_ratio_random", F64, "median paired ratio KL(remove r) / KL(random, same norm) on the resample"),
                _c("kl_later_mean", F64, "kl_later_mean of the functional summary on the resample"),
                _c("kl_later_random_mean", F64, "kl_later_random_mean on the resample"),
                _c("later_ratio_median", F64, "later_ratio_median on the resample")]
    elif table == "context_split":
        body = [SEQ, POS, _c("norm_full", F64, "||Δ_full|| = ||y - x||"),
                _c("norm_ctl", F64, "||Δ_ctl|| = ||y_ctl - x||: the update of the self-and-first block (the token's own)"),
                _c("norm_ctx", F64, "||a|| = ||y - y_ctl||: what attention to the rest of the context adds"),
                _c("ctl_ratio", F64, "||Δ_ctl|| / ||Δ_full||"), _c("ctx_ratio", F64, "||a|| / ||Δ_full||"),
                _c("cos_full_ctl", F64, "cos(Δ_full, Δ_ctl)"), _c("cos_ctx_full", F64, "cos(a, Δ_full)"),
                _c("cos_ctx_ctl", F64, "cos(a, Δ_ctl)")]
    elif table == "context_split_bootstrap":
        body = [_c("replicate", I32, "bootstrap resample over documents (0 .. bootstrap-1)"),
                *(_c(name, F64, f"{how} of {column} on the resample") for name, column, how in SPLIT_STATISTICS)]
    elif table == "context_heads":
        body = [_c("kind", STR, "head: one attention head's context restored alone; together: what the heads add only "
                                "together (1 less the heads' shares); distance: what the sources of one distance bin "
                                "add to the nearer ones (the context restored nearest first; these add up to a)"),
                _c("source", STR, "the head's number, 'all heads', or the bin: 1, 2-4, 5-16, >16 positions back"),
                _c("idx", I32, "the head's or the bin's index (-1 for together)"),
                _c("share", F64, "the share of a = y - y_ctl along the source's part: <part, a> / ||a||^2, both summed "
                                 "over the layer's kept tokens"),
                _c("share_lo", F64, "its 2.5 % quantile over the document resamples"),
                _c("share_hi", F64, "its 97.5 % quantile over the document resamples"),
                _c("norm_ratio", F64, "sqrt(sum ||part||^2 / sum ||a||^2) (null for together)"),
                _c("mass", F64, "attention mass on the source, mean over kept tokens: a head's on the context (neither "
                                "the first position nor itself); a bin's, mean over heads (null for together)"),
                _c("mass_first", F64, "a head's attention mass on the window's first position (null for the others)"),
                _c("mass_self", F64, "a head's attention mass on the token itself (null for the others)"),
                _c("n_tokens", I32, "kept tokens measured")]
    elif table == "calibration":
        body = [_c("n_tokens", I32, "kept tokens of the sample size (the first n_seq windows)"),
                _c("n_seq", I32, "windows of the sample size"), FN_CLASS,
                _c("target", STR, "what was fitted: real (the layer's y) or a positive control (self_first, linear)"),
                _c("n_anchors", I32, "anchors scored (a fixed subsample; the neighbours come from every token)"),
                _c("n_docs", I32, "documents of the sample size (the bootstrap's unit)"),
                _c("rel_err_median", F64, "median relative error ||y - T(x)|| / ||y - x|| over the anchors"),
                _c("rel_err_lo", F64, "its 2.5 % bootstrap quantile over documents"),
                _c("rel_err_hi", F64, "its 97.5 % bootstrap quantile over documents"),
                _c("cos_full_tok_median", F64, "median cos(Δ_full, Δ_tok) over the anchors"),
                _c("cos_lo", F64, "its 2.5 % bootstrap quantile over documents"),
                _c("cos_hi", F64, "its 97.5 % bootstrap quantile over documents"),
                _c("finding_1", STR, "where the cosine's interval lies against finding 1's threshold: clears, "
                                     "misses, straddles")]
    else:
        raise SchemaError(f"no schema is declared for table {table!r}")
    return (LAYER, *body, *PROVENANCE)


def descriptions(table: str, cfg: AnalysisConfig | None = None) -> dict[str, str]:
    return {c.name: c.description for c in columns(table, cfg)}


def _config_of(table: pa.Table) -> AnalysisConfig | None:
    if "config_json" not in table.column_names or len(table) == 0:
        return None
    return _parsed_config(table["config_json"][0].as_py())


@functools.lru_cache(maxsize=16)
def _parsed_config(config_json: str) -> AnalysisConfig:
    """A configuration parsed once (a stage's writer checks every batch it writes with the same one)."""
    return AnalysisConfig.from_dict(json.loads(config_json))


def _matches(declared: pa.DataType | str, found: pa.DataType, cfg: AnalysisConfig | None) -> bool:
    if declared == VECTOR:
        return pa.types.is_fixed_size_list(found) and found.value_type == pa.float32() and found.list_size > 0
    if declared in (FLOATS, INTS):
        return (pa.types.is_fixed_size_list(found) and found.list_size > 0
                and found.value_type == (pa.float32() if declared == FLOATS else pa.int32()))
    if declared == NEIGHBOURS:
        return (pa.types.is_fixed_size_list(found) and found.value_type == pa.int32()
                and (cfg is None or found.list_size == cfg.k))
    return found == declared


def check(table_name: str, table: pa.Table | pa.Schema) -> None:
    """Raise SchemaError unless `table` has exactly its declared columns, in order and of their types
    (under the configuration its rows record)."""
    cfg = _config_of(table) if isinstance(table, pa.Table) else None
    schema = table.schema if isinstance(table, pa.Table) else table
    declared = columns(table_name, cfg)
    names = [c.name for c in declared]
    found = schema.names
    if found != names:
        missing = [n for n in names if n not in found]
        extra = [n for n in found if n not in names]
        raise SchemaError(f"table {table_name!r} does not have its declared columns: missing {missing}, "
                          f"undeclared {extra}" + ("" if missing or extra else ", out of order"))
    widths = set()
    for column in declared:
        typ = schema.field(column.name).type
        if not _matches(column.type, typ, cfg):
            raise SchemaError(f"table {table_name!r}: column {column.name!r} is {typ}, declared "
                              f"{column.type if isinstance(column.type, pa.DataType) else column.type}")
        if column.type == VECTOR:
            widths.add(typ.list_size)
    if len(widths) > 1:
        raise SchemaError(f"table {table_name!r}: vector columns of different widths {sorted(widths)}")


def empty_table(table: str, cfg: AnalysisConfig) -> pa.Table:
    """A table of no rows with `table`'s declared columns under `cfg` (tables without vector columns)."""
    fields = []
    for column in columns(table, cfg):
        if not isinstance(column.type, pa.DataType):
            raise SchemaError(f"table {table!r} has sized columns ({column.name}): no empty form without a width")
        fields.append(pa.field(column.name, column.type))
    return pa.schema(fields).empty_table()


def describe_column(table: str, name: str) -> str | None:
    """The description of a column of a stored table, for any configuration (a projection energy on
    a top-m subspace of any m included); None for a column the schema does not declare."""
    if name in (known := descriptions(table)):
        return known[name]
    parts = name.split("_")
    if table in ("geometry", f"{CONTROL_PREFIX}geometry") and len(parts) == 3 and parts[0] == "proj" \
            and parts[1] in _GEOMETRY_PARTS and parts[2][:1] == "m" and parts[2][1:].isdigit():
        return (f"share of the energy of {_GEOMETRY_PARTS[parts[1]]} on the layer's top {parts[2][1:]} "
                f"tokenwise directions (uncentred SVD of Δ_tok)")
    return None
