"""Text out of the engine: whole-character text pieces as tokens arrive, and a conversation that continues
its token history turn after turn."""

from __future__ import annotations

from typing import Iterator, Sequence

from ..tokenizers import check_input_first
from .checks import MAX_SEED
from .engine import prepare, stream, stream_tokens
from .params import SamplingParams
from .stops import text_decoder


class TextStreamer:
    """Turns token ids into text pieces as they arrive, never splitting a character.

    Works for every tokenizer using only ``decode``: each new piece is the text of the ids since the last
    emitted boundary, decoded together with the ids just before it (so word separators come out right), minus
    the text already emitted. While that text ends in U+FFFD -- a byte-level BPE token ended in the middle of
    a UTF-8 character -- nothing is emitted and the ids are held until the character completes. Control
    tokens (``<EOS>``, ``<PAD>``, ``<unk>``) of a character or BPE vocabulary are not text: they are decoded
    with ``skip_special=True``, so they never appear as if the model had written "<EOS>" (in a word
    vocabulary they are words, written as the lesson writes them: "awesome <EOS>"). The concatenation of all
    pieces (``put`` ... then ``end``) equals ``tokenizer.decode(all ids, skip_special=True)`` (plain
    ``decode`` for a word vocabulary).

    ``context``: ids before the first one put (e.g. the prompt), decoded only as context so that the first
    piece starts with the right separator; their own text is not emitted.

    ``put(token_id) -> str`` (possibly ""); ``end() -> str`` flushes what is held (a character that never
    completed comes out as U+FFFD, as ``decode`` writes it).
    """

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer)
        self.ids: list[int] = [int(i) for i in context]
        self.prefix = 0  # ids[prefix:read] were emitted already; decoded again only as context
        self.read = len(self.ids)

    def put(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            piece = text[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def end(self) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


def stream_text(model, prompt: str | Sequence[int], tokenizer, params: SamplingParams | int | None = None, *,
                use_cache: bool = True, keep=None, echo: bool = False, **sampling) -> Iterator[str]:
    """Stream the continuation of ``prompt`` as text pieces (str), never splitting a UTF-8 character.

    ``prompt`` is text (encoded with ``tokenizer``) or token ids (bytes are refused: decode them first);
    the tokenizer comes after the prompt, as in every public function (one in the prompt's place is a
    ``TypeError``);
    ``params`` / ``**sampling`` and the other arguments are those of :func:`stream` (``<PAD>`` is never sampled
    and the end-of-text tokens end the text, by default). Stop strings are matched on the text, and the text
    ends exactly before the first one, also when it begins inside a token. Control tokens are never written as
    text (see :class:`TextStreamer`). The pieces joined equal ``tokenizer.decode(generate(...),
    skip_special=True)`` for the same arguments, plus, when a stop string begins inside a token, the text of
    that token before the stop.

    ``echo``: first yield the prompt's text (``decode(prompt ids)``), and decode the continuation together
    with it, so that word tokens keep the separator between prompt and continuation.

    Every argument is checked at the call (``ValueError`` / ``TypeError`` as :func:`stream`), not when the
    first piece is asked for.
    """
    check_input_first("stream_text", "prompt", prompt)
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"prompt is bytes ({bytes(prompt[:30])!r}); pass text (a str: decode the bytes first) "
                        f"or a list of token ids")
    ids, bound, keep = prepare(model, prompt, params, tokenizer, keep, sampling)
    if not isinstance(echo, bool):
        raise TypeError(f"echo must be True or False, got {echo!r}")
    stops = bound.stops()
    tokens = stream_tokens(model, list(ids), bound, stops, use_cache=use_cache, keep=keep)
    return text_pieces(tokenizer, tokens, stops=stops, context=ids if echo else (), echo=echo)


def text_pieces(tokenizer, tokens: Iterator[int], produced: list[int] | None = None, stops=None,
                 context: Sequence[int] = (), echo: bool = False):
    """Whole-character text pieces of the ids ``tokens`` yields (appended to ``produced`` if given), ending
    with the text a stop string left inside its tokens (``stops.tail``); with ``echo``, first the text of
    ``context``. Returns the token generator's own return value (what a stop swallowed, or None)."""
    if echo:
        head = text_decoder(tokenizer)(list(context))
        if head:
            yield head
    streamer = TextStreamer(tokenizer, context)
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
    tail = streamer.end() + (stops.tail if stops is not None and result is not None else "")
    if tail:
        yield tail
    return result


#: the note of a reply that is empty because the model ended its turn at once (the reply stays in the conversation)
EMPTY_REPLY = "(an empty reply: the model ended its turn at once)"


class ChatSession:
    """A conversation with a model: each turn continues the token history of the previous ones.

    The user's text is encoded as it is (a word tokenizer's typed ``<EOS>`` is the ``<EOS>`` token); every
    reply stops at ``<EOS>`` (when the tokenizer has one), which stays in the history as the separator between
    turns. The model sees the last max_len tokens of the history (the window rule of :func:`stream`). A chat
    checkpoint's conversation, rendered with its template, is ``decoderlab.chat.TemplateChatSession``.

    Args:
        model, tokenizer: e.g. from ``load_checkpoint``.
        params: the sampling settings (a :class:`SamplingParams`), or None; ``**sampling`` fields applied over
            it (not given: the :class:`SamplingParams` defaults). The seed seeds turn i's sampling with seed + i
            (None: fresh entropy).

    ``params`` is the session's settings (replace it to change them: ``session.params =
    session.params.replace(temperature=0.5)``); ``reply(text)`` yields the reply as text pieces while it is
    generated; ``reset()`` forgets the conversation; ``notice`` is what the last reply did not say itself (None,
    or :data:`EMPTY_REPLY`). (The ``decoderlab chat`` slash commands that change the settings live in the CLI.)
    """

    def __init__(self, model, tokenizer, params: SamplingParams | None = None, **sampling):
        self.model, self.tokenizer = model, tokenizer
        self.params = SamplingParams.of(params, **sampling)
        self.turn = 0
        self.history: list[int] = []
        self.notice: str | None = None

    def turn_params(self) -> SamplingParams:
        """This turn's settings: the session's, seeded with seed + turn (wrapping within 0 .. 2**63-1)."""
        seed = self.params.seed
        return self.params if seed is None else self.params.replace(seed=(seed + self.turn) & MAX_SEED)

    def reset(self) -> None:
        self.history = []
        self.turn = 0

    def reply(self, text: str) -> Iterator[str]:
        tok = self.tokenizer
        eos = tok.eos_id
        ids = tok.encode(text)
        history = self.history + ids
        params = self.turn_params()
        if eos is not None:  # the reply ends at <EOS> also when the settings let end-of-text tokens through
            params = params.replace(stop=(params.stop or ()) + (eos,))
        gen = stream(self.model, history, params, tokenizer=tok)
        produced: list[int] = []
        self.notice = None
        matched = yield from text_pieces(tok, gen, produced)
        self.notice = EMPTY_REPLY if not produced and eos is not None and matched == (eos,) else None
        history += produced + (list(matched) if matched else [])
        self.history = history[-self.model.config.max_len :]  # all the model can see
        self.turn += 1
