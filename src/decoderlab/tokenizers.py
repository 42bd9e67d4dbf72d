"""Tokenizers behind one interface: text -> token ids -> text.

Every tokenizer has ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``,
``save(path)``, ``load(path)``, and special-token ids ``eos_id`` / ``pad_id`` (None when the vocabulary has no
such token). ``WordTokenizer`` is the lesson's vocabulary (``token_to_id`` / ``id_to_token``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

EOS = "<EOS>"
PAD = "<PAD>"
UNK = "<unk>"


class Tokenizer:
    """The common interface. Subclasses set ``kind`` and implement encode/decode/to_dict/from_dict."""

    kind = "base"
    #: how ``decode`` joins tokens (" " for words, "" for characters and bytes)
    separator = ""

    token_to_id: dict[str, int]
    id_to_token: dict[int, str]

    @property
    def vocab_size(self) -> int:
        return len(self.token_to_id)

    @property
    def eos_id(self) -> int | None:
        return self.token_to_id.get(EOS)

    @property
    def pad_id(self) -> int | None:
        return self.token_to_id.get(PAD)

    def encode(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Each id as its token string (for labels in tables and plots)."""
        return [self.id_to_token[int(i)] for i in ids]

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in ids:
            i = int(i)
            if i not in self.id_to_token:
                raise ValueError(f"token id {i} is out of range; allowed ids are 0 .. {self.vocab_size - 1}")
            out.append(i)
        return out

    # -- persistence ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer as JSON to ``path`` (a file, or a directory that gets ``tokenizer.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        from .checkpoint import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False, indent=1))
        return path

    @staticmethod
    def load(path: str | os.PathLike) -> "Tokenizer":
        """Load any decoderlab tokenizer saved with ``save`` (file or directory holding ``tokenizer.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
        kind = data.get("decoderlab_tokenizer") if isinstance(data, dict) else None
        if kind is None and isinstance(data, dict) and "model" in data:  # a bare Hugging Face tokenizer.json
            kind = "bpe"
        cls = TOKENIZERS.get(kind)
        if cls is None:
            raise ValueError(f"{path} holds an unknown tokenizer kind {kind!r}; known: {', '.join(TOKENIZERS)}")
        return cls.from_dict(data)


class WordTokenizer(Tokenizer):
    """A word-level vocabulary, as in the lesson: ``token_to_id`` / ``id_to_token`` dictionaries.

    Text is split on whitespace; special tokens such as ``<EOS>`` are words like any other. For the lesson,
    ``WordTokenizer(["what", "is", "statquest", "awesome"])`` gives ids what=0, is=1, statquest=2, awesome=3,
    <EOS>=4.

    Args:
        words: the vocabulary's words, in id order (duplicates are dropped).
        eos: add ``<EOS>`` after the words (default True).
        pad: add ``<PAD>`` (used to pad pairs of different lengths).
        unk: add ``<unk>``; unknown words then map to it instead of raising.

    Raises:
        KeyError: ``encode`` of a word not in the vocabulary (naming the word), unless made with ``unk``.
    """

    kind = "word"
    separator = " "

    def __init__(self, words: Sequence[str], *, eos: bool = True, pad: bool = False, unk: bool = False):
        vocab: list[str] = []
        for w in words:
            if w not in vocab:
                vocab.append(w)
        for flag, tok in ((eos, EOS), (pad, PAD), (unk, UNK)):
            if flag and tok not in vocab:
                vocab.append(tok)
        if not vocab:
            raise ValueError("a WordTokenizer needs at least one word")
        self.token_to_id = {w: i for i, w in enumerate(vocab)}
        self.id_to_token = {i: w for w, i in self.token_to_id.items()}

    @classmethod
    def from_texts(cls, texts: Iterable[str], **kwargs) -> "WordTokenizer":
        """Vocabulary of the words in ``texts`` in order of first appearance (specials handled by kwargs)."""
        words = [w for t in texts for w in t.split() if w not in (EOS, PAD, UNK)]
        return cls(words, **kwargs)

    @property
    def unk_id(self) -> int | None:
        return self.token_to_id.get(UNK)

    def encode(self, text: str | Sequence[str]) -> list[int]:
        words = text.split() if isinstance(text, str) else list(text)
        ids = []
        for pos, w in enumerate(words):
            i = self.token_to_id.get(w)
            if i is None:
                if self.unk_id is None:
                    raise KeyError(
                        f"unknown word {w!r} at word position {pos}; the vocabulary has "
                        f"{self.vocab_size} tokens: {', '.join(list(self.token_to_id)[:20])}"
                        f"{' ...' if self.vocab_size > 20 else ''}"
                    )
                i = self.unk_id
            ids.append(i)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.id_to_token[i] for i in self._check_ids(ids))

    def to_dict(self) -> dict:
        return {"decoderlab_tokenizer": self.kind, "vocab": [self.id_to_token[i] for i in range(self.vocab_size)]}

    @classmethod
    def from_dict(cls, data: dict) -> "WordTokenizer":
        tok = cls.__new__(cls)
        vocab = data["vocab"]
        tok.token_to_id = {w: i for i, w in enumerate(vocab)}
        tok.id_to_token = {i: w for i, w in enumerate(vocab)}
        return tok


TOKENIZERS: dict[str, type[Tokenizer]] = {"word": WordTokenizer}
