"""Data: text -> token ids -> training batches.

The lesson's pair scheme (prompt / response -> inputs and labels) lives here; the corpus -> memmap pipeline
and the ``LightningDataModule`` for language-model training live here too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from .checkpoint import atomic_write_bytes
from .tokenizers import EOS, Tokenizer, WordTokenizer

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


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} is invalid "
            f"({e.reason}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    return text.removeprefix("\ufeff")  # a byte-order mark is not text


def read_corpus(path: str | os.PathLike | None = None) -> str:
    """The text of a corpus.

    Args:
        path: None for the embedded tinyshakespeare; a text file; or a folder, whose ``.txt`` files (searched
            recursively, skipping hidden names) are read in sorted order of their relative paths and joined
            with ``"\\n"``. Files are decoded as UTF-8 (a leading byte-order mark is dropped).

    Raises:
        FileNotFoundError: ``path`` does not exist; a folder holds no ``.txt`` file (both named).
        ValueError: a file is not valid UTF-8 (naming the file and the byte offset of the first invalid byte);
            the corpus is empty or only whitespace.
    """
    if path is None:
        path = embedded_corpus_path()
    path = Path(path)
    if path.is_dir():
        files = sorted(
            (f for f in path.rglob("*.txt")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)),
            key=lambda f: f.relative_to(path).as_posix(),
        )
        if not files:
            raise FileNotFoundError(f"corpus folder {path} holds no .txt files")
        text = "\n".join(_read_utf8(f) for f in files)
        what = f"corpus folder {path} ({len(files)} .txt file{'s' if len(files) > 1 else ''})"
    elif path.is_file():
        text = _read_utf8(path)
        what = f"corpus file {path}"
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
    written atomically (temporary file, then ``os.replace``), so a killed run never leaves a partial one.

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
        encode = getattr(tokenizer, "encode_array", None)
        ids = np.asarray(encode(text) if encode is not None else tokenizer.encode(text), dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"the corpus ({len(text)} characters) encodes to no tokens with this "
                             f"{getattr(tokenizer, 'kind', type(tokenizer).__name__)} tokenizer")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= tokenizer.vocab_size:
            raise ValueError(f"the tokenizer produced token id {lo if lo < 0 else hi}, outside its vocabulary "
                             f"0 .. {tokenizer.vocab_size - 1}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ids.astype(dtype).tobytes())
    return np.memmap(path, dtype=dtype, mode="r")


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


#: ignored by ``nn.CrossEntropyLoss`` (its default ignore_index)
IGNORE_INDEX = -100

#: The lesson's two prompt/response pairs.
LESSON_PAIRS: list[tuple[str, str]] = [("what is statquest", "awesome"), ("statquest is what", "awesome")]


def lesson_tokenizer() -> WordTokenizer:
    """The lesson's vocabulary: what=0, is=1, statquest=2, awesome=3, <EOS>=4."""
    return WordTokenizer(["what", "is", "statquest", "awesome"])


def tokenizer_for_pairs(pairs: Sequence[tuple[str, str]]) -> WordTokenizer:
    """A ``WordTokenizer`` over the words of the pairs (first-appearance order), then ``<EOS>``, then
    ``<PAD>`` only if the pairs have different lengths (so the lesson's pairs give the lesson's 5 tokens)."""
    check_pairs(pairs)
    lengths = {len(p.split()) + len(r.split()) for p, r in pairs}
    return WordTokenizer.from_texts([t for pair in pairs for t in pair], pad=len(lengths) > 1)


def check_pairs(pairs) -> None:
    """Raise ``ValueError`` (naming the pair's index) unless ``pairs`` is a non-empty list of
    (prompt, response) string tuples with non-empty prompts."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs must be a non-empty list of (prompt, response) string pairs")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise ValueError(f"pair {i} must be a (prompt, response) tuple of two strings, got {pair!r}")
        if not pair[0].split():
            raise ValueError(f"pair {i} has an empty prompt")


def pair_inputs_and_labels(
    pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn (prompt, response) pairs into training inputs and labels exactly as the lesson does.

    inputs = prompt + ``<EOS>`` + response; labels = inputs shifted left by one, ending in ``<EOS>``. Pairs
    of different lengths are padded at the end: inputs with ``<PAD>``, labels with -100 (ignored by the loss).

    Returns (inputs, labels), both (N, T) int64 tensors.

    Raises:
        ValueError: empty/malformed pairs; the tokenizer has no ``<EOS>``; padding is needed but the tokenizer
            has no ``<PAD>``.
        KeyError: a word not in the tokenizer's vocabulary.
    """
    check_pairs(pairs)
    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS} token, which the pair scheme needs")
    rows_in, rows_lab = [], []
    for prompt, response in pairs:
        ids = tokenizer.encode(prompt) + [eos] + tokenizer.encode(response)
        rows_in.append(ids)
        rows_lab.append(ids[1:] + [eos])
    t = max(len(r) for r in rows_in)
    if any(len(r) != t for r in rows_in) and tokenizer.pad_id is None:
        raise ValueError("the pairs have different lengths, so they need a <PAD> token, which the tokenizer lacks; "
                         "build it with WordTokenizer(..., pad=True) or tokenizer_for_pairs(pairs)")
    pad = tokenizer.pad_id
    inputs = torch.tensor([r + [pad] * (t - len(r)) for r in rows_in], dtype=torch.long)
    labels = torch.tensor([r + [IGNORE_INDEX] * (t - len(r)) for r in rows_lab], dtype=torch.long)
    return inputs, labels


def pair_dataloader(pairs, tokenizer, batch_size: int = 1, shuffle: bool = False) -> DataLoader:
    """The lesson's ``TensorDataset`` + ``DataLoader`` over :func:`pair_inputs_and_labels`."""
    inputs, labels = pair_inputs_and_labels(pairs, tokenizer)
    return DataLoader(TensorDataset(inputs, labels), batch_size=batch_size, shuffle=shuffle)


# ---------------------------------------------------------------------------------------------------------
# Language-model batches: random windows of a token memmap, served by a LightningDataModule (helper R)
# ---------------------------------------------------------------------------------------------------------

import lightning as L  # noqa: E402  (model.py imports it anyway)


class _TokenSource:
    """A 1-D token array that pickles as (file, byte offset, length, dtype) when it is a view of a memmap,
    so each DataLoader worker re-opens the file once instead of receiving a copy of the data."""

    def __init__(self, tokens):
        import numpy as np

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
        import mmap

        import numpy as np

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
        import numpy as np

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
    import numpy as np

    return np.random.default_rng([int(seed), int(batch)]).integers(0, num_windows, size=global_batch, dtype=np.int64)


class RandomWindowBatches(torch.utils.data.Dataset):
    """Training batches: item ``k`` is batch number ``k`` of the run, as ``(inputs, targets)``.

    Each of the ``batch_size * world_size`` rows of global batch ``k`` is a window of ``max_len + 1``
    consecutive tokens starting at :func:`window_offsets`; this rank keeps rows
    ``[rank * batch_size, (rank + 1) * batch_size)``. inputs = window[:-1], targets = window[1:], both
    (batch_size, max_len) int64.
    """

    def __init__(self, tokens, max_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.source = tokens if isinstance(tokens, _TokenSource) else _TokenSource(tokens)
        self.max_len, self.batch_size, self.seed = int(max_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_windows = len(self.source) - self.max_len
        if self.num_windows < 1:
            raise ValueError(f"{len(self.source)} tokens are too few for one window of max_len+1 = {self.max_len + 1}")
        self._arange = None

    def __getitem__(self, k: int):
        import numpy as np

        offsets = window_offsets(self.seed, k, self.batch_size * self.world_size, self.num_windows)
        offsets = offsets[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        if self._arange is None:
            self._arange = np.arange(self.max_len + 1, dtype=np.int64)
        rows = torch.from_numpy(self.source.array[offsets[:, None] + self._arange].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def __len__(self) -> int:  # map-style dataset of unbounded batches; the sampler decides which
        return 2**62


class _CountingSampler(torch.utils.data.Sampler):
    """Yields batch numbers start, start+1, ... without end (the run stops at max_steps)."""

    def __init__(self, start: int):
        self.start = int(start)

    def __iter__(self):
        k = self.start
        while True:
            yield k
            k += 1


class SequentialWindows(torch.utils.data.Dataset):
    """Validation: the non-overlapping windows of a split, grouped into batches.

    Window ``i`` has inputs ``tokens[i*max_len : (i+1)*max_len]`` and targets shifted by one, so the input
    windows do not overlap, the target windows do not overlap, and every token but the first is predicted
    exactly once: ``(len(tokens) - 1) // max_len`` windows. Item ``j`` is batch ``j`` of ``batch_size``
    windows (the last may be smaller); with ``max_batches`` only the first ``max_batches`` batches.
    """

    def __init__(self, tokens, max_len: int, batch_size: int, max_batches: int | None = None,
                 rank: int = 0, world_size: int = 1):
        self.source = tokens if isinstance(tokens, _TokenSource) else _TokenSource(tokens)
        self.max_len, self.batch_size = int(max_len), int(batch_size)
        self.num_windows = (len(self.source) - 1) // self.max_len
        if self.num_windows < 1:
            raise ValueError(f"{len(self.source)} tokens are too few for one window of max_len+1 = {self.max_len + 1}")
        n = -(-self.num_windows // self.batch_size)
        if max_batches is not None:
            n = min(n, int(max_batches))
        self.batches = list(range(int(rank), n, int(world_size)))

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, j: int):
        import numpy as np

        b = self.batches[j]
        first = b * self.batch_size
        count = min(self.batch_size, self.num_windows - first)
        starts = (first + np.arange(count, dtype=np.int64)) * self.max_len
        rows = torch.from_numpy(self.source.array[starts[:, None] + np.arange(self.max_len + 1)].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


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


class TokenDataModule(L.LightningDataModule):
    """A ``LightningDataModule`` over the train and validation token splits of a corpus.

    Training batches are random windows of ``max_len + 1`` tokens (``RandomWindowBatches``): inputs and
    targets shifted by one, each (batch_size, max_len) int64. Batch number k is a pure function of
    (seed, k), and the number of batches served is the DataModule's state (``state_dict`` / Lightning
    checkpoint), so ``--resume`` continues with exactly the batches the uninterrupted run would have seen.
    Under DDP each rank serves ``batch_size`` rows of a global batch of ``batch_size * world_size`` rows: rank
    r takes its slice, so 2 processes with batch B/2 see the rows of one process with batch B.

    Validation: all non-overlapping windows of the validation split (``SequentialWindows``) in batches of
    ``val_batch_size``, at most ``val_batches`` batches (None: all), shared out across ranks.

    The token arrays may be NumPy memmaps (``corpus_tokens``): they stay memory-mapped, and DataLoader
    workers each re-open the file once.

    Raises:
        ValueError: a split shorter than max_len + 1 tokens (naming the lengths); batch_size < 1.
    """

    def __init__(self, train_tokens, val_tokens, *, max_len: int, batch_size: int, seed: int = 0,
                 val_batch_size: int = 64, val_batches: int | None = None, num_workers: int = 0):
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"val_batches must be None (all) or >= 1, got {val_batches!r}")
        self.train_source, self.val_source = _TokenSource(train_tokens), _TokenSource(val_tokens)
        check_split_lengths(len(self.train_source), len(self.val_source), max_len)
        self.max_len, self.batch_size, self.seed = int(max_len), int(batch_size), int(seed)
        self.val_batch_size, self.val_batches, self.num_workers = int(val_batch_size), val_batches, int(num_workers)
        #: number of training batches already consumed (the sampler's state)
        self.batches_served = 0

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self):
        rank, world = self._rank_world()
        ds = RandomWindowBatches(self.train_source, self.max_len, self.batch_size, self.seed, rank, world)
        return DataLoader(ds, batch_size=None, sampler=_CountingSampler(self.batches_served),
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        rank, world = self._rank_world()
        ds = SequentialWindows(self.val_source, self.max_len, self.val_batch_size, self.val_batches, rank, world)
        return DataLoader(ds, batch_size=None, shuffle=False, num_workers=0)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self.batches_served += 1
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batches_served": self.batches_served, "batch_size": self.batch_size,
                "max_len": self.max_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("max_len", self.max_len) != self.max_len:
            raise ValueError(f"the checkpoint's data used max_len={state['max_len']}, this run uses {self.max_len}")
        self.seed = int(state["seed"])
        self.batches_served = int(state["batches_served"])
