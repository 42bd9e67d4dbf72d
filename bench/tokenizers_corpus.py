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

Times are the median of 3 runs (1 for training).

Second table, peak memory of BPE corpus encoding: tinyshakespeare repeated to 8 MB and to 100 MB,
with its line ends as they are (LF), as CRLF, and removed (every newline a space: no line end at all),
through bpe-1024. Each row runs in a fresh process; the peak is the growth of peak RSS during the call above
what the process held before it (the text and the tokenizer; high-water mark reset via
``/proc/self/clear_refs`` after ``malloc_trim``). Rows: one Hugging Face encode call on the whole text (8 MB
only: at 100 MB of CRLF text it would need ~17 GB), ``encode_array`` (pieces of ~256k characters, the ids
collected: 12 bytes per token), and ``corpus_tokens`` (pieces streamed to the uint16 cache file). At 8 MB
the pieces' ids are checked equal to the one call's.

Run: ``python bench/tokenizers_corpus.py`` (about 20 s for the first table and ~15 minutes for the second on
a 2-core machine; ``--no-memory`` skips the second).
"""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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


STYLES = {"LF": lambda t: t, "CRLF": lambda t: t.replace("\n", "\r\n"), "no line end": lambda t: t.replace("\n", " ")}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_worker(style: str, megabytes: int, method: str, tokenizer_file: str) -> dict:
    """In a fresh process: the peak RSS growth of encoding ``megabytes`` MB of ``style`` text with ``method``."""
    from decoderlab.tokenizers import Tokenizer

    bpe = Tokenizer.load(tokenizer_file)
    base = STYLES[style](read_corpus(None))
    text = base * (megabytes * 10**6 // len(base.encode("utf-8")) + 1)
    text = text[:megabytes * 10**6]  # ASCII: one byte per character
    mb = len(text.encode("utf-8")) / 1e6
    with tempfile.TemporaryDirectory() as cache:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        rss_before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        if method == "one call":
            ids = bpe.hf_tokenizer.encode(text, add_special_tokens=False).ids
        elif method == "encode_array":
            ids = bpe.encode_array(text)
        else:
            ids = corpus_tokens(text, bpe, cache)
        seconds = time.perf_counter() - t0
        peak_mib = (_status_kib("VmHWM") - rss_before) / 1024
        n = len(ids)
        same = None
        if megabytes <= 8 and method != "one call":  # the pieces' ids equal one call's
            same = bool(np.array_equal(np.asarray(ids),
                                       np.asarray(bpe.hf_tokenizer.encode(text, add_special_tokens=False).ids)))
    return dict(style=style, mb=mb, method=method, peak_mib=peak_mib, seconds=seconds, tokens=n, same=same)


def memory_table() -> None:
    text = read_corpus(None)
    with tempfile.TemporaryDirectory() as d:
        tok_file = str(Path(d) / "bpe.json")
        build_tokenizer("bpe", text, vocab_size=1024).save(tok_file)
        rows = []
        plan = [(style, 8, method) for style in STYLES for method in ("one call", "encode_array")]
        plan += [(style, 100, "encode_array") for style in STYLES] + [("CRLF", 100, "corpus_tokens")]
        for style, megabytes, method in plan:
            proc = subprocess.run([sys.executable, __file__, "--memory", style, str(megabytes), method, tok_file],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"memory worker {style} {megabytes} MB {method} failed:\n{proc.stderr[-2000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n| text | MB | method | peak RSS growth MiB | s | tokens | MiB per MB | same ids as one call |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        same = "" if r["same"] is None else ("yes" if r["same"] else "NO")
        print(f"| {r['style']} | {r['mb']:.0f} | {r['method']} | {r['peak_mib']:,.0f} | {r['seconds']:.1f} | "
              f"{r['tokens']:,} | {r['peak_mib'] / r['mb']:.1f} | {same} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--memory":
        print(json.dumps(memory_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])))
    else:
        main()
        if "--no-memory" not in sys.argv:
            memory_table()
