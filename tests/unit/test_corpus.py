from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from updatelens.corpus import check_text_file, clean_wikitext, make_sample, read_embedded_wiki, read_text_file
from updatelens.errors import CorpusError
from updatelens.registry import CorpusEntry


class WordTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}


def test_wikitext_markup_is_removed() -> None:
    raw = ("'''Anarchism''' is a [[political philosophy|philosophy]]{{sfn|Smith|2001}} "
           "<ref>cite</ref>that [[advocates]] [http://x.org self-rule].\n== History ==\n* item")
    assert clean_wikitext(raw) == "Anarchism is a philosophy that advocates self-rule.\nHistory\nitem"


def test_embedded_wikipedia_sample_reads_as_prose() -> None:
    docs = read_embedded_wiki()
    assert len(docs) > 100
    text = " ".join(docs)
    assert "{{" not in text and "[[" not in text and len(text) > 1_000_000


def test_windows_are_unpadded_and_respect_offset(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text(" ".join(f"w{i}" for i in range(200)))
    entry = CorpusEntry("c", "text", path=str(path))
    s = make_sample(entry, WordTokenizer(), n_seq=3, seq_len=10, offset=2)
    assert s.input_ids.shape == (3, 10) and np.all(s.attention_mask == 1)
    assert s.slice_desc == "c[w2:5,len10]"
    with pytest.raises(CorpusError, match="too short"):
        make_sample(entry, WordTokenizer(), n_seq=30, seq_len=10)


def test_bad_text_files_are_rejected(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x00\x01\x02abc")
    with pytest.raises(CorpusError, match="empty"):
        read_text_file(empty)
    with pytest.raises(CorpusError, match="binary"):
        read_text_file(binary)


def test_what_a_corpus_file_is_is_checked_before_its_content_is_read(tmp_path: Path) -> None:
    """A FIFO (which would hang), a device (which never ends), a folder and a file above the limit
    (a sparse file of 2 GiB takes no disk) are refused in one line, before a byte of content is read."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    sparse = tmp_path / "huge.txt"
    with sparse.open("wb") as f:
        f.truncate(2 << 30)
    cases = {fifo: "is a FIFO", Path("/dev/zero"): "is a device", tmp_path: "is a folder",
             sparse: "2.0 GiB, above the 1 GiB", tmp_path / "missing.txt": "does not exist"}
    for path, message in cases.items():
        with pytest.raises(CorpusError, match=message):
            read_text_file(path)
    small = tmp_path / "small.txt"
    small.write_text("word " * 300)
    with pytest.raises(CorpusError, match="above the"):
        check_text_file(small, max_bytes=1000)
    assert check_text_file(small) == 1500


def test_windows_per_document_spread_the_sample_over_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    from updatelens import corpus

    docs = [" ".join(f"d{d}w{i}" for i in range(45)) for d in range(6)]  # 4 windows of 10 words each
    monkeypatch.setattr(corpus, "read_documents", lambda entry: (d for d in docs))
    entry = CorpusEntry("c", "embedded")
    every = make_sample(entry, WordTokenizer(), n_seq=8, seq_len=10)
    assert every.doc_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    spread = make_sample(entry, WordTokenizer(), n_seq=6, seq_len=10, windows_per_doc=1)
    assert spread.doc_index.tolist() == [0, 1, 2, 3, 4, 5] and spread.slice_desc == "c[w0:6,len10,per_doc1]"
    two = make_sample(entry, WordTokenizer(), n_seq=5, seq_len=10, windows_per_doc=2)
    assert two.doc_index.tolist() == [0, 0, 1, 1, 2]
    with pytest.raises(CorpusError, match="at most 1 per document .windows_per_doc.*raise windows_per_doc"):
        make_sample(entry, WordTokenizer(), n_seq=7, seq_len=10, windows_per_doc=1)


def _fast_tokenizer(words: list[str]) -> object:
    """A fast (Rust-backed) word-level tokenizer over `words`, counting how often it is called."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class Counting(PreTrainedTokenizerFast):
        calls = 0

        def __call__(self, *args: object, **kwargs: object) -> object:
            type(self).calls += 1
            return super().__call__(*args, **kwargs)

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Counting(tokenizer_object=backend, unk_token="<unk>")


def test_token_ids_are_kept_per_tokenizer_and_text(tmp_path: Path) -> None:
    """A second sample of the same corpus by the same tokenizer (another object made from the same
    definition) takes the ids kept from the first, with no tokenizer call; another tokenizer's sample of
    the same text is tokenised anew and equals what that tokenizer gives uncached."""
    path = tmp_path / "c.txt"
    path.write_text(" ".join(f"w{i % 50}" for i in range(400)))
    entry = CorpusEntry("c", "text", path=str(path))
    words = [f"w{i}" for i in range(50)]
    first = _fast_tokenizer(words)
    a = make_sample(entry, first, n_seq=4, seq_len=20)
    again = _fast_tokenizer(words)  # the same definition, another object
    calls = type(again).calls
    assert np.array_equal(make_sample(entry, again, n_seq=4, seq_len=20).input_ids, a.input_ids)
    assert type(again).calls == calls
    other = _fast_tokenizer(list(reversed(words)))  # other ids for the same words
    b = make_sample(entry, other, n_seq=4, seq_len=20)
    assert type(other).calls == 1 and not np.array_equal(b.input_ids, a.input_ids)
    uncached = np.asarray(other(path.read_text(), add_special_tokens=False)["input_ids"][:80]).reshape(4, 20)
    assert np.array_equal(b.input_ids, uncached)
