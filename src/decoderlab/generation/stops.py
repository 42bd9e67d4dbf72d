"""Stops: where generation ends, before emitting the stop.

Two kinds of stop, matched in the one stream of generated tokens:

* token ids -- an id or a tuple of ids (and a string naming a control token, such as ``"<EOS>"``): matched on
  the ids the model produces (:class:`StopMatcher`);
* text -- any other string: matched on the decoded text, however the model spells it (``"\\n\\n"`` is found
  whether the model writes one ``"\\n\\n"`` token or two ``"\\n"`` tokens) (:class:`TextStopMatcher`).

Both hold back what could still become a stop, so nothing that belongs to a stop is ever emitted.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..tokenizers import Tokenizer
from .checks import as_scalar, is_integer


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> text`` for text output: a decoderlab tokenizer's ``decode`` with ``skip_special=True`` (control
    tokens such as ``<EOS>`` are not text: the text "<EOS>" is five characters), except for a word vocabulary,
    where ``<EOS>`` is a word as in the lesson ("awesome <EOS>"); any other tokenizer's plain ``decode``."""
    if isinstance(tokenizer, Tokenizer) and not tokenizer.specials_are_text:
        return lambda ids: tokenizer.decode(ids, skip_special=True)
    return tokenizer.decode


def _special_ids(tokenizer) -> frozenset[int]:
    ids = getattr(tokenizer, "special_ids", None)
    if ids is None:
        ids = {i for i in (getattr(tokenizer, "eos_id", None), getattr(tokenizer, "pad_id", None)) if i is not None}
    return frozenset(ids)


def end_of_text_ids(tokenizer) -> tuple[int, ...]:
    """The ids of the control tokens that end a text, which generation stops at (``stop_at_eos``): the
    tokenizer's :attr:`~decoderlab.tokenizers.Tokenizer.end_of_text_ids` (``<EOS>``, and a chat template's end
    of turn and its other turn tokens), or just its ``eos_id`` for a tokenizer that does not name them.
    Empty without a tokenizer."""
    if tokenizer is None:
        return ()
    ids = getattr(tokenizer, "end_of_text_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_id", None)
        ids = () if eos is None else (eos,)
    return tuple(int(i) for i in ids)


def _stop_item(item):
    """One stop, normalised: an int (a token id), a non-empty str, or a non-empty tuple of ints."""
    item = as_scalar(item)
    if is_integer(item):
        return int(item)
    if isinstance(item, str):
        if item == "":
            raise ValueError("a stop string must not be empty")
        return item
    if isinstance(item, (Sequence, torch.Tensor)) and not isinstance(item, (bool, bytes)):
        seq = tuple(as_scalar(t) for t in item)
        if not all(is_integer(t) for t in seq):
            raise TypeError(f"stop must be token ids or strings, got {item!r}")
        if not seq:
            raise ValueError("a stop sequence of token ids must not be empty")
        return tuple(int(t) for t in seq)
    raise TypeError(f"stop must be token ids or strings, got {item!r}")


def normalize_stop(stop) -> tuple | None:
    """``stop`` (see :func:`decoderlab.generation.stream`) as a tuple of stops, each an int (a token id), a
    str (text, or the name of a control token) or a tuple of ints (one multi-token sequence); None for none.
    An int, a string, or a tuple of ids is one stop; a list (or a 1-D tensor) holds several, where a tuple or
    tensor of ids is one sequence.

    Checks what needs no tokenizer (:func:`resolve_stops` checks the rest). Raises ``TypeError`` for an item
    of another type, ``ValueError`` for an empty stop."""
    if stop is None:
        return None
    if isinstance(stop, torch.Tensor):
        stop = stop.tolist()  # a 1-D tensor holds several single-id stops, as a list does
    stop = as_scalar(stop)
    if is_integer(stop) or isinstance(stop, str) or (
            isinstance(stop, Sequence) and not isinstance(stop, (list, bytes)) and stop
            and all(is_integer(as_scalar(t)) for t in stop)):
        items = [stop]  # a single id, a single string, or a tuple of ids (one multi-token stop sequence)
    elif isinstance(stop, bytes):
        raise TypeError(f"stop must be token ids or strings, got {stop!r}")
    else:
        try:
            items = list(stop)
        except TypeError:
            raise TypeError(f"stop must be token ids or strings, got {stop!r}") from None
    return tuple(_stop_item(i) for i in items) or None


def resolve_stops(stops: tuple | None, tokenizer, num_tokens: int) -> tuple[list[tuple[int, ...]], list[str]]:
    """Normalised stops (:func:`normalize_stop`) as (token-id sequences, text stops) for one tokenizer and
    vocabulary: a string naming one of the tokenizer's control tokens (``"<EOS>"``, ``"<PAD>"``,
    ``"<|endoftext|>"``) is that token; any other string is text.

    Raises:
        TypeError: a string without a tokenizer.
        ValueError: an id out of range; a string the tokenizer cannot encode (it could never be produced).
    """
    seqs: list[tuple[int, ...]] = []
    texts: list[str] = []
    for item in stops or ():
        if isinstance(item, str):
            if tokenizer is None:
                raise TypeError(f"stop string {item!r} needs the tokenizer: pass tokenizer=... (or give token ids)")
            vocab = getattr(tokenizer, "token_to_id", None)
            if isinstance(vocab, dict) and vocab.get(item) in _special_ids(tokenizer):  # e.g. "<EOS>"
                seqs.append((vocab[item],))
                continue
            try:
                tokenizer.encode(item)  # text the tokenizer cannot write could never be produced
            except (KeyError, ValueError) as e:
                msg = e.args[0] if e.args else e
                raise ValueError(f"stop string {item!r} cannot be encoded by the tokenizer: {msg}") from None
            texts.append(item)
            continue
        seq = (item,) if isinstance(item, int) else item
        bad = [t for t in seq if not 0 <= t < num_tokens]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is out of range; allowed ids are 0 .. {num_tokens - 1}")
        seqs.append(seq)
    return seqs, texts


def parse_stops(stop, tokenizer, num_tokens: int) -> tuple[list[tuple[int, ...]], list[str]]:
    """``stop`` as (token-id sequences, text stops): :func:`normalize_stop` then :func:`resolve_stops`."""
    return resolve_stops(normalize_stop(stop), tokenizer, num_tokens)


class StopMatcher:
    """Stops a stream of token ids before a stop sequence, holding back tokens that could start one.

    ``push(token)`` returns ``(ids safe to emit, matched stop sequence or None)``; ``flush()`` returns the
    held-back ids when generation ends without a match. Matching is on token ids (for text, see
    :class:`TextStopMatcher`).
    """

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences]
        self.held: list[int] = []

    def push(self, token: int) -> tuple[list[int], tuple[int, ...] | None]:
        held = self.held
        held.append(token)
        if not self.sequences:
            out, self.held = held, []
            return out, None
        for seq in self.sequences:
            if len(held) >= len(seq) and tuple(held[-len(seq):]) == seq:
                out, self.held = held[: len(held) - len(seq)], []
                return out, seq
        keep = 0  # the longest suffix of held that is a proper prefix of a stop sequence
        for seq in self.sequences:
            for k in range(min(len(seq) - 1, len(held)), keep, -1):
                if tuple(held[-k:]) == seq[:k]:
                    keep = k
                    break
        out, self.held = held[: len(held) - keep], held[len(held) - keep:]
        return out, None

    def flush(self) -> list[int]:
        out, self.held = self.held, []
        return out


class TextStopMatcher:
    """Stops a stream of token ids before the first place where the decoded text contains a stop string.

    Args:
        stops: the stop strings (non-empty).
        decode: ids -> text (the tokenizer's decode; control tokens are best left out of the text).

    ``feed(ids)`` takes the next ids and returns ``(ids safe to emit, matched)`` where ``matched`` is the stop
    string found (or None). An id is emitted once no stop can begin inside or before its text: ids whose text
    ends in a prefix of a stop, or in an incomplete character (U+FFFD at the end of the text), are held back.

    When a stop begins inside a token (a token ``"a\\n"`` then ``"\\n"`` with the stop ``"\\n\\n"``), the ids
    emitted end before that token, and ``tail`` holds the text between them and the stop (``"a"``), so that
    text streams can end exactly before the stop. ``flush()`` returns the held ids when generation ends.

    Matching is on the text of the generated tokens only (a stop never reaches back into the prompt).
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.decode = decode
        self.ids: list[int] = []
        self.ctx = 0  # ids[ctx:released] were emitted; decoded again only as context (word separators)
        self.released = 0
        self.tail = ""

    def _text_from(self, base: str, end: int) -> str:
        """Text of ids[released:end], decoded in context."""
        return self.decode(self.ids[self.ctx:end])[len(base):]

    def feed(self, new_ids: Sequence[int]) -> tuple[list[int], str | None]:
        self.ids.extend(new_ids)
        if not self.stops or self.released == len(self.ids):
            return self._release(len(self.ids)), None
        base = self.decode(self.ids[self.ctx:self.released])
        held = self._text_from(base, len(self.ids))
        found = [(held.find(s), s) for s in self.stops]
        found = [f for f in found if f[0] >= 0]
        if found:
            start, matched = min(found)
            limit = held[:start]
        else:
            matched = None
            end = len(held) - 1 if held.endswith("\ufffd") else len(held)  # a character may be incomplete
            start = end
            for p in range(max(0, end - self.longest + 1), end):  # the earliest place a stop could still begin
                if any(s.startswith(held[p:end]) for s in self.stops):
                    start = p
                    break
            limit = held[:start]
        # the most ids whose text lies entirely before ``start``
        k = len(self.ids)
        text = held
        while k > self.released and not limit.startswith(text):
            k -= 1
            text = self._text_from(base, k)
        if matched is not None:
            self.tail = limit[len(text):]
        return self._release(k), matched

    def _release(self, k: int) -> list[int]:
        out = self.ids[self.released:k]
        if k > self.released:
            self.ctx, self.released = self.released, k
        return out

    def flush(self) -> list[int]:
        return self._release(len(self.ids))


class Stops:
    """Token-id stops and text stops together, in generation order: ``push(token) -> (ids to emit, swallowed)``
    where ``swallowed`` is None until a stop ends generation, then the tuple of generated ids that were not
    emitted (the stop sequence itself for a token-id stop; for a text stop, the tokens that spelled it, from
    the first one not emitted). ``tail`` is the text before a text stop that lies inside those tokens
    ("" otherwise). ``flush()`` returns the held ids when generation ends without a stop."""

    def __init__(self, sequences: Sequence[tuple[int, ...]] = (), texts: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None):
        self.ids = StopMatcher(sequences)
        self.text = TextStopMatcher(texts, decode) if texts else None
        self.pending: list[int] = []  # ids given to the text matcher and not emitted yet

    @property
    def tail(self) -> str:
        return self.text.tail if self.text is not None else ""

    def push(self, token: int) -> tuple[list[int], tuple[int, ...] | None]:
        out, seq = self.ids.push(token)
        if self.text is None:
            return out, seq
        self.pending.extend(out)
        emitted, matched = self.text.feed(out)
        del self.pending[: len(emitted)]
        if matched is not None:  # the text stop begins before anything the id matcher holds or matched
            return emitted, tuple(self.pending) + (seq if seq is not None else tuple(self.ids.flush()))
        if seq is not None:
            emitted += self.text.flush()
            self.pending = []
            return emitted, seq
        return emitted, None

    def flush(self) -> list[int]:
        out = self.ids.flush()
        if self.text is None:
            return out
        self.text.feed(out)
        return self.text.flush()
