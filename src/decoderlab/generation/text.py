"""Text out of the engine: whole-character text pieces as tokens arrive, and a conversation that continues
its token history turn after turn."""

from __future__ import annotations

from typing import Iterator, Sequence

from .engine import stream
from .sampling import check_int, check_sampling


class TextStreamer:
    """Turns token ids into text pieces as they arrive, never splitting a character.

    Works for every decoderlab tokenizer using only ``decode``: each new piece is the text of the ids since
    the last emitted boundary, decoded together with the ids just before it (so word separators come out
    right), minus the text already emitted. While that text ends in U+FFFD -- a byte-level BPE token ended in
    the middle of a UTF-8 character -- nothing is emitted and the ids are held until the character completes.
    The concatenation of all pieces (``put`` ... then ``end``) equals ``tokenizer.decode(all ids)``.

    ``put(token_id) -> str`` (possibly ""); ``end() -> str`` flushes what is held (a character that never
    completed comes out as U+FFFD, as ``decode`` writes it).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were emitted already; decoded again only as context
        self.read = 0

    def put(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            piece = text[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def end(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


def stream_text(model, tokenizer, prompt: str | Sequence[int], max_new_tokens: int = 200,
                **kwargs) -> Iterator[str]:
    """Stream the continuation of ``prompt`` as text pieces (str), never splitting a UTF-8 character.

    ``prompt`` is text (encoded with ``tokenizer``) or token ids; ``kwargs`` are those of :func:`stream`
    (temperature, top_k, top_p, stop, seed, use_cache, keep). The pieces joined equal
    ``tokenizer.decode(generate(...))`` for the same arguments.
    """
    yield from _text_pieces(tokenizer, stream(model, prompt, max_new_tokens, tokenizer=tokenizer, **kwargs))


def _text_pieces(tokenizer, tokens: Iterator[int], produced: list[int] | None = None):
    """Whole-character text pieces of the ids ``tokens`` yields (appended to ``produced`` if given); returns
    the token generator's own return value (the stop sequence that ended it, or None)."""
    streamer = TextStreamer(tokenizer)
    while True:
        try:
            token = next(tokens)
        except StopIteration as end:
            result = end.value
            break
        if produced is not None:
            produced.append(token)
        piece = streamer.put(token)
        if piece:
            yield piece
    tail = streamer.end()
    if tail:
        yield tail
    return result


class ChatSession:
    """A conversation with a model: each turn continues the token history of the previous ones.

    For a model trained on prompt/response pairs (``pairs=True``, the lesson's task) the user's text is
    followed by ``<EOS>`` as in the lesson ("what is statquest <EOS>" -> "awesome <EOS>"); every reply stops
    at ``<EOS>`` (when the tokenizer has one), which stays in the history as the separator between turns.
    The model sees the last max_len tokens of the history (the window rule of :func:`stream`).

    Args:
        model, tokenizer: e.g. from ``load_checkpoint``.
        pairs: the model was trained on prompt/response pairs.
        temperature: default 0 (greedy, as the lesson) for pairs, 1.0 otherwise; top_k, top_p as in
            :func:`stream`; max_new_tokens: default max_len for pairs, 200 otherwise.
        seed: seeds turn i's sampling with seed + i (None: fresh entropy).

    ``reply(text)`` yields the reply as text pieces while it is generated; ``reset()`` forgets the
    conversation. (The ``decoderlab chat`` slash commands that change the settings live in the CLI.)
    """

    def __init__(self, model, tokenizer, *, pairs: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, max_new_tokens: int | None = None,
                 seed: int | None = None):
        self.model, self.tokenizer, self.pairs = model, tokenizer, pairs
        self.temperature = (0.0 if pairs else 1.0) if temperature is None else temperature
        self.top_k, self.top_p = top_k, top_p
        self.max_new_tokens = (model.config.max_len if pairs else 200) if max_new_tokens is None else max_new_tokens
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_int("max_new_tokens", self.max_new_tokens, 0)
        self.seed = seed
        self.turn = 0
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = []
        self.turn = 0

    def reply(self, text: str) -> Iterator[str]:
        tok = self.tokenizer
        eos = tok.eos_id
        ids = tok.encode(text)
        if self.pairs:
            if eos is None:
                raise ValueError("a model trained on prompt/response pairs needs a tokenizer with <EOS>")
            if not ids or ids[-1] != eos:
                ids.append(eos)
        history = self.history + ids
        seed = None if self.seed is None else self.seed + self.turn
        gen = stream(self.model, history, self.max_new_tokens, self.temperature, self.top_k, self.top_p,
                     stop=None if eos is None else [eos], seed=seed, tokenizer=tok)
        produced: list[int] = []
        matched = yield from _text_pieces(tok, gen, produced)
        history += produced + (list(matched) if matched else [])
        self.history = history[-self.model.config.max_len :]  # all the model can see
        self.turn += 1
