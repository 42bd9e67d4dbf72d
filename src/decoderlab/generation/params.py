"""``SamplingParams``: every setting of one generation in one frozen, checked object -- the one thing that travels
from the caller (library, CLI, chat, server) through the engine, text streaming and the scheduler.

Built once and checked once (``SamplingParams(...)``, ``params.replace(...)``); what depends on a model and a
tokenizer (token ids against the vocabulary, stop strings the tokenizer can write, the default suppressed
``<PAD>``, the end-of-text ids) is resolved once more by :meth:`SamplingParams.bind`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config.defaults import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
from .checks import check_int, check_seed
from .grammar import BoundGrammar, Grammar, bind_grammar
from .processors import (FrequencyPenalty, GrammarMask, LogitBias, MinP, PresencePenalty, RepetitionPenalty,
                         SuppressTokens, Temperature, TopK, TopP)
from .stops import Stops, end_of_text_ids, normalize_stop, resolve_stops, text_decoder


class SamplingValueError(ValueError):
    """A :class:`SamplingParams` setting out of range; ``field`` names it (the message says what is allowed)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SamplingTypeError(TypeError):
    """A :class:`SamplingParams` setting of the wrong type; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _check_bool(name: str):
    def check(value) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    return check


def _check_suppress(value):
    return None if value is None else SuppressTokens.check(value)


#: field -> its check (value -> normalised value); the processors' checks are the one definition of theirs
_CHECKS: dict[str, Callable] = {
    "max_new_tokens": lambda v: check_int("max_new_tokens", v, 0),
    "temperature": Temperature.check,
    "top_k": TopK.check,
    "top_p": TopP.check,
    "min_p": MinP.check,
    "repetition_penalty": RepetitionPenalty.check,
    "frequency_penalty": FrequencyPenalty.check,
    "presence_penalty": PresencePenalty.check,
    "logit_bias": LogitBias.check,
    "suppress_tokens": _check_suppress,
    "grammar": GrammarMask.check,
    "stop": normalize_stop,
    "stop_at_eos": _check_bool("stop_at_eos"),
    "seed": lambda v: None if v is None else check_seed(v),
}


#: keywords that are short for a field: ``json_schema=S`` is ``grammar=Grammar.json_schema(S)``
ALIASES: dict[str, Callable] = {"json_schema": lambda v: ("grammar", None if v is None else Grammar.json_schema(v))}


def _aliased(changes: dict) -> dict:
    """``changes`` with the :data:`ALIASES` keywords as the fields they stand for."""
    if not any(k in ALIASES for k in changes):
        return changes
    out = {}
    for k, v in changes.items():
        if k in ALIASES:
            try:
                name, v = ALIASES[k](v)
            except ValueError as e:
                raise SamplingValueError("grammar", f"{k}: {e}") from None
            except TypeError as e:
                raise SamplingTypeError("grammar", f"{k}: {e}") from None
            if name in changes:
                raise TypeError(f"{k}= and {name}= are the same setting; give one")
            k = name
        out[k] = v
    return out


def _known(changes: dict) -> None:
    unknown = sorted(set(changes) - set(_CHECKS) - set(ALIASES))
    if unknown:
        raise TypeError(f"unknown sampling setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"known: {', '.join(_CHECKS)}")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The settings of one generation (a frozen dataclass, checked when built; numbers of any kind are
    accepted -- Python, NumPy, 0-d tensors -- and stored as Python numbers).

    Attributes:
        max_new_tokens: the most tokens to produce, >= 0 (default ``decoderlab.config.DEFAULT_MAX_NEW_TOKENS``,
            200). Tokens swallowed by a stop count.
        temperature: >= 0, finite; 0 is greedy (the argmax after the penalties, bias and suppression); default
            ``decoderlab.config.DEFAULT_TEMPERATURE`` (1.0).
        top_k: keep the k most probable tokens; 0 or None: no filter (stored as None).
        top_p: nucleus sampling, in (0, 1]; None or 1 keeps every token.
        min_p: keep tokens at least ``min_p`` times as probable as the most probable one, in [0, 1]; 0 or
            None: off (stored as None).
        repetition_penalty: CTRL's penalty over the prompt and the generated tokens, > 0; 1 is off.
        frequency_penalty, presence_penalty: OpenAI's penalties over the generated tokens, -2 .. 2; 0 is off.
        logit_bias: token id -> bias in -100 .. 100 (-100 bans the token); stored as a tuple of (id, bias)
            pairs in id order (``dict(params.logit_bias)``), None when empty.
        suppress_tokens: ids never generated (their logits -inf, also when greedy); None (default): the
            tokenizer's ``<PAD>`` (resolved by :meth:`bind`); ``()``: none.
        grammar: structured output, a :class:`decoderlab.generation.grammar.Grammar` (a JSON schema, a
            regex, a Lark grammar, a choice) that the generated text follows (a token mask before sampling;
            generation ends when the grammar allows no more text); a dict is a JSON schema. The keyword
            ``json_schema=`` (of :meth:`of`, ``generate``, ``stream``) is short for
            ``grammar=Grammar.json_schema(...)``. Needs a tokenizer when bound.
        stop: where to stop, before emitting it: a token id, a tuple of ids (one sequence), a string (matched
            on the decoded text; a control token's name, ``"<EOS>"``, is that token), or a list of these
            (stored as a tuple, see :func:`decoderlab.generation.stops.normalize_stop`).
        stop_at_eos: the tokenizer's end-of-text tokens end generation, as a stop (``<EOS>``, and a chat
            template's end of turn and turn tokens: ``Tokenizer.end_of_text_ids``; Hugging Face's
            ``eos_token_id``, which may list several). False lets them through as ids.
        seed: seeds the ``torch.Generator`` of the sampling, 0 .. 2**63-1; None: fresh entropy.

    The logits processors run in a documented order (:mod:`decoderlab.generation.processors`).

    Raises:
        SamplingValueError (a ``ValueError``) / SamplingTypeError (a ``TypeError``): a setting out of range or
        of the wrong type; the message names it and what is allowed, ``.field`` names it too.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    grammar: Grammar | None = None
    stop: tuple | None = None
    stop_at_eos: bool = True
    seed: int | None = None

    def __post_init__(self):
        for name, check in _CHECKS.items():
            try:
                value = check(getattr(self, name))
            except TypeError as e:
                raise SamplingTypeError(name, str(e)) from None
            except ValueError as e:
                raise SamplingValueError(name, str(e)) from None
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, params: "SamplingParams | int | None" = None, **changes) -> "SamplingParams":
        """The keyword convenience of the top-level functions: ``params`` (a SamplingParams; an int, short for
        ``max_new_tokens``; or None for the defaults) with ``changes`` (fields) applied and checked.

        Raises: ``TypeError`` for an unknown field (listing the known ones) or a ``params`` of another type;
        what the checks raise."""
        _known(changes)
        changes = _aliased(changes)
        if isinstance(params, cls):
            return params.replace(**changes) if changes else params
        if params is None:
            return cls(**changes)
        if isinstance(params, bool) or isinstance(params, (str, bytes, float)):
            raise TypeError(f"params must be a SamplingParams or the number of new tokens, got {params!r}")
        if "max_new_tokens" in changes:
            raise TypeError("max_new_tokens is given twice (as the number and as max_new_tokens=)")
        return cls(max_new_tokens=params, **changes)

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied, checked as when built (``dataclasses.replace``)."""
        _known(changes)
        return dataclasses.replace(self, **_aliased(changes))

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax (after penalties, bias and suppression), no random draw."""
        return self.temperature == 0.0

    @property
    def uses_counts(self) -> bool:
        """A penalty or a grammar is on, so the rows' state must be kept (``TokenCounts``)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or self.grammar is not None)

    def bind(self, num_tokens: int, tokenizer=None) -> "BoundParams":
        """These settings for one model's vocabulary (``num_tokens`` ids) and tokenizer: ``suppress_tokens``
        None becomes the tokenizer's ``<PAD>`` (none when the padding token is also an end-of-text token); suppressed, biased and stop ids are checked against the
        vocabulary; stop strings against the tokenizer; with ``stop_at_eos`` the tokenizer's end-of-text ids
        join the token-id stops (after the caller's); a grammar is compiled for the tokenizer's vocabulary.

        Raises:
            ValueError: an id out of range (named, with the allowed range); a stop string the tokenizer cannot
                encode; a grammar without a tokenizer or that does not compile for its vocabulary
                (``SamplingValueError`` with field "grammar"). TypeError: a stop string without a tokenizer.
        """
        suppress = self.suppress_tokens
        if suppress is None:  # padding is never a token to write -- unless it is also the end of text (Llama 3's
            # and SmolLM2's tokenizers pad with their end-of-text token), which must stay writable
            pad = getattr(tokenizer, "pad_id", None) if tokenizer is not None else None
            suppress = () if pad is None or int(pad) in end_of_text_ids(tokenizer) else (int(pad),)
        for what, ids in (("suppress_tokens", suppress), ("logit_bias", [i for i, _ in self.logit_bias or ()])):
            bad = [i for i in ids if i >= num_tokens]
            if bad:
                raise SamplingValueError(what, f"{what}: token id {bad[0]} is out of range; allowed ids are "
                                               f"0 .. {num_tokens - 1}")
        seqs, texts = resolve_stops(self.stop, tokenizer, num_tokens)
        if self.stop_at_eos:
            seqs += [(i,) for i in end_of_text_ids(tokenizer) if (i,) not in seqs]
        params = self if suppress == self.suppress_tokens else self.replace(suppress_tokens=suppress)
        grammar = None
        if self.grammar is not None:
            try:
                grammar = bind_grammar(self.grammar, tokenizer, num_tokens)
            except ValueError as e:
                raise SamplingValueError("grammar", str(e)) from None
        return BoundParams(params, tuple(seqs), tuple(texts), text_decoder(tokenizer) if texts else None, grammar)


@dataclass(frozen=True)
class BoundParams:
    """:class:`SamplingParams` bound to a model and tokenizer (:meth:`SamplingParams.bind`).

    Attributes:
        params: the settings, with ``suppress_tokens`` resolved to ids.
        stop_ids: the token-id stops (the caller's, then the end-of-text ids).
        stop_texts: the stop strings, matched on the text decoded with ``decode``.
        grammar: ``params.grammar`` compiled for the tokenizer's vocabulary (each row's state starts from it:
            ``TokenCounts.for_prompts(..., grammars=...)``), or None.
    """

    params: SamplingParams
    stop_ids: tuple[tuple[int, ...], ...] = ()
    stop_texts: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    grammar: BoundGrammar | None = None

    def stops(self) -> Stops:
        """A fresh stop matcher for one row (it holds that row's pending tokens)."""
        return Stops(self.stop_ids, self.stop_texts, self.decode)


def row_settings(rows: Sequence[SamplingParams]) -> list[dict]:
    """Each row's settings as a field -> value dict, as :meth:`LogitsProcessorList.for_rows` reads them
    (``suppress_tokens`` None is no suppression here: binding resolves the tokenizer's default)."""
    out = []
    for p in rows:
        d = {f: getattr(p, f) for f in _CHECKS}
        d["suppress_tokens"] = d["suppress_tokens"] or ()
        out.append(d)
    return out
