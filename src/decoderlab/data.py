"""Data: text -> token ids -> training batches.

The corpus -> memmap pipeline (read, tokenize once, cache, split by position) and the windows a language
model trains and is evaluated on (``RandomWindowBatches``, ``SequentialWindows``). No Lightning here: the
``LightningDataModule`` over these lives in :mod:`decoderlab.training.datamodule`; the lesson's pair scheme
in :mod:`decoderlab.lesson`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .files import atomic_write_chunks
from .jsonl import read_utf8

# ---------------------------------------------------------------------------------------------------------------
# Corpus -> token ids: read a corpus, tokenize it once into a memmap cached on disk, split by position.
# ---------------------------------------------------------------------------------------------------------------

#: the corpus ``read_corpus(None)`` gives: tinyshakespeare, shipped as package data (provenance in SOURCES.md)
EMBEDDED_CORPUS = "tinyshakespeare.txt"


def embedded_corpus_path() -> Path:
    """Path of the embedded tinyshakespeare corpus (``decoderlab/corpora/tinyshakespeare.txt``, ~1.1 MB).

    Raises:
        FileNotFoundError: the package was installed without its data files.
    """
    try:
        path = Path(str(resources.files(__package__).joinpath("corpora", EMBEDDED_CORPUS)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - not imported as a package
        path = Path(__file__).with_name("corpora") / EMBEDDED_CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"the embedded corpus {path} is missing; reinstall decoderlab with its package data")
    return path


#: the longest path the file system takes (Linux's PATH_MAX); a longer "path" is text
_PATH_MAX = 4096


def _check_path_like(path) -> None:
    """A str that cannot name a file -- it holds a newline or a NUL, or is longer than a path may be -- is the
    text itself, given where a path belongs: refuse it with its size, never its contents (a 200 KB text made
    the file system's "File name too long" error repeat all of it)."""
    if isinstance(path, str) and ("\n" in path or "\0" in path or len(path) > _PATH_MAX):
        lines = path.count("\n") + 1
        raise ValueError(f"the corpus path is a str of {len(path):,} characters ({lines:,} line"
                         f"{'s' if lines > 1 else ''}), which is text, not the name of a file: give a text file or a "
                         f"folder of .txt files, or pass the text itself as text= (train_lm(text=...))")
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # a name part longer than the file system's 255 bytes
            raise ValueError(f"the corpus path ({len(str(path)):,} characters) is too long for a file name "
                             f"({e.strerror}): give a text file or a folder of .txt files, or pass the text "
                             f"itself as text= (train_lm(text=...))") from None


def read_corpus(path: str | os.PathLike | None = None) -> str:
    """The text of a corpus.

    Args:
        path: None for the embedded tinyshakespeare; a text file; or a folder, whose ``.txt`` files (searched
            recursively, skipping hidden names) are read in sorted order of their relative paths and joined
            with ``"\\n"``. Files are decoded as UTF-8 (a leading byte-order mark is dropped).

    Raises:
        FileNotFoundError: ``path`` does not exist; a folder holds no ``.txt`` file (both named).
        ValueError: ``path`` is text rather than a path (a str with newlines, or longer than a path can be: its
            size is named, not its contents); ``path`` is not a regular file or folder (a device such as ``/dev/null``, a pipe); a file is not valid UTF-8 (naming the file and the byte offset of the first invalid byte,
            and saying when it is UTF-16 or binary) or is binary (holds a NUL byte, named with its offset); the
            corpus is empty or only whitespace.
    """
    if path is None:
        path = embedded_corpus_path()
    _check_path_like(path)
    path = Path(path)
    if path.is_dir():
        files = sorted(
            (f for f in path.rglob("*.txt")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)),
            key=lambda f: f.relative_to(path).as_posix(),
        )
        if not files:
            raise FileNotFoundError(f"corpus folder {path} holds no .txt files")
        text = "\n".join(read_utf8(f) for f in files)
        what = f"corpus folder {path} ({len(files)} .txt file{'s' if len(files) > 1 else ''})"
    elif path.is_file():
        text = read_utf8(path)
        what = f"corpus file {path}"
    elif path.exists():
        raise ValueError(f"corpus path {path} is not a regular file (give a text file, a folder of .txt files, "
                         f"or nothing for the embedded tinyshakespeare)")
    else:
        raise FileNotFoundError(f"corpus path {path} does not exist (give a text file, a folder of .txt files, "
                                f"or nothing for the embedded tinyshakespeare)")
    if not text.strip():
        raise ValueError(f"{what} is empty: it has {len(text)} characters and none but whitespace")
    return text


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype for ids ``0 .. vocab_size - 1``: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def default_cache_dir() -> Path:
    """``$DECODERLAB_CACHE`` or ``$XDG_CACHE_HOME/decoderlab`` (``~/.cache/decoderlab``), plus ``/tokens``."""
    root = os.environ.get("DECODERLAB_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decoderlab"
    return Path(root) / "tokens"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's JSON (``to_dict``, keys sorted): equal for tokenizers that encode alike."""
    return _sha256(json.dumps(tokenizer.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8"))


def corpus_cache_path(text: str, tokenizer, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`corpus_tokens` keeps the token ids of ``text`` under ``tokenizer``: a file named by the
    sha256 of the text's UTF-8 bytes and of the tokenizer's JSON, and the dtype."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dtype = token_dtype(tokenizer.vocab_size)
    return cache_dir / f"tokens-{_sha256(text.encode('utf-8'))[:24]}-{tokenizer_fingerprint(tokenizer)[:24]}.{dtype.name}"


def corpus_tokens(text: str, tokenizer, cache_dir: str | os.PathLike | None = None) -> np.memmap:
    """The token ids of ``text`` as a read-only 1-D ``np.memmap`` (uint16 when ``tokenizer.vocab_size`` <=
    65,536, else uint32), tokenized once and cached on disk.

    The cache file (see :func:`corpus_cache_path`) is keyed by the sha256 of the text and of the tokenizer's
    JSON, so a second call with the same text and tokenizer maps the existing file without encoding; it is
    written atomically (temporary file, then ``os.replace``), so a killed run never leaves a partial one, and
    piece by piece for a tokenizer with ``encode_chunks`` (BPE), so that encoding a large corpus holds only one
    piece's ids at a time.

    Args:
        text: the corpus (e.g. from :func:`read_corpus`).
        tokenizer: any decoderlab tokenizer (``encode``/``encode_array``, ``vocab_size``, ``to_dict``).
        cache_dir: folder for the cache files (created if needed); None = :func:`default_cache_dir`.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: the text encodes to no tokens; the tokenizer produced an id outside ``0 .. vocab_size-1``.
    """
    if not isinstance(text, str):
        raise TypeError(f"corpus_tokens needs the corpus as a str, got {type(text).__name__}")
    path = corpus_cache_path(text, tokenizer, cache_dir)
    dtype = token_dtype(tokenizer.vocab_size)
    if not (path.is_file() and path.stat().st_size > 0 and path.stat().st_size % dtype.itemsize == 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_chunks(path, _checked_id_bytes(text, tokenizer, dtype))
    return np.memmap(path, dtype=dtype, mode="r")


def _checked_id_bytes(text: str, tokenizer, dtype: np.dtype):
    """The ids of ``text`` as ``dtype`` bytes, piece by piece when the tokenizer encodes in pieces
    (``encode_chunks``: memory bounded whatever the corpus length); raises ``ValueError`` for an id outside
    the vocabulary or a text of no tokens (so the cache file is never written)."""
    chunks = getattr(tokenizer, "encode_chunks", None)
    encode = getattr(tokenizer, "encode_array", None)
    pieces = (chunks(text) if chunks is not None
              else [encode(text) if encode is not None else tokenizer.encode(text)])
    count = 0
    for ids in pieces:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"the tokenizer returned ids of shape {ids.shape}, not a 1-D sequence")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= tokenizer.vocab_size:
                raise ValueError(f"the tokenizer produced token id {lo if lo < 0 else hi}, outside its vocabulary "
                                 f"0 .. {tokenizer.vocab_size - 1}")
        count += ids.size
        yield ids.astype(dtype).tobytes()
    if count == 0:
        raise ValueError(f"the corpus ({len(text)} characters) encodes to no tokens with this "
                         f"{getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer")


def split_tokens(tokens, val_fraction: float = 0.1):
    """Split a 1-D token array by position: the first ``floor(n * (1 - val_fraction))`` tokens for training,
    the rest for validation. Returns ``(train, val)`` as views (slices of a memmap stay memmaps).

    Raises:
        ValueError: ``val_fraction`` not in (0, 1); ``tokens`` not 1-D; a split would be empty (naming n).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    n = len(tokens)
    n_train = math.floor(n * (1 - val_fraction) + 1e-9)
    if n_train == 0 or n_train == n:
        raise ValueError(f"{n} tokens are too few to split with val_fraction={val_fraction}: "
                         f"train would get {n_train} and validation {n - n_train}")
    return tokens[:n_train], tokens[n_train:]


# ---------------------------------------------------------------------------------------------------------
# Language-model batches: random windows of a token memmap, served to the training loop (training.datamodule)
# ---------------------------------------------------------------------------------------------------------

class TokenSource:
    """A 1-D token array that pickles as (file, byte offset, length, dtype) when it is a view of a memmap,
    so each DataLoader worker re-opens the file once instead of receiving a copy of the data."""

    def __init__(self, tokens):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.numpy()
        tokens = np.asarray(tokens) if not isinstance(tokens, np.memmap) else tokens
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array of token ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        self.array = tokens
        self.file = self._file_position(tokens)

    @staticmethod
    def _file_position(tokens):
        mm = getattr(tokens, "_mmap", None)
        name = getattr(tokens, "filename", None)
        if not isinstance(tokens, np.memmap) or mm is None or name is None or not tokens.flags.c_contiguous:
            return None
        base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        start = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY  # where numpy's mmap begins
        return (str(name), start + tokens.ctypes.data - base, len(tokens), tokens.dtype.str)

    def __len__(self) -> int:
        return len(self.array)

    def __getstate__(self):
        if self.file is None:
            return {"array": self.array, "file": None}
        return {"array": None, "file": self.file}

    def __setstate__(self, state):
        self.file = state["file"]
        self.array = state["array"]
        if self.array is None:  # one memmap per process, opened here, reused for every batch
            name, offset, length, dtype = self.file
            self.array = np.memmap(name, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))


def window_offsets(seed: int, batch: int, global_batch: int, num_windows: int):
    """Start positions of the ``global_batch`` random windows of training batch number ``batch``.

    A pure function of (seed, batch): ``numpy.random.default_rng([seed, batch])`` draws ``global_batch``
    integers in [0, num_windows). Resuming at batch k, or splitting the rows over ranks, therefore sees
    exactly the windows an uninterrupted single-process run would. Returns an int64 array (global_batch,).
    """
    return np.random.default_rng([int(seed), int(batch)]).integers(0, num_windows, size=global_batch, dtype=np.int64)


class RandomWindowBatches(torch.utils.data.Dataset):
    """Training batches: item ``k`` is batch number ``k`` of the run, as ``(inputs, targets)``.

    Each of the ``batch_size * world_size`` rows of global batch ``k`` is a window of ``max_len + 1``
    consecutive tokens starting at :func:`window_offsets`; this rank keeps rows
    ``[rank * batch_size, (rank + 1) * batch_size)``. inputs = window[:-1], targets = window[1:], both
    (batch_size, max_len) int64.
    """

    def __init__(self, tokens, max_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.source = tokens if isinstance(tokens, TokenSource) else TokenSource(tokens)
        self.max_len, self.batch_size, self.seed = int(max_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_windows = len(self.source) - self.max_len
        if self.num_windows < 1:
            raise ValueError(f"{len(self.source)} tokens are too few for one window of max_len+1 = {self.max_len + 1}")
        self._arange = None

    def __getitem__(self, k: int):
        offsets = window_offsets(self.seed, k, self.batch_size * self.world_size, self.num_windows)
        offsets = offsets[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        if self._arange is None:
            self._arange = np.arange(self.max_len + 1, dtype=np.int64)
        rows = torch.from_numpy(self.source.array[offsets[:, None] + self._arange].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def __len__(self) -> int:  # map-style dataset of unbounded batches; the sampler decides which
        return 2**62


class CountingSampler(torch.utils.data.Sampler):
    """Yields batch numbers start, start+1, ... without end (the run stops at max_steps)."""

    def __init__(self, start: int):
        self.start = int(start)

    def __iter__(self):
        k = self.start
        while True:
            yield k
            k += 1


class SequentialWindows(torch.utils.data.Dataset):
    """Validation: the non-overlapping windows of a split, grouped into batches, shared out over processes.

    Window ``i`` has inputs ``tokens[i*max_len : (i+1)*max_len]`` and targets shifted by one, so the input
    windows do not overlap, the target windows do not overlap, and every token but the first is predicted
    exactly once: ``(len(tokens) - 1) // max_len`` windows. The validation set is the first
    ``min(windows, max_batches * batch_size)`` of them (all with ``max_batches=None``), the same for any
    number of processes: process ``rank`` of ``world_size`` takes a contiguous share of it (the shares differ
    by at most one window), in batches of at most ``batch_size`` windows. Item ``j`` is this process's batch
    ``j``; one process (the default) gets batches of ``batch_size`` windows, the last maybe smaller.

    Raises:
        ValueError: fewer than max_len + 1 tokens; fewer validation windows than processes (each process
            needs one), naming both numbers.
    """

    def __init__(self, tokens, max_len: int, batch_size: int, max_batches: int | None = None,
                 rank: int = 0, world_size: int = 1):
        self.source = tokens if isinstance(tokens, TokenSource) else TokenSource(tokens)
        self.max_len, self.batch_size = int(max_len), int(batch_size)
        self.num_windows = (len(self.source) - 1) // self.max_len
        if self.num_windows < 1:
            raise ValueError(f"{len(self.source)} tokens are too few for one window of max_len+1 = {self.max_len + 1}")
        total = validation_window_count(len(self.source), self.max_len, self.batch_size, max_batches)
        rank, world_size = int(rank), int(world_size)
        if total < world_size:
            raise ValueError(
                f"the validation set has {total} window{'s' if total != 1 else ''} of max_len+1 = {self.max_len + 1} "
                f"tokens for {world_size} processes, and each process needs at least one: use fewer processes, "
                f"more validation data (val_fraction), more val_batches or a larger val_batch_size")
        lo, hi = rank * total // world_size, (rank + 1) * total // world_size
        #: (first window, number of windows) of each of this process's batches
        self.batches = [(first, min(self.batch_size, hi - first)) for first in range(lo, hi, self.batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, j: int):
        first, count = self.batches[j]
        starts = (first + np.arange(count, dtype=np.int64)) * self.max_len
        rows = torch.from_numpy(self.source.array[starts[:, None] + np.arange(self.max_len + 1)].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


def validation_window_count(num_tokens: int, max_len: int, batch_size: int, max_batches: int | None = None) -> int:
    """How many windows :class:`SequentialWindows` validates on (over all processes together):
    ``min((num_tokens - 1) // max_len, max_batches * batch_size)``, or all windows with ``max_batches=None``."""
    windows = max(0, (int(num_tokens) - 1) // int(max_len))
    return windows if max_batches is None else min(windows, int(max_batches) * int(batch_size))


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for, as an int64 array (vocab_size,): ``len(token_bytes(i))`` plus the
    bytes of the tokenizer's ``separator`` (a word tokenizer writes a space between words), so the bytes of a
    sequence of targets are the sum of their entries (the unit of bits per byte). Ids missing from the vocabulary
    count 0 bytes."""
    sep = len(getattr(tokenizer, "separator", "").encode("utf-8"))
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        try:
            lengths[i] = len(tokenizer.token_bytes(i)) + sep
        except ValueError:  # an id the vocabulary skips (never a target)
            pass
    return lengths


def check_split_lengths(train_len: int, val_len: int, max_len: int) -> None:
    """Raise ``ValueError`` naming the lengths when a split is shorter than one window (max_len + 1 tokens)."""
    short = [f"{name} split has {n} tokens" for name, n in (("train", train_len), ("validation", val_len))
             if n < max_len + 1]
    if short:
        raise ValueError(
            f"the corpus is too short for max_len={max_len}: {' and '.join(short)}, but each split needs at least "
            f"max_len+1 = {max_len + 1} tokens (train {train_len}, validation {val_len} tokens); use a longer "
            f"corpus or a smaller max_len"
        )
