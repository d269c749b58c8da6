"""Checks that run before any heavy work: each failure names the problem and the fix.

`preflight` needs only the model's config, its weight files' headers, its tokenizer and the corpus:
no weights are loaded, so a bad input fails in seconds instead of after a model load.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from updatelens.config import AnalysisConfig, preset_layers
from updatelens.corpus import Sample, check_text_file, make_sample
from updatelens.errors import ConfigError, ModelError, UpdateLensError
from updatelens.models import recorded_revision, resolve_source, window_first_token
from updatelens.registry import CorpusEntry, ModelEntry

BYTES_PER_VALUE = 4  # float32 vectors in Parquet


@dataclass(frozen=True)
class Preflight:
    n_layers: int
    d_model: int
    max_positions: int | None
    sample: Sample
    bytes_needed: int
    # the revision every row will record, with the weights' fingerprint (models.recorded_revision); None
    # where a hub model is not cached yet
    revision: str | None = None


def check_safetensors(folder: Path) -> None:
    """A truncated or corrupt .safetensors file: its header must parse and cover the file."""
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        try:
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len <= 0 or 8 + header_len > size:
                    raise ValueError(f"header length {header_len} exceeds the file size {size}")
                header = json.loads(f.read(header_len))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ModelError(f"weight file {path} is corrupt: {exc}; re-download or re-save the model") from exc
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end > size:
            raise ModelError(f"weight file {path} is truncated: {size} bytes, its header needs "
                             f"{8 + header_len + end}; re-download or re-save the model")


def read_model_config(entry: ModelEntry) -> tuple[str, Any]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    source, _ = resolve_source(entry)
    try:
        config = AutoConfig.from_pretrained(source, revision=entry.revision or None)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model {entry.slug!r}: cannot read its config at {source}: {exc}") from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelError(f"model {entry.slug!r} ({config.model_type}) has no causal language-model head in "
                         f"transformers; UpdateLens needs a causal LM (next-token distribution)")
    if Path(source).is_dir():
        check_safetensors(Path(source))
    return source, config


def estimate_bytes(cfg: AnalysisConfig, n_layers: int, d_model: int) -> int:
    """activations (x, y) + local_fits (T(x)) + residuals (r) per class, float32, per layer."""
    tokens = cfg.n_seq * cfg.seq_len
    vectors_per_token = 2 + 2 * len(cfg.classes)
    return tokens * n_layers * d_model * BYTES_PER_VALUE * vectors_per_token


def check_data_root(root: object, bytes_needed: int = 0) -> None:
    """The data root (a path, a URL or a storage UPath: its text is read) is writable and (locally) has
    room: checked before any heavy work."""
    if "://" in str(root) and not str(root).startswith("file://"):
        _check_object_root(root)
        return
    root = Path(str(root).removeprefix("file://"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UpdateLensError(f"data root {root} is not writable ({exc.strerror}); choose another with "
                              f"--data-root or UPDATELENS_DATA") from exc
    free = shutil.disk_usage(root).free
    if bytes_needed and free < 1.2 * bytes_needed:
        raise UpdateLensError(f"data root {root} has {free / 2**30:.2f} GiB free, the run needs about "
                              f"{bytes_needed / 2**30:.2f} GiB (+20 %); free space or choose another data root")


def _check_object_root(root: object) -> None:
    """An object-store root (a storage.location UPath or URL): write and delete a probe object."""
    from upath import UPath

    path = root if isinstance(root, UPath) else UPath(str(root))
    probe = path / "_staging" / f".write-test-{os.getpid()}"
    try:
        probe.fs.pipe_file(probe.path, b"ok")
        probe.fs.rm_file(probe.path)
    except Exception as exc:
        raise UpdateLensError(f"data root {root} is not writable ({type(exc).__name__}: {exc}); check the bucket, "
                              f"the credentials and the endpoint (AWS_ENDPOINT_URL for a local S3 server)") from exc


def check_device(device: str) -> None:
    """ConfigError unless this torch build can run on `device` (a CUDA device on a CPU build, or an
    index past the GPUs present, is refused before the weights load)."""
    if device == "cpu":
        return
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device and device.split(":", 1)[1].isdigit() else 0
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}, but this torch build ({torch.__version__}) has no usable CUDA device; "
                          f"use device=cpu or install a CUDA build of torch (README, 'Installing')")
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device={device!r}, but only {torch.cuda.device_count()} CUDA device(s) are present")


def preflight(entry: ModelEntry, corpus: CorpusEntry, cfg: AnalysisConfig, data_root: object,
              layers: Sequence[int] | None = None, preset: str | None = None) -> Preflight:
    """`layers`: the layers the run analyses; None: the preset's (e.g. the study's three), or all of
    them. A layer the model does not have is refused before anything is written; the disk check
    counts that many layers."""
    from transformers import AutoTokenizer

    if corpus.source == "text":  # what the file is, before the model's files or its content are read
        check_text_file(Path(corpus.path).expanduser())
    source, config = read_model_config(entry)
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    d_model = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    if not n_layers or not d_model:
        raise ModelError(f"model {entry.slug!r}: its config states no depth or width")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    cfg.validate(d_model=d_model, max_positions=int(max_pos) if max_pos else None)
    check_device(cfg.device)
    bad = sorted(layer for layer in set(layers or []) if not 0 <= layer < n_layers)
    if bad:
        raise ConfigError(f"{entry.slug} has {n_layers} layers (0..{n_layers - 1}); no layer {bad}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=entry.revision or None)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model {entry.slug!r}: no usable tokenizer at {source}: {exc}") from exc
    sample = make_sample(corpus, tokenizer, cfg.n_seq, cfg.seq_len, cfg.corpus_offset, cfg.windows_per_doc,
                         window_first_token(config.model_type, tokenizer))
    n_analysed = len(set(layers)) if layers else len(preset_layers(preset, n_layers)) if preset else n_layers
    needed = estimate_bytes(cfg, n_analysed, d_model)
    check_data_root(data_root, needed)
    return Preflight(n_layers=n_layers, d_model=d_model, max_positions=int(max_pos) if max_pos else None,
                     sample=sample, bytes_needed=needed, revision=recorded_revision(entry))
