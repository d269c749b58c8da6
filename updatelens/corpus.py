"""Corpora: read text from the registry's sources and cut it into fixed-length token windows.

Windows never cross a document boundary and are never padded (so Mamba, which has no attention
mask, sees exactly what a Transformer sees). The sample is windows [offset, offset + n_seq).
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import re
import stat
import threading
import weakref
import xml.etree.ElementTree as ET
from collections.abc import Generator, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from updatelens.errors import CorpusError, RegistryError
from updatelens.registry import CorpusEntry

WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_DOC_CHARS = 200
MAX_TEXT_BYTES = 1 << 30  # a text corpus file above 1 GiB is refused before it is read


@dataclass(frozen=True)
class Sample:
    corpus: str
    input_ids: np.ndarray  # [n_seq, seq_len] int64
    attention_mask: np.ndarray  # [n_seq, seq_len] int64 (all ones: windows are never padded)
    doc_index: np.ndarray  # [n_seq] the document each window came from
    slice_desc: str  # e.g. "wiki-embedded[w0:16,len128]"
    first_token: int | None = None  # the token every window starts with (make_sample), or None


# ---- wikitext cleaning ------------------------------------------------------------------------
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_TABLE = re.compile(r"\{\|.*?\|\}", re.S)
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I)
_LINK = re.compile(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]")
_LEFTOVER = re.compile(r"\[\[|\]\]|\{\{|\}\}")  # unbalanced markup that survived the passes
_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_QUOTES = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.M)
_SPACES = re.compile(r"[ \t]+")
_BLANKS = re.compile(r"\n{3,}")


_BRACES = re.compile(r"\{\{|\}\}")


def _strip_templates(text: str) -> str:
    """The text without its {{templates}}, nested ones included; a "}}" outside any template is text,
    and an unclosed "{{" drops the rest (one pass over the braces, not over every character)."""
    out, depth, start = [], 0, 0
    for brace in _BRACES.finditer(text):
        if brace.group() == "{{":
            if depth == 0:
                out.append(text[start:brace.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                start = brace.end()
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def clean_wikitext(text: str) -> str:
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _strip_templates(text)
    text = _TABLE.sub("", text)
    text = _FILE_LINK.sub("", text)
    previous = None
    while previous != text:  # links nest inside captions: resolve inside out
        previous, text = text, _LINK.sub(r"\1", text)
    text = _LEFTOVER.sub("", text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _QUOTES.sub("", text)
    text = _LIST.sub("", text)
    text = _SPACES.sub(" ", text)
    text = _BLANKS.sub("\n\n", text)
    return text.strip()


def read_embedded_wiki() -> list[str]:
    """Every article of the embedded dump, cleaned (the sample reads only as many as it needs)."""
    return list(iter_embedded_wiki())


def iter_embedded_wiki() -> Iterator[str]:
    """The embedded dump's articles in order, each parsed and cleaned when it is first asked for in this
    process and kept (106 articles, 2.9 MB of text): a run draws its sample more than once."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise RegistryError("the embedded corpus ships in the gensim wheel, which is not installed; "
                            "pip install --no-deps gensim==4.4.0")
    path = Path(list(spec.submodule_search_locations)[0]) / WIKI_FILE
    if not path.exists():
        raise RegistryError(f"embedded corpus file {path} is missing from the gensim wheel")
    info = path.stat()
    key = (path, info.st_size, info.st_mtime_ns)
    with _READ_LOCK:
        if _READ.key != key:  # first use, or the wheel was reinstalled
            _READ.key, _READ.articles, _READ.source = key, [], _parse_embedded_wiki(path)
        articles, source = _READ.articles, _READ.source
    i = 0
    while True:
        with _READ_LOCK:
            if i == len(articles):
                try:
                    articles.append(next(source))
                except StopIteration:
                    return
                except BaseException:  # a damaged file: the next reader starts over, and fails the same way
                    _READ.key = None
                    raise
            article = articles[i]
        yield article
        i += 1


@dataclass
class _ReadSoFar:
    """The embedded dump's cleaned articles read so far in this process, and the parse that goes on."""

    key: tuple[Path, int, int] | None = None  # the file, its size and mtime
    articles: list[str] = field(default_factory=list)
    source: Iterator[str] = field(default_factory=lambda: iter(()))


_READ = _ReadSoFar()
_READ_LOCK = threading.Lock()


def _parse_embedded_wiki(path: Path) -> Iterator[str]:
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f):
            if not elem.tag.endswith("}page"):
                continue
            ns = elem.find("{*}ns")
            text = elem.find("{*}revision/{*}text")
            if ns is not None and ns.text == "0" and text is not None and text.text:
                if not text.text.lstrip().upper().startswith("#REDIRECT"):
                    cleaned = clean_wikitext(text.text)
                    if len(cleaned) >= MIN_DOC_CHARS:
                        yield cleaned
            elem.clear()


def check_text_file(path: Path, max_bytes: int = MAX_TEXT_BYTES) -> int:
    """The corpus file's size, after checking what it is before reading its content: a regular file
    (not a folder, FIFO, device or socket, which could hang or never end), not empty, at most
    `max_bytes` (a huge or sparse file is refused before it fills memory), and text in its first
    8 KiB (no NUL bytes)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CorpusError(f"corpus file {path} does not exist") from None
    except OSError as exc:
        raise CorpusError(f"corpus file {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        raise CorpusError(f"corpus file {path} is {kind}; give a UTF-8 text file")
    if info.st_size == 0:
        raise CorpusError(f"corpus file {path} is empty")
    if info.st_size > max_bytes:
        raise CorpusError(f"corpus file {path} is {info.st_size / 2**30:.1f} GiB, above the "
                          f"{max_bytes / 2**30:g} GiB a text corpus may hold; give a slice of it")
    try:
        with path.open("rb") as f:
            head = f.read(8192)
    except OSError as exc:
        raise CorpusError(f"corpus file {path} cannot be read: {exc.strerror}") from None
    if b"\x00" in head:
        raise CorpusError(f"corpus file {path} looks binary (NUL bytes); give a UTF-8 text file")
    return info.st_size


def read_text_file(path: Path, max_bytes: int = MAX_TEXT_BYTES) -> list[str]:
    """The file's text as one document (paragraphs joined), checked by `check_text_file` first."""
    check_text_file(path, max_bytes)
    raw = path.read_bytes()
    if not raw.strip():
        raise CorpusError(f"corpus file {path} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus file {path} is not UTF-8 text: {exc}") from exc
    docs = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    # paragraphs are documents; join short ones so windows can fill up
    return ["\n\n".join(docs)] if docs else []


def read_hub_dataset(entry: CorpusEntry) -> list[str]:
    try:
        import datasets  # optional: only for users online
    except ImportError as exc:
        raise RegistryError(f"corpus {entry.slug!r} is a hub dataset; pip install datasets") from exc
    ds = datasets.load_dataset(entry.id, entry.config or None, split=entry.split)
    return [str(t) for t in ds[entry.field] if str(t).strip()]


def read_documents(entry: CorpusEntry) -> Generator[str, None, None]:
    """The corpus's documents in order, read as they are asked for (the embedded dump is parsed and
    cleaned only as far as the sample needs)."""
    if entry.source == "embedded":
        yield from iter_embedded_wiki()
    elif entry.source == "text":
        yield from read_text_file(Path(entry.path).expanduser())
    else:
        yield from read_hub_dataset(entry)


# ---- token ids, kept per process ----------------------------------------------------------------
# A sample tokenises whole documents (a Wikipedia article is thousands of tokens) to cut a few windows
# from each, and a process that draws several samples (a convergence study's sizes, a sweep, the tests)
# drew the same documents' ids again each time. The ids are kept per (tokenizer, document text): the
# tokenizer is named by a digest of its whole serialised definition (vocabulary, merges, normaliser,
# pre-tokeniser, added tokens), so another tokenizer, or the same text under another one, is tokenised
# anew. Bounded: past TOKEN_CACHE_IDS ids the kept ids are dropped.
TOKEN_CACHE_IDS = 20_000_000  # int32: 80 MB at most


@dataclass
class _KeptTokens:
    ids: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # (tokenizer digest, text) -> ids
    count: int = 0  # ids kept, all documents together
    # id(tokenizer) -> (a weak reference to it, its digest): a tokenizer's digest is computed once, and
    # the tokenizer is not kept alive by it
    digests: dict[int, tuple[weakref.ref[object], str]] = field(default_factory=dict)


_KEPT = _KeptTokens()
_KEPT_LOCK = threading.Lock()


def _tokenizer_digest(tokenizer: object) -> str | None:
    """A digest of a fast tokenizer's serialised definition, None for one without it (not cached)."""
    known = _KEPT.digests.get(id(tokenizer))
    if known is not None and known[0]() is tokenizer:
        return known[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    digest = hashlib.sha256(f"{type(tokenizer).__name__}\n{backend.to_str()}".encode()).hexdigest()
    try:
        reference = weakref.ref(tokenizer)
    except TypeError:  # no weak references to it: its digest is computed on each sample
        return digest
    with _KEPT_LOCK:
        _KEPT.digests = {k: v for k, v in _KEPT.digests.items() if v[0]() is not None}
        _KEPT.digests[id(tokenizer)] = (reference, digest)
    return digest


def token_ids(tokenizer: object, doc: str) -> np.ndarray:
    """The document's token ids (no special tokens), from the per-process cache where the tokenizer
    has a serialised definition to name it by."""
    digest = _tokenizer_digest(tokenizer)
    if digest is None:
        return np.asarray(tokenizer(doc, add_special_tokens=False)["input_ids"], dtype=np.int64)  # type: ignore[operator]
    with _KEPT_LOCK:
        kept = _KEPT.ids.get((digest, doc))
    if kept is not None:
        return kept
    ids = np.asarray(tokenizer(doc, add_special_tokens=False)["input_ids"], dtype=np.int32)  # type: ignore[operator]
    ids.setflags(write=False)
    with _KEPT_LOCK:
        if _KEPT.count + len(ids) > TOKEN_CACHE_IDS:
            _KEPT.ids, _KEPT.count = {}, 0
        if (digest, doc) not in _KEPT.ids:
            _KEPT.ids[(digest, doc)] = ids
            _KEPT.count += len(ids)
    return ids


def make_sample(entry: CorpusEntry, tokenizer: object, n_seq: int, seq_len: int, offset: int = 0,
                windows_per_doc: int = 0, first_token: int | None = None) -> Sample:
    """Tokenise documents in order and cut non-overlapping windows of seq_len tokens, at most
    `windows_per_doc` of them from one document (0: every window). With `first_token` every window is
    that token followed by seq_len - 1 tokens of text (`models.window_first_token`: the model's BOS, or
    its document separator), recorded in the slice as `first<id>`."""
    body = seq_len - (1 if first_token is not None else 0)
    head = [first_token] if first_token is not None else []
    need = offset + n_seq
    windows: list[list[int]] = []
    doc_of: list[int] = []
    total_tokens = 0
    n_docs = 0
    with closing(read_documents(entry)) as docs:
        for d_idx, doc in enumerate(docs):
            n_docs += 1
            ids = token_ids(tokenizer, doc)
            total_tokens += len(ids)
            starts = range(0, len(ids) - body + 1, body)
            for start in starts[:windows_per_doc] if windows_per_doc else starts:
                windows.append(head + ids[start : start + body].tolist())
                doc_of.append(d_idx)
                if len(windows) >= need:
                    break
            if len(windows) >= need:
                break
    if not n_docs:
        raise CorpusError(f"corpus {entry.slug!r} has no usable text")
    if len(windows) < need:
        raise CorpusError(f"corpus {entry.slug!r} is too short: it yields {len(windows)} windows of "
                          f"{seq_len} tokens ({total_tokens} tokens read), the sample needs "
                          f"offset {offset} + n_seq {n_seq} = {need}"
                          + (f" with at most {windows_per_doc} per document (windows_per_doc)" if windows_per_doc else "")
                          + "; lower n_seq or seq_len" + (", or raise windows_per_doc" if windows_per_doc else ""))
    ids = np.asarray(windows[offset:need], dtype=np.int64)
    return Sample(
        corpus=entry.slug,
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        doc_index=np.asarray(doc_of[offset:need], dtype=np.int64),
        slice_desc=f"{entry.slug}[w{offset}:{need},len{seq_len}" + (f",per_doc{windows_per_doc}" if windows_per_doc else "")
        + (f",first{first_token}" if first_token is not None else "") + "]",
        first_token=first_token,
    )
