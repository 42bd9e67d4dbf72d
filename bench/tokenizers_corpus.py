"""Tokenizing the embedded tinyshakespeare (1.1 MB): build time, encode time and throughput per tokenizer, and
the token cache's second call against its first.

Rows, all in one run on the same text:

- char: ``CharTokenizer.encode`` (a dict lookup per character) and ``encode_array``.
- word: ``WordTokenizer`` via ``build_tokenizer("word", ...)``.
- bpe-1024: byte-level BPE trained on the text; one Hugging Face ``encode`` call on the whole text against
  ``encode_array``, which encodes ~256k-character pieces cut where the pre-tokenizer always splits (the
  same ids; bounded memory on large corpora).
- corpus_tokens: first call (encode + atomic write of the uint16 memmap) against a second call (maps the
  cached file: sha256 of text and tokenizer, no encoding).

Times are the median of 3 runs (1 for training). Run: ``python bench/tokenizers_corpus.py`` (about 20 s).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from decoderlab.data import corpus_tokens, read_corpus
from decoderlab.tokenizers import build_tokenizer


def timed(fn, reps=3):
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    text = read_corpus(None)
    mb = len(text.encode("utf-8")) / 1e6
    rows = []  # (what, vocab, build s, encode s, tokens, ratio note)

    b_char, char = timed(lambda: build_tokenizer("char", text))
    t_list, ids = timed(lambda: char.encode(text))
    t_arr, _ = timed(lambda: char.encode_array(text))
    rows += [("char encode (list)", char.vocab_size, b_char, t_list, len(ids), "1.00x"),
             ("char encode_array", char.vocab_size, b_char, t_arr, len(ids), f"{t_list / t_arr:.2f}x vs list")]

    b_word, word = timed(lambda: build_tokenizer("word", text))
    t_word, ids = timed(lambda: word.encode(text))
    rows.append(("word encode", word.vocab_size, b_word, t_word, len(ids), ""))

    b_bpe, bpe = timed(lambda: build_tokenizer("bpe", text, vocab_size=1024), reps=1)
    t_whole, whole = timed(lambda: bpe._encode_plain(text))
    t_chunk, chunked = timed(lambda: bpe.encode_array(text))
    assert chunked.tolist() == whole, "chunked BPE encoding differs from the whole-text encoding"
    rows += [("bpe-1024 one encode call", bpe.vocab_size, b_bpe, t_whole, len(whole), "1.00x"),
             ("bpe-1024 encode_array (chunked)", bpe.vocab_size, b_bpe, t_chunk, len(whole),
              f"{t_whole / t_chunk:.2f}x vs one call")]

    with tempfile.TemporaryDirectory() as d:
        t_first, _ = timed(lambda: corpus_tokens(text, bpe, d), reps=1)
        t_again, arr = timed(lambda: corpus_tokens(text, bpe, d))
    rows += [("corpus_tokens bpe, first call", bpe.vocab_size, 0.0, t_first, len(arr), "1.00x"),
             ("corpus_tokens bpe, cached", bpe.vocab_size, 0.0, t_again, len(arr),
              f"{t_first / t_again:.0f}x vs first")]

    print(f"tinyshakespeare: {len(text):,} characters, {mb:.2f} MB UTF-8\n")
    print("| what | vocab_size | build s | encode s | MB/s | tokens | bytes/token | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for what, v, b, t, n, note in rows:
        print(f"| {what} | {v:,} | {b:.2f} | {t:.3f} | {mb / t:,.1f} | {n:,} | {mb * 1e6 / n:.2f} | {note} |")


if __name__ == "__main__":
    main()
