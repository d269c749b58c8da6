"""One layer's transition as arrays (what every stage after the capture reads), the bootstrap's unit
and the random directions the nulls and the random control share."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from updatelens.bootstrap import (
    sequence_counts,
)
from updatelens.config import AnalysisConfig
from updatelens.context_sources import SourceAttribution
from updatelens.tables import to_matrix


@dataclass
class LayerData:
    """One transition read back from the activations table, in (seq, pos) order."""

    layer: int
    input_ids: np.ndarray  # [n_seq, T]
    kept: np.ndarray  # [n_seq, T] bool
    x_full: np.ndarray  # [n_seq, T, d]
    y_full: np.ndarray  # [n_seq, T, d]
    seq_offset: int = 0  # sample index of the first sequence (a block of the sample starts later)
    docs: np.ndarray | None = None  # [n_seq] the document of each sequence (None: each its own)
    y_ctl_full: np.ndarray | None = None  # [n_seq, T, d] the self-and-first output, where it was captured
    y_lin_full: np.ndarray | None = None  # [n_seq, T, d] the linear control's x + xB, where it was made
    sources: SourceAttribution | None = None  # [n_seq, T, ...] where a = y - y_ctl comes from, where captured

    @property
    def x(self) -> np.ndarray:
        return self.x_full[self.kept]

    @property
    def y(self) -> np.ndarray:
        return self.y_full[self.kept]

    @property
    def seq(self) -> np.ndarray:
        return (np.nonzero(self.kept)[0] + self.seq_offset).astype(np.int32)

    @property
    def pos(self) -> np.ndarray:
        return np.nonzero(self.kept)[1].astype(np.int32)

    @property
    def doc(self) -> np.ndarray:
        """The document of each kept token (its sequence's number where documents are unknown)."""
        rows = np.nonzero(self.kept)[0]
        return (self.docs[rows] if self.docs is not None else rows + self.seq_offset).astype(np.int32)


def layer_data(table: pa.Table) -> LayerData:
    """A transition's rows (a whole layer, or the sequences of a block) as arrays."""
    table = table.sort_by([("seq", "ascending"), ("pos", "ascending")])
    seq = table["seq"].to_numpy()
    first = int(seq.min())
    n_seq, seq_len = int(seq.max()) + 1 - first, int(table["pos"].to_numpy().max()) + 1
    if len(table) != n_seq * seq_len:
        raise ValueError(f"activations table has {len(table)} rows, expected {n_seq} x {seq_len}")
    x = to_matrix(table["x"])
    y = to_matrix(table["y"])
    d = x.shape[1]
    return LayerData(
        layer=int(table["layer"][0].as_py()),
        input_ids=table["token_id"].to_numpy().reshape(n_seq, seq_len).copy(),
        kept=table["kept"].to_numpy(zero_copy_only=False).reshape(n_seq, seq_len),
        x_full=x.reshape(n_seq, seq_len, d),
        y_full=y.reshape(n_seq, seq_len, d),
        seq_offset=first,
        docs=table["doc"].to_numpy().reshape(n_seq, seq_len)[:, 0].copy() if "doc" in table.column_names else None,
        y_ctl_full=(to_matrix(table["y_ctl"]).reshape(n_seq, seq_len, d)
                    if "y_ctl" in table.column_names and table["y_ctl"].null_count == 0 else None),
        y_lin_full=(to_matrix(table["y_lin"]).reshape(n_seq, seq_len, d)
                    if "y_lin" in table.column_names and table["y_lin"].null_count == 0 else None),
        sources=stored_sources(table, n_seq, seq_len),
    )


SOURCE_COLUMNS = ("ctx_head_dot", "ctx_head_norm", "ctx_dist_dot", "ctx_dist_norm", "attn_mass", "top_source_pos",
                  "top_source_weight")  # the activations' columns of a SourceAttribution, in its fields' order


def stored_sources(table: pa.Table, n_seq: int, seq_len: int) -> SourceAttribution | None:
    """The activations' `ctx_*`, `attn_mass` and `top_source_*` columns (rows in (seq, pos) order) as a
    SourceAttribution over the full grid; None where they were not captured (null)."""
    if any(name not in table.column_names or table[name].null_count for name in SOURCE_COLUMNS):
        return None
    arrays: list[np.ndarray] = [
        to_matrix(table[name], np.int32 if name == "top_source_pos" else np.float32).reshape(n_seq, seq_len, -1)
        for name in SOURCE_COLUMNS]
    heads = arrays[0].shape[-1]
    arrays[4] = arrays[4].reshape(n_seq, seq_len, heads, -1)
    return SourceAttribution(*arrays)


def source_columns(sources: SourceAttribution | None, rows: int) -> dict[str, pa.Array]:
    """The activations' columns of a batch's SourceAttribution ([b, T, ...], rows = b * T), or nulls."""
    if sources is None:
        return {name: pa.nulls(rows, pa.list_(pa.int32() if name == "top_source_pos" else pa.float32(), 1))
                for name in SOURCE_COLUMNS}
    out: dict[str, pa.Array] = {}
    for name, values in zip(SOURCE_COLUMNS, (sources.head_dot, sources.head_norm, sources.dist_dot,
                                             sources.dist_norm, sources.mass, sources.top_pos, sources.top_weight)):
        flat = np.ascontiguousarray(values.reshape(rows, -1))
        typ = pa.int32() if name == "top_source_pos" else pa.float32()
        out[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1).astype(typ.to_pandas_dtype()), typ),
                                                      flat.shape[1])
    return out


@dataclass
class Transition:
    """The kept tokens of one layer as arrays (what the fits need), without the full-grid copies."""

    layer: int
    x: np.ndarray  # [N, d] float32
    y: np.ndarray  # [N, d] float32
    seq: np.ndarray  # [N] int32
    pos: np.ndarray  # [N] int32
    doc: np.ndarray  # [N] int32: the document each token's window was cut from


def transition_from_parts(parts: Iterable[pa.Table], n_kept: int) -> Transition:
    """Fill a layer's kept rows from its activations row groups (in (seq, pos) order), one row group
    in memory at a time besides the [n_kept, d] arrays themselves."""
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    seq = np.empty(n_kept, np.int32)
    pos = np.empty(n_kept, np.int32)
    doc = np.empty(n_kept, np.int32)
    filled, layer, last = 0, -1, -1
    for part in parts:
        kept = part["kept"].to_numpy(zero_copy_only=False)
        key = part["seq"].to_numpy().astype(np.int64) * (1 << 32) + part["pos"].to_numpy()
        if len(key) and (np.any(np.diff(key) <= 0) or key[0] <= last):
            raise ValueError("activations rows are not in (seq, pos) order")
        last = int(key[-1]) if len(key) else last
        layer = int(part["layer"][0].as_py()) if len(part) else layer
        xs, ys = to_matrix(part["x"])[kept], to_matrix(part["y"])[kept]
        if x is None:
            x = np.empty((n_kept, xs.shape[1]), np.float32)
            y = np.empty((n_kept, xs.shape[1]), np.float32)
        m = len(xs)
        if filled + m > n_kept:
            raise ValueError(f"activations hold more than the {n_kept} kept tokens expected")
        assert x is not None and y is not None
        x[filled : filled + m], y[filled : filled + m] = xs, ys
        seq[filled : filled + m] = part["seq"].to_numpy()[kept]
        pos[filled : filled + m] = part["pos"].to_numpy()[kept]
        doc[filled : filled + m] = (part["doc"] if "doc" in part.column_names else part["seq"]).to_numpy()[kept]
        filled += m
    if x is None or y is None or filled != n_kept:
        raise ValueError(f"activations hold {filled} kept tokens, expected {n_kept}")
    return Transition(layer, x, y, seq, pos, doc)



# ---- the bootstrap's unit -----------------------------------------------------------------------
def resample_units(cfg: AnalysisConfig, docs: np.ndarray) -> np.ndarray:
    """The independent unit of each sample sequence: its document (`bootstrap_unit="document"`) or
    itself. `docs`: the document of each sample sequence."""
    units = np.asarray(docs) if cfg.bootstrap_unit == "document" else np.arange(cfg.n_seq)
    if len(units) != cfg.n_seq:
        raise ValueError(f"{len(units)} sequences' documents given, the sample has {cfg.n_seq}")
    return units


def resample_counts(cfg: AnalysisConfig, docs: np.ndarray) -> np.ndarray:
    """[bootstrap, n_seq] multiplicity of each sample sequence in each resample: its unit drawn with
    replacement (`resample_units`)."""
    return sequence_counts(resample_units(cfg, docs), cfg.bootstrap, cfg.seed)




def sample_docs(data: LayerData | pa.Table) -> np.ndarray:
    """The document of each sample sequence, from a whole layer's data or its activations' `seq` and
    `doc` columns."""
    if isinstance(data, LayerData):
        return data.docs if data.docs is not None else np.arange(data.kept.shape[0]) + data.seq_offset
    seq, doc = data["seq"].to_numpy(), data["doc"].to_numpy()
    out = np.empty(int(seq.max()) + 1, np.int64)
    out[seq] = doc
    return out



def random_directions(data: LayerData, seed: int) -> np.ndarray:
    """A random unit vector per kept token, drawn per sequence (seeded by seed, layer and the
    sequence's index in the sample): a token's direction does not depend on the sample size or on
    how the sample is cut into blocks. [kept tokens, d] in (seq, pos) order."""
    parts = []
    for s in range(data.kept.shape[0]):
        rng = np.random.default_rng([seed, data.layer, data.seq_offset + s])
        u = rng.standard_normal((int(data.kept[s].sum()), data.y_full.shape[-1]))
        parts.append(u / np.linalg.norm(u, axis=-1, keepdims=True))
    return np.concatenate(parts)
