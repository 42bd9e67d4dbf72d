"""Structured output: a grammar (a JSON schema, a regular expression, a Lark/GBNF grammar, a choice of
strings) that every generated text must follow, applied as a token mask before sampling.

The grammar engine is llguidance (the Rust library behind Guidance, also used by vLLM, SGLang and
llama.cpp; ``docs/serving.md`` says why it over xgrammar and outlines-core, measured). decoderlab gives it the
model's vocabulary as bytes -- each token as ``decode`` writes it after another token (a word vocabulary's
tokens carry the space ``decode`` puts between words; the grammar then starts with that space, which the
reply's text does not have) -- and the control tokens as special tokens that the grammar never produces,
except the end-of-text ones, which it allows once the text is complete.

Pieces:

* :class:`Grammar` -- what the caller asks for, checked when built (``Grammar.json_schema(schema)``,
  ``Grammar.regex(r"[0-9]+")``, ``Grammar.lark(text)``, ``Grammar.choice([...])``, ``Grammar.json_object()``);
  a :class:`decoderlab.generation.SamplingParams` field (``grammar=``; ``json_schema=`` is short for it).
* :func:`bind_grammar` -- the grammar compiled for one tokenizer's vocabulary (:class:`BoundGrammar`),
  done by ``SamplingParams.bind``.
* :class:`GrammarState` -- one row's position in the grammar (a matcher): the tokens allowed next (a (V,)
  bool mask), :meth:`~GrammarState.advance` with the sampled token, :attr:`~GrammarState.complete` when no
  more text is possible (generation then ends the row, as at a stop).

The mask itself is the logits processor :class:`decoderlab.generation.processors.GrammarMask` (last of the
raw processors: disallowed tokens -inf, the others unchanged).

Raises: ``ValueError`` naming the problem for a schema or grammar the library cannot compile.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

KINDS = ("json_schema", "regex", "lark", "choice")

#: llguidance marks a special token's bytes with a leading 0xff (a byte no UTF-8 text holds)
_SPECIAL = b"\xff"


def _llguidance():
    import llguidance  # imported when a grammar is used: plain generation never loads it

    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text (frozen, hashable, checked when built).

    Attributes:
        kind: "json_schema" (``source`` is the schema as JSON text), "regex" (Rust regex syntax, the whole
            text must match), "lark" (a Lark grammar, or llama.cpp's GBNF, as llguidance reads them) or
            "choice" (``source`` a JSON list of the allowed texts).
        source: the text of the grammar.
        strict: json_schema only: True (default) refuses a schema keyword the library cannot enforce; False
            ignores such keywords (OpenAI's ``strict: false``) and enforces the rest.

    Raises: ``ValueError`` for an unknown kind or a grammar llguidance cannot compile (its message),
    ``TypeError`` for a source of the wrong type.
    """

    kind: str
    source: str
    strict: bool = True
    _compiled: str = field(default="", init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise TypeError(f"a {self.kind} grammar's source must be a string, got {type(self.source).__name__}")
        compiled = self._compile()
        error = _llguidance().LLMatcher.validate_grammar(compiled)
        if error:
            raise ValueError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {error.strip()}")
        object.__setattr__(self, "_compiled", compiled)

    # -- constructors -----------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | bool | str, *, strict: bool = True) -> "Grammar":
        """Text that is one JSON value valid against ``schema`` (a dict, a bool schema, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise TypeError(f"a JSON schema must be an object (dict) or a bool, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False), strict=strict)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls("lark", text)

    @classmethod
    def choice(cls, texts: Sequence[str]) -> "Grammar":
        if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"a choice grammar needs a non-empty list of strings, got {texts!r}")
        return cls("choice", json.dumps(list(texts), ensure_ascii=False))

    # -- compiling --------------------------------------------------------------------------------------
    def _compile(self, spaced: bool = False) -> str:
        llg = _llguidance()
        if self.kind == "json_schema":
            # fixed separators, no free whitespace: a small model cannot wander off in spaces -- except for a
            # vocabulary whose tokens all carry a space (words), where JSON's free whitespace is what it writes
            options = {"whitespace_flexible": spaced, "item_separator": ", ", "key_separator": ": ",
                       "lenient": not self.strict}
            try:
                return llg.LLMatcher.grammar_from_json_schema(self.source, overrides=options)
            except ValueError as e:
                raise ValueError(f"the JSON schema cannot be compiled: {e}") from None
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(t) for t in
                                                                          json.loads(self.source)))
        try:
            return llg.grammar_from("grammar", self.source)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"the grammar cannot be read: {e}") from None

    def compiled(self, separator: str = "") -> str:
        """The llguidance grammar (its JSON text); with a ``separator`` the text starts with it (a word
        vocabulary's tokens all carry the space before them)."""
        if not separator:
            return self._compiled
        inner = _top(self._compile(spaced=True))
        inner["name"] = "reply"
        return json.dumps({"grammars": [{"lark_grammar": f"start: {json.dumps(separator)} @reply"}, inner]})


def _top(compiled: str) -> dict:
    """The first grammar of a compiled llguidance grammar (lark text or its JSON form) as a dict."""
    try:
        data = json.loads(compiled)
    except json.JSONDecodeError:
        return {"lark_grammar": compiled}
    return dict(data["grammars"][0])


def check_grammar(value) -> Grammar | None:
    """A ``grammar`` setting: None, a :class:`Grammar`, or a JSON schema (a dict) for
    ``Grammar.json_schema``."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, dict):
        return Grammar.json_schema(value)
    raise TypeError(f"grammar must be a Grammar or a JSON schema (a dict), got {type(value).__name__}")


# ----------------------------------------------------------------------------------------------------------
# The vocabulary as llguidance reads it
# ----------------------------------------------------------------------------------------------------------


#: virtual tokens after the model's vocabulary, one per byte: llguidance tokenizes the grammar's forced text with
#: the vocabulary and needs every byte string to have a tokenization; the model never samples these ids (the
#: mask is cut to the model's vocabulary)
BYTE_TOKENS = 256


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: each token's bytes (the model's ``num_tokens``, then the
    :data:`BYTE_TOKENS` virtual bytes), the special tokens, the end of text, and a tokenize function (greedy
    longest match over the bytes, one virtual byte where no token fits)."""

    def __init__(self, tokenizer, num_tokens: int):
        size = getattr(tokenizer, "vocab_size", num_tokens)
        specials = set(getattr(tokenizer, "special_ids", ()) or ())
        eos = [int(i) for i in getattr(tokenizer, "end_of_text_ids", ()) or ()]
        if not eos and getattr(tokenizer, "eos_id", None) is not None:
            eos = [int(tokenizer.eos_id)]
        sep = getattr(tokenizer, "separator", "").encode("utf-8")
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(num_tokens):
            if i >= size or i in specials:
                self.tokens.append(_SPECIAL + (_name(tokenizer, i) if i < size else f"<unused {i}>".encode()))
                self.special_token_ids.append(i)
            else:
                self.tokens.append(sep + _bytes(tokenizer, i))
        self.tokens += [bytes([b]) for b in range(BYTE_TOKENS)]
        self.eos_token_id = eos[0] if eos else None
        self.end_ids = eos
        self.bos_token_id = None
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if i not in specials and b and b not in self._by_bytes:
                self._by_bytes[b] = i
        self._longest = max(len(b) for b in self._by_bytes)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._by_bytes.get(data[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
        return out


def _bytes(tokenizer, i: int) -> bytes:
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(i)
    return tokenizer.decode([i]).encode("utf-8")


def _name(tokenizer, i: int) -> bytes:
    names = getattr(tokenizer, "id_to_token", None)
    return str(names[i] if names is not None and i in names else f"<special {i}>").encode("utf-8")


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_vocabulary(tokenizer, num_tokens: int):
    """(the llguidance tokenizer of ``tokenizer``'s vocabulary padded to ``num_tokens`` ids, the end-of-text
    ids), built once per tokenizer and size (a few ms for 8k tokens)."""
    try:
        cache = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: built each time
        cache = {}
    if num_tokens not in cache:
        llg = _llguidance()
        vocab = _Vocabulary(tokenizer, num_tokens)
        lltok = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=num_tokens + BYTE_TOKENS,
                                eos_token=vocab.end_ids or None)
        cache[num_tokens] = (lltok, tuple(vocab.end_ids))
    return cache[num_tokens]


# ----------------------------------------------------------------------------------------------------------
# A grammar bound to a vocabulary, and one row's state
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BoundGrammar:
    """A :class:`Grammar` compiled for one tokenizer's vocabulary of ``num_tokens`` ids."""

    grammar: Grammar
    lltokenizer: object
    text: str
    num_tokens: int
    end_ids: tuple[int, ...]
    lookahead: bool = False

    def state(self) -> "GrammarState":
        """A fresh matcher for one row (at the start of its text)."""
        return GrammarState(self)


def bind_grammar(grammar: Grammar, tokenizer, num_tokens: int) -> BoundGrammar:
    """``grammar`` for the vocabulary of ``tokenizer`` (``num_tokens`` ids).

    Raises: ``ValueError`` without a tokenizer, when the grammar does not compile for this vocabulary, or when no
    token of the vocabulary can start it (a JSON object for a vocabulary without ``{``)."""
    if tokenizer is None:
        raise ValueError("a grammar needs the tokenizer (pass tokenizer=...): its tokens' text is what the grammar "
                         "constrains")
    lltok, end_ids = token_vocabulary(tokenizer, num_tokens)
    text = grammar.compiled(getattr(tokenizer, "separator", ""))
    error = _llguidance().LLMatcher.validate_grammar(text, lltok)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled for this vocabulary: "
                         f"{error.strip()}")
    # a vocabulary that cannot spell every text (words: each token carries a space) checks each allowed token
    # one step ahead, so that a token after which nothing of the vocabulary fits is not offered
    bound = BoundGrammar(grammar, lltok, text, num_tokens, end_ids, lookahead=bool(getattr(tokenizer, "separator", "")))
    try:  # a grammar whose first step no token of the vocabulary can take is refused now, not mid-generation
        bound.state().allowed(num_tokens)
    except ValueError:
        raise ValueError(f"the {grammar.kind.replace('_', ' ')} cannot be written with this vocabulary: none of "
                         f"its {num_tokens} tokens can start it") from None
    return bound


class GrammarState:
    """One row's matcher: :meth:`allowed` (the mask of the next token), :meth:`advance`, :attr:`complete`."""

    def __init__(self, bound: BoundGrammar):
        self.bound = bound
        self.matcher = _llguidance().LLMatcher(bound.lltokenizer, bound.text, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self._bits = torch.arange(8, dtype=torch.uint8)
        self.taken: list[int] = []

    def _mask(self, matcher, num_tokens: int) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        return ((raw.unsqueeze(-1) >> self._bits) & 1).view(-1)[:num_tokens].bool()

    def allowed(self, num_tokens: int, device=None) -> torch.Tensor:
        """(num_tokens,) bool: the tokens the grammar allows next (the end-of-text ids once the text may end).

        Raises: ``ValueError`` when the grammar allows none of the model's tokens (it needs text this vocabulary
        cannot write, e.g. a character the character vocabulary lacks)."""
        mask = self._mask(self.matcher, num_tokens)
        if self.bound.lookahead:
            for t in mask.nonzero().flatten().tolist():
                if t in self.bound.end_ids:
                    continue
                ahead = self.matcher.deep_copy()
                ahead.consume_token(t)
                if not (ahead.is_stopped() or bool(self._mask(ahead, num_tokens).any())):
                    mask[t] = False
        if not bool(mask.any()):
            raise ValueError("the grammar allows none of this model's tokens here: it needs text the vocabulary "
                             f"cannot write (after {self.text_so_far()!r})")
        return mask if device is None else mask.to(device)

    def text_so_far(self) -> str:
        """The text the matcher has taken (for messages)."""
        return self.bound.lltokenizer.decode_str(self.taken)

    def advance(self, token: int) -> None:
        """The sampled token. Raises ``RuntimeError`` for a token the grammar did not allow (a caller that
        sampled without the mask)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"token {int(token)} does not follow the grammar after {self.text_so_far()!r}")
        self.taken.append(int(token))

    @property
    def complete(self) -> bool:
        """The text is complete and nothing more can follow (the row ends here)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete (more may still follow, e.g. digits of a number)."""
        return self.matcher.is_accepting()
