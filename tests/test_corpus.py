"""Corpus pipeline: read_corpus (file, folder, embedded), the token memmap cache, the positional split."""

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import decoderlab
from decoderlab.data import (
    corpus_cache_path, corpus_tokens, embedded_corpus_path, read_corpus, split_tokens, token_dtype,
)
from decoderlab.tokenizers import CharTokenizer, build_tokenizer


class CountingChar(CharTokenizer):
    """A CharTokenizer that counts how often the corpus is encoded."""

    calls = 0

    def encode_array(self, text):
        type(self).calls += 1
        return super().encode_array(text)


class WideTokenizer:
    """A minimal tokenizer with 70,000 ids: id = code point + 65,400 (so ids exceed uint16)."""

    kind = "wide"
    vocab_size = 70_000

    def encode(self, text):
        return [ord(c) + 65_400 for c in text]

    def to_dict(self):
        return {"decoderlab_tokenizer": "wide"}


# -- read_corpus ---------------------------------------------------------------------------------------------------

def test_embedded_corpus_ships_with_the_package(shared_dir):
    path = embedded_corpus_path()
    assert path.is_file()
    assert path.parent == Path(decoderlab.__file__).parent / "corpora"
    assert (path.parent / "SOURCES.md").is_file()
    text = read_corpus(None)
    assert text == path.read_text(encoding="utf-8")
    assert len(text) == 1_115_394 and len(set(text)) == 65
    shared = shared_dir / "data" / "tinyshakespeare.txt"
    if shared.is_file():
        assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(shared.read_bytes()).digest()


def test_read_corpus_file_and_folder(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("first file\n", encoding="utf-8")
    assert read_corpus(f) == "first file\n"
    assert read_corpus(str(f)) == "first file\n"

    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    (folder / "b.txt").write_text("B", encoding="utf-8")
    (folder / "a.txt").write_bytes("\ufeffA é".encode("utf-8"))  # a byte-order mark is dropped
    (folder / "sub" / "c.txt").write_text("C", encoding="utf-8")
    (folder / "notes.md").write_text("not a .txt", encoding="utf-8")
    (folder / ".hidden" / "x.txt").write_text("hidden", encoding="utf-8")
    assert read_corpus(folder) == "A é\nB\nC"


def test_read_corpus_missing_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-corpus.txt"):
        read_corpus(tmp_path / "no-such-corpus.txt")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    (empty_dir / "readme.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"empty_dir holds no \.txt files"):
        read_corpus(empty_dir)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        read_corpus(tmp_path / "empty.txt")
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    with pytest.raises(ValueError, match="blank.txt is empty"):
        read_corpus(tmp_path / "blank.txt")
    blanks = tmp_path / "blanks"
    blanks.mkdir()
    (blanks / "1.txt").write_text("")
    (blanks / "2.txt").write_text("\n")
    with pytest.raises(ValueError, match=r"blanks \(2 \.txt files\) is empty"):
        read_corpus(blanks)


def test_read_corpus_non_utf8_names_file_and_byte_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("naïve\n".encode("utf-8") + "café".encode("latin-1"))  # é as the lone byte 0xe9
    with pytest.raises(ValueError) as e:
        read_corpus(bad)
    msg = str(e.value)
    assert str(bad) in msg and "byte offset 10" in msg and "0xe9" in msg
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("fine", encoding="utf-8")
    (folder / "b.txt").write_bytes(b"\xff\xfeU\x00")  # UTF-16 with its BOM
    with pytest.raises(ValueError, match=r"b\.txt is not UTF-8 text: byte 0xff at byte offset 0"):
        read_corpus(folder)


# -- corpus_tokens -------------------------------------------------------------------------------------------------

def test_corpus_tokens_uint16_memmap_equals_encode(tmp_path):
    text = read_corpus(None)[:50_000]
    tok = CharTokenizer.from_text(text)
    ids = corpus_tokens(text, tok, tmp_path)
    assert isinstance(ids, np.memmap) and ids.dtype == np.uint16 and ids.ndim == 1
    assert np.array_equal(ids, np.array(tok.encode(text)))
    with pytest.raises(ValueError):  # opened read-only
        ids[0] = 5
    assert [p.name for p in tmp_path.iterdir()] == [corpus_cache_path(text, tok, tmp_path).name]  # no temp files


def test_corpus_tokens_bpe(tmp_path):
    text = read_corpus(None)[:30_000]
    tok = build_tokenizer("bpe", text, vocab_size=320)
    ids = corpus_tokens(text, tok, tmp_path)
    assert ids.dtype == np.uint16
    assert ids.tolist() == tok.encode(text)
    assert tok.decode(ids.tolist()) == text


def test_corpus_tokens_uint32_beyond_65536(tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    text = "wide ids é"
    ids = corpus_tokens(text, WideTokenizer(), tmp_path)
    assert ids.dtype == np.uint32
    assert ids.tolist() == [ord(c) + 65_400 for c in text]
    assert max(ids) > 65_535


def test_corpus_tokens_cache_is_reused_and_keyed(tmp_path):
    text = "to be or not to be\n" * 50
    CountingChar.calls = 0
    tok = CountingChar.from_text(text)
    first = corpus_tokens(text, tok, tmp_path)
    path = corpus_cache_path(text, tok, tmp_path)
    mtime = path.stat().st_mtime_ns
    second = corpus_tokens(text, CountingChar.from_text(text), tmp_path)
    assert CountingChar.calls == 1 and path.stat().st_mtime_ns == mtime
    assert np.array_equal(first, second)
    # another text or another tokenizer is another cache file
    corpus_tokens(text + "!", CountingChar.from_text(text + "!"), tmp_path)
    corpus_tokens(text, CountingChar.from_text(text, unk=True), tmp_path)
    assert CountingChar.calls == 3 and len(list(tmp_path.iterdir())) == 3
    # a truncated file left by something else is rebuilt (a new file: the old mapping stays valid)
    expected = np.array(first)
    path.unlink()
    path.write_bytes(b"\x00")
    assert np.array_equal(corpus_tokens(text, tok, tmp_path), expected) and CountingChar.calls == 4
    assert np.array_equal(first, expected)


def test_corpus_tokens_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    tok = CharTokenizer.from_text("abc")
    ids = corpus_tokens("abcabc", tok)
    assert Path(ids.filename).parent == tmp_path / "cache" / "tokens"


def test_corpus_tokens_bad_inputs(tmp_path):
    class NoTokens(WideTokenizer):
        def encode(self, text):
            return []

    class OutOfRange(WideTokenizer):
        vocab_size = 10

    with pytest.raises(ValueError, match="encodes to no tokens"):
        corpus_tokens("   ", NoTokens(), tmp_path)
    with pytest.raises(ValueError, match=r"token id 65497, outside its vocabulary 0 \.\. 9"):
        corpus_tokens("a", OutOfRange(), tmp_path)
    with pytest.raises(TypeError, match="str"):
        corpus_tokens(b"abc", CharTokenizer.from_text("abc"), tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- split_tokens --------------------------------------------------------------------------------------------------

def test_split_by_position(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_tokens(tokens)
    assert len(train) == 900 and len(val) == 100
    assert np.array_equal(train, tokens[:900]) and np.array_equal(val, tokens[900:])
    train, val = split_tokens(tokens, val_fraction=0.25)
    assert (len(train), len(val)) == (750, 250)
    assert split_tokens(np.arange(7), 0.1)[0].tolist() == [0, 1, 2, 3, 4, 5]  # floor(6.3) train tokens

    text = read_corpus(None)
    ids = corpus_tokens(text, CharTokenizer.from_text(text), tmp_path)
    train, val = split_tokens(ids)
    assert (len(train), len(val)) == (1_003_854, 111_540)  # int(0.9 n), as nanoGPT's shakespeare_char
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)
    assert np.shares_memory(train, ids)


def test_split_bad_inputs():
    for frac in (0, 1, -0.1, 1.5):
        with pytest.raises(ValueError, match=f"got {frac}"):
            split_tokens(np.arange(100), frac)
    with pytest.raises(ValueError, match="1 tokens are too few"):
        split_tokens(np.arange(1), 0.1)
    with pytest.raises(ValueError, match="0 tokens are too few"):
        split_tokens(np.arange(0), 0.5)
    with pytest.raises(ValueError, match="1-D"):
        split_tokens(np.zeros((4, 4)), 0.5)


def test_no_stray_files_in_package_corpora():
    names = sorted(os.listdir(embedded_corpus_path().parent))
    assert names == ["SOURCES.md", "tinyshakespeare.txt"]


def test_read_corpus_calls_a_binary_file_binary(tmp_path):
    """A binary file is named as binary, not "convert from latin1" for an image, an archive or model weights."""
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError) as e:
        read_corpus(png)
    assert str(e.value) == (f"{png} is not UTF-8 text: byte 0x89 at byte offset 0 is invalid (invalid start byte); it "
                            "is a binary file, not text (it holds a NUL byte at byte offset 8): give a UTF-8 text file")
    zeros = tmp_path / "zeros.txt"
    zeros.write_bytes(b"abc\x00\x00")
    with pytest.raises(ValueError, match=r"zeros\.txt is a binary file, not text: it holds a NUL byte at byte offset 3"):
        read_corpus(zeros)
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes("hello".encode("utf-16"))
    with pytest.raises(ValueError, match=r"it is UTF-16 text \(it starts with a UTF-16 byte-order mark\): convert it"):
        read_corpus(utf16)
