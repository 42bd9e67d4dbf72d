"""Tokenizers behind one interface: text -> token ids -> text.

Every tokenizer has ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``,
``save(path)``, ``Tokenizer.load(path)``, ``tokens(ids)`` (token strings for labels), ``token_bytes(id)`` (the
UTF-8 bytes one token stands for) and special-token ids ``eos_id`` / ``pad_id`` (None when the vocabulary has
no such token); ``special_ids`` is the set of control-token ids (``<PAD>``, ``<EOS>``, ``<unk>``, and special
tokens added with ``add_special_tokens``, e.g. a chat template's), which ``decode(ids, skip_special=True)``
leaves out. A text a model reads whole (a prompt) is :func:`encode_with_special_tokens`: ``encode`` with the
start token a Hugging Face tokenizer puts first (``bos_id`` where ``add_bos_token``).

Invalid Unicode: every ``encode`` refuses text holding a lone surrogate (U+D800..U+DFFF, which is not a
character; Python makes them from undecodable bytes, e.g. in command-line arguments that are not UTF-8) with
a ``ValueError`` naming its position and, for U+DC80..U+DCFF, the byte it stands for. Nothing is replaced.

Kinds (``TOKENIZERS``, and :func:`build_tokenizer` to make one from a corpus):

* ``"word"`` -- :class:`WordTokenizer`, the lesson's word vocabulary (``token_to_id`` / ``id_to_token``).
* ``"char"`` -- :class:`CharTokenizer`, one token per character: ``<PAD>`` = 0, ``<EOS>`` = 1, then the
  corpus's distinct characters in sorted order (tinyshakespeare: 65 characters -> vocab_size 67).
* ``"bpe"`` -- :class:`BPETokenizer`, byte-level BPE trained with Hugging Face ``tokenizers`` (the GPT-2
  scheme, Radford et al. 2019): ``<PAD>`` = 0, ``<EOS>`` = 1, the 256 byte tokens, then the learned merges.
  Round-trips any UTF-8 text exactly; saved as a plain Hugging Face ``tokenizer.json``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import unicodedata
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .config.names import DEFAULT_BPE_VOCAB_SIZE
from .files import atomic_write_text

EOS = "<EOS>"
PAD = "<PAD>"
UNK = "<unk>"

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, what: str = "text", offset: int = 0) -> None:
    """Raise ``ValueError`` if ``text`` holds a lone surrogate (U+D800..U+DFFF): not a character, and not
    encodable as UTF-8. Python makes U+DC80..U+DCFF from undecodable bytes (``surrogateescape``: command-line
    arguments, file names and standard input that are not UTF-8); the message names that byte."""
    m = _SURROGATE.search(text)
    if m is None:
        return
    cp = ord(m.group())
    byte = (f", Python's stand-in for the byte 0x{cp - 0xDC00:02x} that is not UTF-8 (for example in a "
            f"command-line argument)" if 0xDC80 <= cp <= 0xDCFF else "")
    raise ValueError(f"{what} is not valid Unicode: U+{cp:04X} at position {offset + m.start()} is a lone surrogate"
                     f"{byte}; give UTF-8 text")


def _checked(text: str, what: str) -> str:
    check_unicode(text, what)
    return text


def is_tokenizer(value) -> bool:
    """True for a tokenizer (a :class:`Tokenizer`, or any object with ``encode`` and ``decode`` that is not
    text): what tells a call that put the tokenizer in the input's place (:func:`check_input_first`)."""
    if isinstance(value, Tokenizer):
        return True
    return (not isinstance(value, (str, bytes, bytearray, list, tuple, dict))
            and callable(getattr(value, "encode", None)) and callable(getattr(value, "decode", None)))


def check_input_first(function: str, what: str, given_input) -> None:
    """Every public function that takes a model, an input and a tokenizer takes them in that order: a
    tokenizer given in the input's place is a ``TypeError`` showing the call to write."""
    if is_tokenizer(given_input):
        raise TypeError(f"{function}() got a tokenizer as its {what}: the tokenizer comes after the {what}, as in "
                        f"every public function: {function}(model, {what}, tokenizer, ...)")


def encode_with_special_tokens(tokenizer, text: str) -> list[int]:
    """The ids (T,) of a plain text given to a model whole -- a prompt to continue, a text to trace or score:
    ``tokenizer.encode(text)`` with the tokens the tokenizer puts around a whole text
    (:meth:`Tokenizer.with_special_tokens`: the start token ``<s>`` / ``<|begin_of_text|>`` first where
    ``add_bos_token``, as a Llama 2 / TinyLlama / Llama 3 base model was trained to read), as transformers'
    ``tokenizer(text)``, vLLM's completions (``add_special_tokens=True``), llama.cpp and TransformerLens
    (``prepend_bos``) encode a prompt. decoderlab's own tokenizers, SmolLM2's and Qwen's add nothing, nor does
    a tokenizer without ``with_special_tokens``. Not for a chat template's text (it writes its own start token)
    nor for a piece of a text (a message's content, a stop string, a continuation).

    Special tokens written in the text are those tokens (``encode(text, allow_special=True)``): a prompt typed as
    ``<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n`` is SmolLM2's chat markup, as transformers,
    vLLM and llama.cpp read a prompt; a message's content is text (``encode``'s default).

    Raises: what ``tokenizer.encode`` raises (``KeyError`` for an unknown word, ``ValueError`` for a lone
    surrogate)."""
    ids = list(tokenizer.encode(text, allow_special=True) if isinstance(tokenizer, Tokenizer) else
               tokenizer.encode(text))
    add = getattr(tokenizer, "with_special_tokens", None)
    return ids if add is None else add(ids)


class Tokenizer:
    """The common interface. Subclasses set ``kind`` and implement encode/decode/to_dict/from_dict."""

    kind = "base"
    #: how ``decode`` joins tokens (" " for words, "" for characters and bytes)
    separator = ""
    #: control tokens are words of the text (a word vocabulary: the text "<EOS>" encodes to ``eos_id``), so
    #: text output may show them; otherwise they have no text form and text output leaves them out
    specials_are_text = False

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

    @property
    def bos_id(self) -> int | None:
        """The start-of-text token's id (Hugging Face's ``bos_token``: ``<s>``, ``<|begin_of_text|>``); None for
        decoderlab's own tokenizers, whose texts start without one."""
        return None

    #: whether a text starts with ``bos_id`` (Hugging Face's ``add_bos_token``; :meth:`with_special_tokens`)
    add_bos_token = False
    #: whether a text ends with ``eos_id`` (Hugging Face's ``add_eos_token``)
    add_eos_token = False

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """``ids`` of a text with the tokens the tokenizer puts around a whole text: ``bos_id`` first with
        ``add_bos_token``, ``eos_id`` last with ``add_eos_token`` (Hugging Face's ``add_special_tokens=True``, so
        ``tokenizer.with_special_tokens(tokenizer.encode(text, allow_special=True))`` are ``AutoTokenizer``'s ids
        of ``text``). Unchanged for decoderlab's own tokenizers."""
        ids = list(ids)
        if self.add_bos_token and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if self.add_eos_token and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control tokens (``<PAD>``, ``<EOS>``, ``<unk>``, and added special tokens such as a chat
        template's ``<|user|>``): not text; ``decode(ids, skip_special=True)`` leaves them out."""
        return frozenset(self.token_to_id[t] for t in (PAD, EOS, UNK, *self.added_special_tokens)
                         if t in self.token_to_id)

    @property
    def end_of_text_ids(self) -> tuple[int, ...]:
        """Ids of the tokens that end a text, where generation stops (``eos_id`` first, then in id order):
        ``<EOS>`` (GPT-2's ``<|endoftext|>``), every added special token -- a chat template's end of turn, and
        its turn openers too, since a model that opens a turn has left the text it was writing -- and every id
        of :attr:`eos_ids`. Not ``<PAD>`` (never a target) nor ``<unk>`` (a stand-in for text), unless
        :attr:`eos_ids` names them."""
        eos = self.eos_id
        skip = {eos, self.pad_id, self.token_to_id.get(UNK)}
        rest = sorted({i for i in self.special_ids if i not in skip} | (set(self.eos_ids) - {eos}))
        return ((eos,) if eos is not None else ()) + tuple(rest)

    #: see :attr:`eos_ids` (set by :meth:`with_eos_ids`)
    _eos_ids: tuple[int, ...] = ()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids a model's own settings end its texts at, in their order, beside ``eos_id``: Hugging Face's
        ``eos_token_id`` when it names more than ``eos_id`` (a list, as Llama 3's and Qwen2.5's
        generation_config.json; :func:`decoderlab.hf.load_hf_directory`); () when nothing does. Each is one
        of :attr:`end_of_text_ids`, and is saved with the tokenizer."""
        return self._eos_ids

    def with_eos_ids(self, ids: Iterable[int]) -> "Tokenizer":
        """A copy whose :attr:`eos_ids` are ``ids`` (in order, each once); the vocabulary is shared.

        Raises:
            ValueError: an id outside the vocabulary (0 .. vocab_size - 1), naming it.
        """
        ids = tuple(dict.fromkeys(self._check_ids(ids)))
        new = copy.copy(self)
        new._eos_ids = ids
        return new

    def _saved_eos_ids(self, ids) -> "Tokenizer":
        """This tokenizer (just read by ``from_dict``) with the :attr:`eos_ids` saved beside it (None: none)."""
        if ids:
            self._eos_ids = tuple(dict.fromkeys(self._check_ids(ids)))
        return self

    def encode(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def added_special_tokens(self) -> list[str]:
        """Special tokens added with :meth:`add_special_tokens` (e.g. a chat template's ``<|user|>``), in id
        order; [] for a tokenizer without any."""
        return list(getattr(self, "_added", []))

    def add_special_tokens(self, tokens: Sequence[str]) -> "Tokenizer":
        """A new tokenizer of the same kind with ``tokens`` appended to the vocabulary as atomic special tokens.

        Existing ids are unchanged; the new tokens take the next ids, in the given order; tokens the
        tokenizer already has as special tokens are skipped (so adding twice is a no-op). ``encode`` treats
        text that looks like a special token as ordinary text (``allow_special=False``, the default for char
        and BPE; for word tokenizers pass it explicitly); only ``encode(..., allow_special=True)`` or the ids
        themselves produce special tokens. The tokenizer itself is not modified. Saved and loaded with the
        tokenizer (``to_dict`` lists them under ``"special_tokens"``).

        Raises:
            TypeError: ``tokens`` is not a list of strings.
            ValueError: an empty or whitespace-containing token; a token that is already an ordinary token
                of the vocabulary (it would become ambiguous), naming it.
        """
        if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
            raise TypeError(f"special tokens must be a list of strings, got {tokens!r}")
        new = []
        for t in tokens:
            if not t or any(c.isspace() for c in t):
                raise ValueError(f"special token {t!r} must be a non-empty string without whitespace")
            if t in self.token_to_id:
                if t in self.added_special_tokens or t in (EOS, PAD, UNK):
                    continue
                raise ValueError(f"cannot add special token {t!r}: it is already an ordinary token (id "
                                 f"{self.token_to_id[t]}) of this {self.kind} vocabulary")
            if t not in new:
                new.append(t)
        if not new:
            return self
        out = self._with_specials(new)
        out._eos_ids = self._eos_ids
        return out

    def _with_specials(self, new: list[str]) -> "Tokenizer":  # pragma: no cover - abstract
        raise NotImplementedError

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Each id as its token string (for labels in tables and plots)."""
        return [self.id_to_token[int(i)] for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of one token as ``decode`` writes it (without any separator between tokens).

        Raises:
            ValueError: ``token_id`` is not in the vocabulary.
        """
        (i,) = self._check_ids([token_id])
        return self.id_to_token[i].encode("utf-8")

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a 1-D int64 NumPy array (subclasses may make this faster for whole corpora)."""
        return np.asarray(self.encode(text), dtype=np.int64)

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
        atomic_write_text(path, self.to_json())
        return path

    def to_json(self) -> str:
        """The text :meth:`save` writes: :meth:`to_dict` as JSON."""
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1)

    @staticmethod
    def load(path: str | os.PathLike) -> "Tokenizer":
        """Load any decoderlab tokenizer saved with ``save`` (file or directory holding ``tokenizer.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a valid tokenizer JSON file: {e}") from None
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
    specials_are_text = True

    def __init__(self, words: Sequence[str], *, eos: bool = True, pad: bool = False, unk: bool = False):
        seen = dict.fromkeys(words)  # first-appearance order, duplicates dropped, in linear time
        for flag, tok in ((eos, EOS), (pad, PAD), (unk, UNK)):
            if flag:
                seen.setdefault(tok)
        vocab = list(seen)
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

    def encode(self, text: str | Sequence[str], *, allow_special: bool = True) -> list[int]:
        """Ids of the whitespace-separated words of ``text``. With ``allow_special=False`` a word that is a
        special token (``<EOS>``, ``<PAD>``, added ones such as ``<|user|>``) is text, not that token: it maps
        to ``<unk>`` (or raises ``KeyError`` without one). The default True keeps the lesson's behaviour
        ("<EOS>" typed in a prompt is the ``<EOS>`` token)."""
        if isinstance(text, str):
            check_unicode(text)
        words = text.split() if isinstance(text, str) else list(text)
        specials = set() if allow_special else {EOS, PAD, *self.added_special_tokens}
        ids = []
        for pos, w in enumerate(words):
            i = self.token_to_id.get(w) if w not in specials else None
            if i is None:
                if self.unk_id is None:
                    raise KeyError(
                        f"{'special token typed as text' if w in specials else 'unknown word'} {w!r} at word "
                        f"position {pos}; the vocabulary has "
                        f"{self.vocab_size} tokens: {', '.join(list(self.token_to_id)[:20])}"
                        f"{' ...' if self.vocab_size > 20 else ''}"
                    )
                i = self.unk_id
            ids.append(i)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The words of ``ids`` joined by spaces; ``skip_special=True`` leaves out ``<PAD>``, ``<EOS>``,
        ``<unk>`` and added special tokens."""
        ids = self._check_ids(ids)
        if skip_special:
            special = self.special_ids
            ids = [i for i in ids if i not in special]
        return " ".join(self.id_to_token[i] for i in ids)

    def _with_specials(self, new: list[str]) -> "WordTokenizer":
        data = self.to_dict()
        data["vocab"] = data["vocab"] + new
        data["special_tokens"] = self.added_special_tokens + new
        return WordTokenizer.from_dict(data)

    def to_dict(self) -> dict:
        d = {"decoderlab_tokenizer": self.kind, "vocab": [self.id_to_token[i] for i in range(self.vocab_size)]}
        if self.added_special_tokens:
            d["special_tokens"] = self.added_special_tokens
        if self.eos_ids:
            d["eos_ids"] = list(self.eos_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "WordTokenizer":
        tok = cls.__new__(cls)
        vocab = data["vocab"]
        tok.token_to_id = {w: i for i, w in enumerate(vocab)}
        tok.id_to_token = {i: w for i, w in enumerate(vocab)}
        tok._added = list(data.get("special_tokens") or [])
        missing = [t for t in tok._added if t not in tok.token_to_id]
        if missing:
            raise ValueError(f"not a WordTokenizer vocabulary: special token(s) {missing} are not in the vocab")
        return tok._saved_eos_ids(data.get("eos_ids"))


def _special_pattern(specials: Iterable[str]) -> re.Pattern:
    return re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")


class CharTokenizer(Tokenizer):
    """One token per character: ``<PAD>`` = 0, ``<EOS>`` = 1, then the distinct characters in sorted order,
    then ``<unk>`` (last) when built with ``unk=True``. The classic character-level language-model vocabulary
    (Karpathy's char-rnn / nanoGPT "shakespeare_char"); tinyshakespeare gives vocab_size 67.

    ``encode`` treats the literal strings ``"<EOS>"`` / ``"<PAD>"`` in the text as ordinary characters
    (``"<"``, ``"E"``, ...), so any text encodes the same wherever it came from; pass ``allow_special=True``
    to turn them into the special ids instead. ``decode`` writes special tokens as their strings
    (``skip_special=True`` drops them).

    Args:
        chars: the characters of the vocabulary (any iterable of 1-character strings; sorted and de-duplicated).
        unk: add ``<unk>``; characters not in the vocabulary then encode to it instead of raising.

    Raises:
        ValueError: an entry of ``chars`` is not a single character; ``encode`` of a character not in the
            vocabulary (naming the character, its code point and its position) unless built with ``unk``.
    """

    kind = "char"
    separator = ""

    def __init__(self, chars: Iterable[str], *, unk: bool = False):
        chars = sorted(set(chars))
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"CharTokenizer characters must be 1-character strings, got {bad[:5]!r}")
        self._set_vocab([PAD, EOS, *chars, *([UNK] if unk else [])])

    def _set_vocab(self, vocab: list[str], added: Sequence[str] = ()) -> None:
        self.token_to_id = {t: i for i, t in enumerate(vocab)}
        self.id_to_token = dict(enumerate(vocab))
        self._added = list(added)
        specials = [t for t in (PAD, EOS, UNK, *self._added) if t in self.token_to_id]
        self._special_ids = {self.token_to_id[t] for t in specials}
        self._special_re = _special_pattern(specials)
        self._lut = None  # built by encode_array

    @classmethod
    def from_text(cls, text: str, *, unk: bool = False) -> "CharTokenizer":
        """The vocabulary of the characters of ``text``.

        Raises:
            TypeError: ``text`` is not a string.  ValueError: ``text`` is empty.
        """
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.from_text needs a str, got {type(text).__name__}")
        if not text:
            raise ValueError("CharTokenizer.from_text needs a non-empty text to take its characters from")
        check_unicode(text)
        return cls(text, unk=unk)

    @property
    def unk_id(self) -> int | None:
        return self.token_to_id.get(UNK)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids)

    def _encode_plain(self, text: str, full: str, offset: int) -> list[int]:
        table = self.token_to_id
        unk = self.unk_id
        if unk is not None:
            return [table.get(c, unk) for c in text]
        try:
            return [table[c] for c in text]
        except KeyError:
            pass
        pos = next(p for p, c in enumerate(text) if c not in table) + offset
        line = full.count("\n", 0, pos) + 1
        col = pos - (full.rfind("\n", 0, pos) + 1) + 1
        c = full[pos]
        raise ValueError(
            f"character {c!r} (U+{ord(c):04X}) at position {pos} (line {line}, column {col}) is not in this "
            f"CharTokenizer's vocabulary of {self.vocab_size} tokens; build the tokenizer from a text that "
            f"contains it, or with unk=True to map unknown characters to {UNK}"
        )

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``, one per character (positions in errors count characters from 0).

        With ``allow_special=True`` the literal strings ``"<PAD>"``, ``"<EOS>"`` (and ``"<unk>"`` if present)
        become their special ids.
        """
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode needs a str, got {type(text).__name__}")
        check_unicode(text)
        if not allow_special:
            return self._encode_plain(text, text, 0)
        ids: list[int] = []
        offset = 0
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:
                ids.append(self.token_to_id[part])
            else:
                ids.extend(self._encode_plain(part, text, offset))
            offset += len(part)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as an int64 array, by a table lookup on the text's code points (for corpora)."""
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode needs a str, got {type(text).__name__}")
        if self._lut is None:  # code point -> id, -1 where not in the vocabulary
            chars = [t for t in self.token_to_id if len(t) == 1]
            self._lut = np.full(max(map(ord, chars), default=0) + 2, -1, dtype=np.int64)
            for c in chars:
                self._lut[ord(c)] = self.token_to_id[c]
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        if ((cps >= 0xD800) & (cps <= 0xDFFF)).any():
            check_unicode(text)  # raises, naming the first lone surrogate
        ids = self._lut[np.minimum(cps, len(self._lut) - 1)]  # the last slot is always -1
        if (ids < 0).any():
            if self.unk_id is None:
                self._encode_plain(text, text, 0)  # raises, naming the first unknown character
            ids[ids < 0] = self.unk_id
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = self._check_ids(ids)
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return "".join([self.id_to_token[i] for i in ids])

    def _with_specials(self, new: list[str]) -> "CharTokenizer":
        tok = CharTokenizer.__new__(CharTokenizer)
        tok._set_vocab([self.id_to_token[i] for i in range(self.vocab_size)] + new, self._added + new)
        return tok

    def to_dict(self) -> dict:
        d = {"decoderlab_tokenizer": self.kind, "vocab": [self.id_to_token[i] for i in range(self.vocab_size)]}
        if self._added:
            d["special_tokens"] = list(self._added)
        if self.eos_ids:
            d["eos_ids"] = list(self.eos_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "CharTokenizer":
        vocab = data.get("vocab")
        added = data.get("special_tokens") or []
        if (not isinstance(vocab, list) or vocab[:2] != [PAD, EOS] or not isinstance(added, list)
                or any(not isinstance(t, str) or (len(t) != 1 and t != UNK and t not in added) for t in vocab[2:])
                or len(set(vocab)) != len(vocab) or any(t not in vocab for t in added)):
            raise ValueError(f"not a CharTokenizer vocabulary: expected [{PAD!r}, {EOS!r}, distinct characters"
                             f"..., optional {UNK!r}, added special tokens], got {str(vocab)[:80]}")
        tok = cls.__new__(cls)
        tok._set_vocab(vocab, added)
        return tok._saved_eos_ids(data.get("eos_ids"))


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2, Radford et al. 2019): a reversible map from the 256 byte values to
    printable characters. Bytes that are printable Latin-1 characters stand for themselves; the others
    (control characters, space, ...) take the characters U+0100, U+0101, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


_CHAR_OF_BYTE = _bytes_to_unicode()
_BYTE_OF_CHAR = {c: b for b, c in _CHAR_OF_BYTE.items()}


def byte_level_text(data: bytes) -> str:
    """``data`` spelt in the byte-level alphabet, one character per byte: how a byte-level BPE vocabulary and
    its merges write a token (``b" the"`` -> ``"Ġthe"``); ``BPETokenizer.token_bytes`` reads it back."""
    return "".join(_CHAR_OF_BYTE[b] for b in data)


#: Where text may be cut so that its pieces encode exactly as the whole does: boundaries of the byte-level
#: pre-tokenizer's regex (GPT-2's ``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``)
#: whatever comes before or after. Candidates: after a word character before a non-word one (a letter run
#: or number run ends there: no pattern continues a letter with a non-letter or a number with a non-number),
#: and after a single line-break or tab character between two non-space characters (the whitespace run is
#: that one character, alone or at the end of a piece). :func:`_is_safe_cut` confirms a candidate.
def _part(component) -> dict:
    """A ``tokenizers`` pipeline part (pre-tokenizer, decoder) as the JSON of tokenizer.json ({} for none)."""
    return {} if component is None else json.loads(component.__getstate__())


#: SentencePiece's byte-fallback tokens, <0x00> .. <0xFF>
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: the key of a saved BPETokenizer's Hugging Face names (``BPETokenizer.special_tokens``)
NAMED_KEY = "decoderlab_special_tokens"
#: the key of a saved BPETokenizer's ``eos_ids`` (a char or word tokenizer saves them as "eos_ids")
EOS_IDS_KEY = "decoderlab_eos_ids"

_CUT_CANDIDATE = re.compile(r"(?<=\w)(?=\W)|(?<=\S[\t\n\x0b\x0c\r])(?=\S)")
_CHUNK_CHARS = 1 << 18


def _is_safe_cut(text: str, i: int) -> bool:
    """Whether the byte-level pre-tokenizer splits ``text`` at ``i`` in every context (see _CUT_CANDIDATE)."""
    before, after = text[i - 1], text[i]
    if before in "\t\n\x0b\x0c\r":
        return i >= 2 and not text[i - 2].isspace() and not after.isspace()
    kind_before, kind_after = unicodedata.category(before)[0], unicodedata.category(after)
    if kind_after == "Cn":  # unassigned here: another Unicode version may call it a letter
        return False
    return kind_before in "LN" and kind_after[0] != kind_before


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2's scheme, Radford et al. 2019) trained and run by Hugging Face ``tokenizers``.

    Text is split by the byte-level pre-tokenizer (``add_prefix_space=False``, no normalizer), each piece is
    written as bytes over a 256-character alphabet, and learned merges join frequent byte pairs. Every
    UTF-8 text round-trips exactly: ``decode(encode(text)) == text`` (emoji, CJK, combining accents,
    whitespace, text never seen in training). Vocabulary: ``<PAD>`` = 0, ``<EOS>`` = 1, the 256 byte tokens,
    then the merges. ``save`` writes a plain Hugging Face ``tokenizer.json``; ``Tokenizer.load`` also loads a
    bare one made elsewhere (e.g. GPT-2's, whose ``<|endoftext|>`` then serves as ``eos_id``).

    ``encode`` treats the literal strings ``"<PAD>"`` / ``"<EOS>"`` as text; ``allow_special=True`` turns them
    into the special ids. ``decode`` writes special tokens as their strings (``skip_special=True`` drops
    them). A token may hold part of a character's UTF-8 bytes; ``token_bytes(id)`` gives its raw bytes for
    streaming decoders, and ``decode`` of an incomplete sequence shows U+FFFD for the partial character.

    Make one with :meth:`train`, or wrap a ``tokenizers.Tokenizer``. A tokenizer of a Hugging Face model
    (:func:`decoderlab.hf.read_tokenizer`: any ``tokenizer.json`` -- byte-level BPE, SentencePiece's BPE with
    byte fallback, ...) also carries the names of ``tokenizer_config.json`` (``special_tokens``: ``bos_token``,
    ``eos_token``, ``pad_token``, ``unk_token``, ``add_bos_token``, ``add_eos_token``), saved with it.
    """

    kind = "bpe"
    separator = ""
    specials = (PAD, EOS)
    #: 256 byte tokens + the 2 special tokens + at least one merge
    min_vocab_size = 256 + 2 + 1
    #: the names of Hugging Face's tokenizer_config.json a BPETokenizer keeps (``special_tokens``)
    NAMED = ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token")

    def __init__(self, hf_tokenizer, special_tokens: dict | None = None):
        self._hf = hf_tokenizer
        # literal "<EOS>" in a text is text: only allow_special=True makes special ids (see encode), through a
        # second copy, made when first needed, that splits them off as Hugging Face does (a flag of the shared
        # object would race)
        self._hf.encode_special_tokens = True
        self._hf_special = None
        self.token_to_id = dict(self._hf.get_vocab(with_added_tokens=True))
        self.id_to_token = {i: t for t, i in self.token_to_id.items()}
        self._named = {k: v for k, v in (special_tokens or {}).items() if k in self.NAMED and v is not None}
        # the pipeline's parts read one by one: the whole tokenizer.json of a large vocabulary takes a second
        added = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        self._added = [t for t in sorted(added, key=added.get) if t not in self.specials]
        self._special_ids = set(added.values())
        pre, dec = _part(self._hf.pre_tokenizer), _part(self._hf.decoder)
        self._byte_level = dec.get("type") == "ByteLevel"
        self._bpe = type(self._hf.model).__name__ == "BPE"
        self._byte_fallback = bool(getattr(self._hf.model, "byte_fallback", False))
        # SentencePiece's word start "\u2581" stands for a space (Metaspace, or a decoder replacing it)
        self._metaspace = "\u2581" in json.dumps(dec, ensure_ascii=False) or dec.get("type") == "Metaspace"
        # the safe-cut chunking in encode_array holds for exactly this pipeline
        self._chunkable = (self._byte_level and self._hf.normalizer is None and pre.get("type") == "ByteLevel"
                           and pre.get("use_regex", True))

    @classmethod
    def train(cls, texts: Iterable[str] | str, vocab_size: int) -> "BPETokenizer":
        """Train byte-level BPE on ``texts`` (strings, or one string) up to ``vocab_size`` tokens.

        The result may have fewer tokens than asked when the texts offer fewer merges (then a ``UserWarning``
        names both numbers); ``vocab_size`` on the result is the actual size.

        Raises:
            TypeError: ``vocab_size`` is not an int.
            ValueError: ``vocab_size`` < 259 (256 bytes + 2 specials + 1 merge), naming the value and minimum.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
            raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < cls.min_vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is too small for byte-level BPE: the minimum is {cls.min_vocab_size} "
                f"(256 byte tokens + {len(cls.specials)} special tokens {', '.join(cls.specials)} + 1 merge)"
            )
        if isinstance(texts, str):
            texts = [texts]
        texts = (_checked(t, f"training text {i}") for i, t in enumerate(texts))
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size), special_tokens=list(cls.specials), show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        hf.train_from_iterator(texts, trainer=trainer)
        tok = cls(hf)
        if tok.vocab_size < vocab_size:
            warnings.warn(f"the BPE vocabulary has {tok.vocab_size} tokens, fewer than the vocab_size {vocab_size} "
                          f"asked for: the text offers no more merges (a larger corpus would)", UserWarning,
                          stacklevel=2)
        return tok

    @classmethod
    def from_gpt2_files(cls, vocab_file: str | os.PathLike, merges_file: str | os.PathLike) -> "BPETokenizer":
        """GPT-2's tokenizer files -- ``vocab.json`` (token -> id) and ``merges.txt`` (the merges in order), as
        Hugging Face's ``GPT2Tokenizer`` writes them -- as a byte-level BPE: the byte-level pre-tokenizer
        without a prefix space and the byte-level decoder, as GPT-2. ``<|endoftext|>`` (GPT-2's end of text,
        then ``eos_id``) and decoderlab's ``<PAD>`` / ``<EOS>`` are special tokens when in the vocabulary.

        Raises:
            FileNotFoundError: a file is missing (named).  ValueError: a file is not in this format.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for f in (vocab_file, merges_file):
            if not Path(f).is_file():
                raise FileNotFoundError(f"no GPT-2 tokenizer file {f}")
        try:
            hf = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merges_file)))
            vocab = hf.get_vocab()
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise ValueError(f"{vocab_file} and {merges_file} are not GPT-2 tokenizer files: {e}") from None
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        specials = [t for t in ("<|endoftext|>", *cls.specials) if t in vocab]
        if specials:
            hf.add_special_tokens(specials)
        return cls(hf)

    @property
    def byte_level(self) -> bool:
        """True when this is a byte-level BPE (GPT-2's scheme), which :meth:`save_gpt2_files` can write."""
        return self._byte_level and self._bpe

    def save_gpt2_files(self, directory: str | os.PathLike) -> list[Path]:
        """Write GPT-2's tokenizer files ``vocab.json`` and ``merges.txt`` into ``directory`` (which must
        exist); :meth:`from_gpt2_files` reads them back. Returns their paths.

        Raises:
            ValueError: the tokenizer is not a byte-level BPE.
        """
        if not self.byte_level:
            raise ValueError("only a byte-level BPE tokenizer has GPT-2 tokenizer files (vocab.json, merges.txt)")
        return [Path(f) for f in self._hf.model.save(str(directory))]

    @property
    def vocab_size(self) -> int:
        return max(self.id_to_token) + 1

    @property
    def eos_id(self) -> int | None:
        named = self._named.get("eos_token")
        if named is not None:
            return self.token_to_id.get(named)
        eos = self.token_to_id.get(EOS)
        return eos if eos is not None else self.token_to_id.get("<|endoftext|>")

    @property
    def pad_id(self) -> int | None:
        named = self._named.get("pad_token")
        return self.token_to_id.get(named if named is not None else PAD)

    @property
    def bos_id(self) -> int | None:
        named = self._named.get("bos_token")
        return None if named is None else self.token_to_id.get(named)

    @property
    def add_bos_token(self) -> bool:
        return bool(self._named.get("add_bos_token")) and self.bos_id is not None

    @property
    def add_eos_token(self) -> bool:
        return bool(self._named.get("add_eos_token")) and self.eos_id is not None

    @property
    def special_tokens(self) -> dict:
        """The names of Hugging Face's tokenizer_config.json this tokenizer keeps (``NAMED``; {} for
        decoderlab's own)."""
        return dict(self._named)

    @property
    def hf_tokenizer(self):
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._hf

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids)

    def _encode_plain(self, text: str, offset: int = 0) -> list[int]:
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        except TypeError:  # what the tokenizers library raises for a lone surrogate
            check_unicode(text, offset=offset)  # positions count from the start of the whole text
            raise

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``. With ``allow_special=True`` the literal ``"<PAD>"`` / ``"<EOS>"`` strings
        become their special ids."""
        if not isinstance(text, str):
            raise TypeError(f"BPETokenizer.encode needs a str, got {type(text).__name__}")
        if not allow_special or not self._special_ids:
            return self._encode_plain(text) if len(text) <= _CHUNK_CHARS else self.encode_array(text).tolist()
        if self._hf_special is None:
            from tokenizers import Tokenizer as HFTokenizer

            special = HFTokenizer.from_str(self._hf.to_str())
            special.encode_special_tokens = False
            self._hf_special = special
        try:  # special tokens split off as Hugging Face does (their lstrip/rstrip/normalized flags included)
            return self._hf_special.encode(text, add_special_tokens=False).ids
        except TypeError:  # what the tokenizers library raises for a lone surrogate
            check_unicode(text)
            raise

    def encode_chunks(self, text: str, chunk_chars: int = _CHUNK_CHARS) -> Iterator[np.ndarray]:
        """The ids of ``text`` in consecutive int32 arrays, one per piece of at least ``chunk_chars``
        characters (the last may be shorter); concatenated they equal ``encode(text)``.

        Pieces are cut only where the byte-level pre-tokenizer splits in every context: after a letter
        before a non-letter, after a number before a non-number, or after a single line break (``\n``,
        ``\r``, tab, ...) between two non-space characters -- so LF, CRLF and CR line ends, and text with no
        line break at all, are all cut. The memory of one Hugging Face encoding call is therefore bounded by
        ``chunk_chars`` plus the longest run the pre-tokenizer cannot split (a single word, number or run of
        whitespace or punctuation), whatever the length of ``text``. A tokenizer with another pipeline
        (loaded from elsewhere) is encoded in one call.

        Raises:
            TypeError: ``text`` is not a str; ValueError: ``chunk_chars`` < 1.
        """
        if not isinstance(text, str):
            raise TypeError(f"BPETokenizer.encode needs a str, got {type(text).__name__}")
        if isinstance(chunk_chars, bool) or not isinstance(chunk_chars, (int, np.integer)) or chunk_chars < 1:
            raise ValueError(f"chunk_chars must be an integer >= 1, got {chunk_chars!r}")
        start, n = 0, len(text)
        while start < n:
            end = n
            if self._chunkable and start + chunk_chars < n:
                for m in _CUT_CANDIDATE.finditer(text, start + chunk_chars):
                    if _is_safe_cut(text, m.start()):
                        end = m.start()
                        break
            yield np.asarray(self._encode_plain(text[start:end], start), dtype=np.int32)
            start = end

    def encode_array(self, text: str, chunk_chars: int = _CHUNK_CHARS) -> np.ndarray:
        """``encode(text)`` as an int64 array, a large text encoded in pieces (:meth:`encode_chunks`): the
        same ids as one call, in memory bounded by ``chunk_chars`` (plus the ids: 12 bytes per token)."""
        if isinstance(text, str) and len(text) <= chunk_chars:
            return np.asarray(self._encode_plain(text), dtype=np.int64)
        parts = list(self.encode_chunks(text, chunk_chars))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self._hf.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a token may hold part of a character's UTF-8 bytes); special
        tokens give their string's UTF-8 bytes, e.g. ``b"<EOS>"``.

        Raises:
            ValueError: ``token_id`` is not in the vocabulary.
        """
        (i,) = self._check_ids([token_id])
        tok = self.id_to_token[i]
        if i not in self._special_ids and self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in tok)
        if i not in self._special_ids and self._byte_fallback and _BYTE_TOKEN.fullmatch(tok):
            return bytes([int(tok[3:5], 16)])  # SentencePiece's byte fallback: <0x0A> is the byte 0x0A
        if i not in self._special_ids and self._metaspace:
            return tok.replace("\u2581", " ").encode("utf-8")  # its word start is a space (the decoder strips
            # only the text's first one)
        return self._hf.decode([i], skip_special_tokens=False).encode("utf-8")

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Each token as readable text (its bytes as UTF-8; bytes of a partial character as ``\\xNN``)."""
        return [self.token_bytes(i).decode("utf-8", errors="backslashreplace") for i in ids]

    def _with_specials(self, new: list[str]) -> "BPETokenizer":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_str(self._hf.to_str())
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
        return BPETokenizer(hf, self._named)

    def hf_json(self) -> str:
        """The wrapped tokenizer as Hugging Face's ``tokenizer.json`` text (without decoderlab's keys)."""
        return self._hf.to_str()

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON, written around Hugging Face's own text (its JSON object with decoderlab's keys
        first) rather than through Python dicts: Gemma 3's 262,144 pieces and their merges took ~290 MB more
        as dicts and lists, at every export of a run."""
        extra = {k: v for k, v in ((NAMED_KEY, dict(self._named or {})), (EOS_IDS_KEY, list(self.eos_ids))) if v}
        text = self._hf.to_str()
        if not extra:
            return text
        head = json.dumps(extra, ensure_ascii=False)
        return f"{head[:-1]}, {text.lstrip()[1:]}"

    def to_dict(self) -> dict:
        data = json.loads(self._hf.to_str())
        if self._named:
            data[NAMED_KEY] = dict(self._named)
        if self.eos_ids:
            data[EOS_IDS_KEY] = list(self.eos_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        named, eos_ids = data.get(NAMED_KEY), data.get(EOS_IDS_KEY)
        data = {k: v for k, v in data.items() if k not in ("decoderlab_tokenizer", NAMED_KEY, EOS_IDS_KEY)}
        try:
            hf = HFTokenizer.from_str(json.dumps(data))
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            raise ValueError(f"not a valid Hugging Face tokenizer.json: {e}") from e
        return cls(hf, named if isinstance(named, dict) else None)._saved_eos_ids(eos_ids)


TOKENIZERS: dict[str, type[Tokenizer]] = {"word": WordTokenizer, "char": CharTokenizer, "bpe": BPETokenizer}

#: vocabulary size for ``build_tokenizer("bpe", text)`` when none is given


def build_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer of ``kind`` from a corpus ``text``.

    * ``"char"``: :meth:`CharTokenizer.from_text` (ids: ``<PAD>`` 0, ``<EOS>`` 1, sorted characters).
    * ``"word"``: a :class:`WordTokenizer` of the text's whitespace-separated words in first-appearance order,
      then ``<EOS>``, ``<PAD>``, ``<unk>`` (unknown words in prompts map to ``<unk>``).
    * ``"bpe"``: :meth:`BPETokenizer.train` with ``vocab_size`` (default ``DEFAULT_BPE_VOCAB_SIZE`` = 1024).

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: unknown ``kind`` (naming the allowed kinds); empty text; ``vocab_size`` given for
            ``"char"`` / ``"word"`` (their size follows from the text) or too small for ``"bpe"``.
    """
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; allowed: {', '.join(TOKENIZERS)}")
    if not isinstance(text, str):
        raise TypeError(f"build_tokenizer needs the corpus as a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("cannot build a tokenizer from an empty text")
    check_unicode(text, "the corpus")
    if kind == "bpe":
        return BPETokenizer.train([text], DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
    if vocab_size is not None:
        raise ValueError(f"vocab_size={vocab_size} only applies to the bpe tokenizer; a {kind} tokenizer's "
                         f"size is set by the text's distinct {'characters' if kind == 'char' else 'words'}")
    if kind == "char":
        return CharTokenizer.from_text(text)
    return WordTokenizer.from_texts([text], eos=True, pad=True, unk=True)
