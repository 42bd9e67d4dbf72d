"""Chat templates as the ecosystem writes them: a Hugging Face ``chat_template`` (Jinja, from
``tokenizer_config.json`` or ``chat_template.jinja``) rendered as ``transformers`` renders it, behind the
interface of :class:`~decoderlab.chat.ChatTemplate` -- ``render`` to token ids and a loss mask, the generation
prompt, the end-of-turn id -- so that chat, generation, the server, fine-tuning, RL and the report card take
either.

The environment is ``transformers``' (``transformers.utils.chat_template_utils``, written here again):
jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and ``{% generation %}`` blocks; the globals ``raise_exception``, ``strftime_now``, a ``dict`` without
its class attributes and a ``namespace`` that refuses underscore names; ``tojson`` as ``json.dumps`` (no HTML
escaping, ``ensure_ascii=False``, with ``indent``, ``separators`` and ``sort_keys``). Its variables: ``messages``
(keys whose value is None dropped; a reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` under
all three names), ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) and any further variable given (``enable_thinking=False``).

Token ids: the rendered text encoded as ``apply_chat_template`` encodes it -- every added token of the tokenizer
in the text is that token (a special token typed in a message is the token too, as in ``transformers`` and vLLM
by default), no start-of-text token added. The loss mask: True on the tokens of the template's
``{% generation %}`` blocks where it has them (each token overlapping a block, as
``return_assistant_tokens_mask``); else on the text each assistant turn adds -- from the end of the conversation
before it, rendered with the generation prompt, up to and including the first end-of-turn token.
"""

from __future__ import annotations

import json
import re
import weakref
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..config.defaults import DEFAULT_TEMPERATURE
from ..tokenizers import Tokenizer
from .hermes import HERMES, writes_hermes_calls

#: the named special tokens ``transformers`` passes to a template (``PreTrainedTokenizerBase.special_tokens_map``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: control-token spellings of the field: ``<|im_start|>`` (ChatML, Llama 3, Phi, decoderlab) and DeepSeek's
#: full-width ``<｜User｜>``
_TOKEN_LIKE = re.compile(r"<\|[^<>|\s]{1,64}\|>|<｜[^<>｜\s]{1,64}｜>")

#: what ``continue_final_message`` appends to the last message to find where it ends (transformers' tag)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

#: the reasoning of a message under each name templates read it by (transformers' ``_REASONING_FIELDS``)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: the probe conversation that finds the end-of-turn token
_PROBE_USER, _PROBE_REPLY = "decoderlab probe question", "decoderlab probe reply"

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")

# (characters rendered so far, [(start, end) of each generation block]) while a render tracks blocks
_TRACKING: ContextVar[list | None] = ContextVar("decoderlab_generation_blocks", default=None)


class GenerationBlocks(Extension):
    """``{% generation %} ... {% endgeneration %}``: the text the assistant writes. Renders its body unchanged;
    while :meth:`JinjaChatTemplate._run` tracks, records the body's character span in the rendered text
    (transformers' ``AssistantTracker``: the span starts after the text yielded so far)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller):
        text = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            tracking[1].append((tracking[0], tracking[0] + len(text)))
        return text


@lru_cache(maxsize=1)
def _environment():
    """The sandbox every template renders in (see the module's docstring); built once."""

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # dict() and dict.fromkeys() without the class's attributes
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(Namespace):  # no dunder or private attributes: no way to CPython's internals
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                                    f"but got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env  # jinja2 >= 3.1.6 (pyproject.toml): older versions have known sandbox escapes


@lru_cache(maxsize=64)
def _compiled(source: str):
    return _environment().from_string(source)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _plain(value: Any) -> Any:
    """A copy of ``value`` in JSON's types (what a template may see: transformers' ``_plain_template_data``):
    mappings, lists, tuples, strings, numbers, booleans and None; anything else as ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):
        if isinstance(value, kind):  # subclasses (enums, numpy scalars) back to the base type
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "item", None)) and getattr(value, "shape", None) == ():  # a numpy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _messages(messages: Sequence[Mapping]) -> list[dict]:
    """The messages as a template sees them: plain copies, keys whose value is None dropped (templates handle a
    missing key, not None), the reasoning under each of its names."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be a list of JSON-schema function definitions (dicts), as OpenAI's "
                         "[{\"type\": \"function\", \"function\": {...}}]")
    return _plain(list(tools))


def _documents(documents) -> list[dict] | None:
    if documents is None:
        return None
    if isinstance(documents, (str, bytes, Mapping)) or not all(isinstance(d, Mapping) for d in documents):
        raise ValueError("documents must be a list of dicts (with 'title' and 'text')")
    return _plain(list(documents))


class JinjaChatTemplate:
    """A Jinja chat template, rendered as ``transformers`` renders it (see the module's docstring).

    Args:
        source: the template's Jinja text, or several by name (``{"default": ..., "tool_use": ...}``, as
            ``tokenizer_config.json`` may list them: the ``tool_use`` one renders a conversation offered tools,
            the ``default`` one every other).
        name: what messages and ``meta.json`` call it.
        tokens: the tokenizer's named special tokens (``{"bos_token": "<|begin_of_text|>", ...}``, keys of
            ``SPECIAL_TOKEN_NAMES``), the variables templates write them by.

    Raises:
        ValueError: the text is not valid Jinja (naming the line), no ``default`` among several, an unknown
            token name.
    """

    has_tools = False  # decoderlab's tool-call tokens (its <|tool_call|>); see tool_call_format for calls as text
    default_temperature = DEFAULT_TEMPERATURE

    def __init__(self, source: str | Mapping[str, str], *, name: str = "jinja",
                 tokens: Mapping[str, str] | None = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a chat template's name must be a non-empty string, got {name!r}")
        self.name = name
        sources = {"default": source} if isinstance(source, str) else dict(source or {})
        if "default" not in sources or not all(isinstance(v, str) for v in sources.values()):
            raise ValueError(f"the {name!r} chat template must be Jinja text, or Jinja texts by name with a "
                             f"'default' one; got {type(source).__name__} with names {sorted(sources)}")
        self.sources = sources
        tokens = dict(tokens or {})
        unknown = sorted(set(tokens) - set(SPECIAL_TOKEN_NAMES))
        if unknown or not all(isinstance(v, str) for v in tokens.values()):
            raise ValueError(f"the {name!r} chat template's tokens must map names of {', '.join(SPECIAL_TOKEN_NAMES)} "
                             f"to strings; got {tokens!r}")
        self.tokens = tokens
        for key, text in sources.items():
            self._compile(text, key)
        self._ends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- identity and storage ---------------------------------------------------------------------------
    @property
    def source(self) -> str:
        """The ``default`` template's Jinja text."""
        return self.sources["default"]

    def __eq__(self, other) -> bool:
        return (isinstance(other, JinjaChatTemplate) and (self.name, self.sources, self.tokens)
                == (other.name, other.sources, other.tokens))

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.sources.items())), tuple(sorted(self.tokens.items()))))

    def __repr__(self) -> str:
        return f"JinjaChatTemplate(name={self.name!r}, {len(self.source)} characters)"

    def to_dict(self) -> dict:
        """What a checkpoint's ``meta.json`` stores: ``{"name", "jinja", "tokens"}`` (``jinja`` the text, or
        the texts by name)."""
        jinja = self.source if list(self.sources) == ["default"] else dict(self.sources)
        return {"name": self.name, "jinja": jinja, **({"tokens": dict(self.tokens)} if self.tokens else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "JinjaChatTemplate":
        """The template ``to_dict`` stored. Raises ``ValueError`` naming unknown or missing fields."""
        unknown = sorted(set(d) - {"name", "jinja", "tokens"})
        if unknown or "jinja" not in d:
            raise ValueError(f"a stored Jinja chat template has the fields name, jinja and tokens; got "
                             f"{sorted(d)}")
        return cls(d["jinja"], name=d.get("name") or "jinja", tokens=d.get("tokens"))

    # -- what the template writes ------------------------------------------------------------------------
    def _compile(self, text: str, key: str = "default"):
        try:
            return _compiled(text)
        except TemplateSyntaxError as e:
            which = "" if key == "default" else f" ({key!r})"
            raise ValueError(f"the {self.name!r} chat template{which} is not valid Jinja: {_one_line(e.message)} "
                             f"(line {e.lineno})") from None

    @property
    def tool_call_format(self) -> str | None:
        """How the template writes tool calls, for the tool loop and the server to read them back: ``"hermes"``
        when it writes each call as JSON between ``<tool_call>`` and ``</tool_call>`` (Qwen2.5, Qwen3, Hermes,
        decoderlab's ``chatml-tools``: :mod:`decoderlab.chat.hermes`, found by rendering a call), else None
        (it writes none, or in a format decoderlab does not read: Llama 3.2's bare JSON, Mistral's
        ``[TOOL_CALLS]``)."""
        if "_tool_call_format" not in self.__dict__:
            self._tool_call_format = HERMES if writes_hermes_calls(self.render_text) else None
        return self._tool_call_format

    @property
    def has_generation_blocks(self) -> bool:
        """The template marks the assistant's text with ``{% generation %}`` blocks (the loss mask follows them)."""
        return any(_GENERATION_BLOCK.search(s) for s in self.sources.values())

    @property
    def special_tokens(self) -> list[str]:
        """The control tokens the template writes, in order of first appearance: the token-like strings of its
        text (``<|im_start|>``, ``<｜User｜>``) and the named tokens it reads (``bos_token`` ...). Fine-tuning
        adds them to a tokenizer that lacks them (:func:`~decoderlab.chat.add_chat_tokens`)."""
        found = {}
        for text in self.sources.values():
            for m in _TOKEN_LIKE.finditer(text):
                found.setdefault(m.group(), m.start())
            for key, token in self.tokens.items():
                if re.search(rf"\b{key}\b", text):
                    found.setdefault(token, -1)
        return sorted(found, key=found.get)

    @property
    def text_characters(self) -> str:
        """The characters of the text the template writes itself (its literals, less its control tokens) and of
        the role names it may write from the messages: a character vocabulary built for the template holds
        them."""
        text = "".join(_literals(s) for s in self.sources.values()) + "system user assistant tool"
        for token in self.special_tokens:
            text = text.replace(token, "")
        return "".join(sorted(set(text)))

    def render_text(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False, tools=None,
                    documents=None, continue_final_message: bool | str = False, **variables) -> str:
        """The rendered text: ``apply_chat_template(..., tokenize=False)``.

        Args:
            messages: ``[{"role", "content", ...}]`` (any keys the template reads: ``tool_calls``,
                ``reasoning_content``, ...).
            add_generation_prompt: end with the opening of an assistant turn.
            tools: function definitions (JSON schemas) the template may offer the model.
            documents: ``[{"title", "text"}]`` for templates that render retrieved documents.
            continue_final_message: end inside the last message (True: its ``content``; a key: that field),
                for the model to continue it; not with ``add_generation_prompt``.
            **variables: further template variables (``enable_thinking=False``, ``date_string=...``).

        Raises:
            ValueError: the template raised (its message, naming the template), bad arguments.
        """
        return self._render(messages, add_generation_prompt, tools, documents, continue_final_message,
                            variables)[0]

    def _render(self, messages, add_generation_prompt, tools, documents, continue_final_message, variables,
                track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        messages, tools, documents = _messages(messages), _tools(tools), _documents(documents)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot be combined: the first "
                             "continues the last message, the second opens a new assistant turn")
        source = self.sources.get("tool_use") if tools is not None else None
        source = source or self.source
        field = None
        if continue_final_message:
            field, final = _tag_final_message(messages, continue_final_message, source)
        context = {**self.tokens, **_plain(variables), "messages": messages, "tools": tools,
                   "documents": documents, "add_generation_prompt": bool(add_generation_prompt)}
        text, spans = self._run(self._compile(source), context, track)
        if field is not None:
            text = _cut_at_tag(text, final)
        return text, spans

    def _run(self, compiled, context: dict, track: bool) -> tuple[str, list[tuple[int, int]]]:
        """Render, recording the ``{% generation %}`` spans with ``track``; the template's own errors as one
        ``ValueError`` naming it."""
        tracking = [0, []]
        token = _TRACKING.set(tracking if track else None)
        try:
            chunks = []
            for chunk in compiled.generate(**context):
                chunks.append(chunk)
                tracking[0] += len(chunk)
            return "".join(chunks), tracking[1]
        except TemplateError as e:  # raise_exception(...), undefined names, the sandbox's refusals
            raise ValueError(f"the {self.name!r} chat template raised: {_one_line(e.message or e)}") from None
        except Exception as e:  # a template is code: its TypeError ('<|x|>' + none) is its fault, not ours
            raise ValueError(f"the {self.name!r} chat template failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _TRACKING.reset(token)

    # -- tokens -----------------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping], tokenizer: Tokenizer, *, add_generation_prompt: bool = False,
               tools=None, documents=None, continue_final_message: bool | str = False,
               **variables) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and a per-id loss mask, as ``ChatTemplate.render``.

        Ids: the rendered text (:meth:`render_text`, the same arguments) encoded as ``apply_chat_template``
        encodes it. Mask: True on the assistant's text -- the ``{% generation %}`` blocks where the template has
        them, else what each assistant turn adds up to and including its end-of-turn token; all False with
        ``continue_final_message`` (a prompt).

        Raises:
            ValueError: the template raised (its message); the text holds a control token the tokenizer lacks
                (naming it); the conversation's prefixes do not render as the start of the whole (no
                ``{% generation %}`` blocks to find the assistant's text by instead).
        """
        args = (add_generation_prompt, tools, documents, continue_final_message, variables)
        text, spans = self._render(messages, *args, track=self.has_generation_blocks)
        self._check_tokens(text, tokenizer)
        ids, offsets = encode_with_offsets(tokenizer, text)
        if continue_final_message:
            return ids, [False] * len(ids)
        if not self.has_generation_blocks:
            spans = self._turn_spans(messages, text, tokenizer, *args)
        return ids, _overlap_mask(offsets, spans)

    def _turn_spans(self, messages, text: str, tokenizer, add_generation_prompt, tools, documents, _continue,
                    variables) -> list[tuple[int, int]]:
        """The character span of each assistant turn in ``text``: from the end of the conversation before it,
        rendered with the generation prompt, to the end of the first end-of-turn token after that."""
        end = self.end_of_turn(tokenizer)
        spans = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or m.get("role") != "assistant":
                continue
            head = self._render(messages[:i], True, tools, documents, False, variables)[0]
            stop = text.find(end, len(head))
            if not text.startswith(head) or stop < 0:
                raise ValueError(
                    f"cannot find message {i}'s assistant text in the {self.name!r} chat template's rendering: the "
                    f"conversation before it, rendered with the generation prompt, is not the start of the whole "
                    f"conversation followed by a {end!r}; mark the assistant's text with {{% generation %}} blocks")
            spans.append((len(head), stop + len(end)))
        return spans

    def end_of_turn(self, tokenizer: Tokenizer) -> str:
        """The control token that ends an assistant turn (``<|im_end|>``, ``<|eot_id|>``): the first control
        token of ``tokenizer`` (or of the template) after the reply, in a probe conversation of one user
        message and one reply.

        Raises:
            ValueError: the template raised on the probe; no control token follows the reply; the tokenizer
                lacks a control token the template writes (naming it).
        """
        if tokenizer in self._ends:
            return self._ends[tokenizer]
        user = {"role": "user", "content": _PROBE_USER}
        head = self.render_text([user], add_generation_prompt=True)
        whole = self.render_text([user, {"role": "assistant", "content": _PROBE_REPLY}])
        self._check_tokens(head + whole, tokenizer)
        reply = whole.find(_PROBE_REPLY, len(head))
        if not whole.startswith(head) or reply < 0:
            raise ValueError(f"the {self.name!r} chat template does not render a reply after the generation prompt "
                             f"(a user message then the generation prompt is not the start of that user message "
                             f"and a reply), so decoderlab cannot find where its assistant turns end")
        candidates = {tokenizer.id_to_token[i] for i in tokenizer.special_ids} | set(self.special_tokens)
        after = whole[reply + len(_PROBE_REPLY):]
        found = sorted(((after.find(t), -len(t), t) for t in candidates if t and t in after))
        if not found:
            raise ValueError(f"the {self.name!r} chat template ends an assistant turn with no control token of the "
                             f"tokenizer (after the reply it writes {after!r}); a chat model needs an end-of-turn "
                             f"token to stop at")
        self._ends[tokenizer] = found[0][2]
        return found[0][2]

    def end_of_turn_id(self, tokenizer: Tokenizer) -> int:
        """The id of :meth:`end_of_turn` in ``tokenizer``."""
        return tokenizer.token_to_id[self.end_of_turn(tokenizer)]

    def tool_call_id(self, tokenizer: Tokenizer) -> int:
        """Raises ``ValueError``: a Jinja template writes its calls as text, not after a tool-call token
        (:attr:`tool_call_format`)."""
        raise ValueError(f"the {self.name!r} chat template has no tool-call token (decoderlab's \"tools\" template "
                         f"has one); it writes tool calls as text ({self.tool_call_format or 'none decoderlab reads'})")

    def _check_tokens(self, text: str, tokenizer: Tokenizer) -> None:
        missing = [t for t in self.special_tokens if t in text and t not in tokenizer.token_to_id]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(map(repr, missing))} token"
                             f"{'s' if len(missing) > 1 else ''}, which the {self.name!r} chat template writes: "
                             f"use this template with its model's tokenizer, or add the tokens "
                             f"(decoderlab.chat.add_chat_tokens)")


def _literals(source: str) -> str:
    """The text a template writes itself: its raw text and string constants."""
    tree = _environment().parse(source)
    parts = [n.data for n in tree.find_all(nodes.TemplateData)]
    parts += [n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)]
    return "".join(parts)


def _tag_final_message(messages: list[dict], continue_final_message: bool | str, source: str):
    """Append transformers' tag to the field of the last message the model continues: ``(field, its text)``."""
    if not messages:
        raise ValueError("continue_final_message needs a conversation to continue")
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [f for f in _REASONING_FIELDS if messages[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
    if not any(f in source for f in fields):
        raise ValueError(f"continue_final_message: the template does not read the field {field!r}")
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message: the final message has no text block to continue")
        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
    else:
        for f in fields:
            messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return field, final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendering up to where the continued message ends (transformers' rule, trailing space kept when the
    template keeps it)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat (the "
                         "template changes or drops it)")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for each token whose characters overlap a span (spans and offsets in order): transformers' rule for
    ``return_assistant_tokens_mask``."""
    mask, k = [False] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


_PARSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parser(tokenizer):
    """A copy of a BPE tokenizer's ``tokenizers.Tokenizer`` that reads its added tokens in the text (decoderlab's
    own keeps typed special tokens as text)."""
    if tokenizer not in _PARSERS:
        from tokenizers import Tokenizer as HFTokenizer  # imported where used, as decoderlab.tokenizers does

        hf = HFTokenizer.from_str(tokenizer.hf_tokenizer.to_str())
        hf.encode_special_tokens = False
        _PARSERS[tokenizer] = hf
    return _PARSERS[tokenizer]


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``(ids, character offsets)`` of a rendered chat: every special token in the text is that token, as
    ``apply_chat_template`` encodes (a BPE tokenizer: ``tokenizers``' own encoding without added start or end
    tokens; a character or word tokenizer: ``encode(text, allow_special=True)``, one id per character or
    whitespace-separated word).

    Raises:
        ValueError: text the tokenizer cannot encode; a tokenizer of another kind.
    """
    if getattr(tokenizer, "hf_tokenizer", None) is not None:
        enc = _parser(tokenizer).encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    ids = list(tokenizer.encode(text, allow_special=True))
    if tokenizer.separator == " ":  # a word vocabulary: one id per whitespace-separated word
        offsets = [m.span() for m in re.finditer(r"\S+", text)]
    elif tokenizer.separator == "":  # one id per character or special token
        specials = sorted((t for t in tokenizer.token_to_id if tokenizer.token_to_id[t] in tokenizer.special_ids),
                          key=len, reverse=True)
        pattern = re.compile("|".join([*map(re.escape, specials), "."]), re.DOTALL)
        offsets = [m.span() for m in pattern.finditer(text)]
    else:
        offsets = []
    if len(offsets) != len(ids):
        raise ValueError(f"a Jinja chat template needs a BPE, character or word tokenizer; this {tokenizer.kind} "
                         f"tokenizer does not say where its tokens are in the text")
    return ids, offsets
