"""Chat templates: how a conversation becomes token ids and a loss mask (:meth:`ChatTemplate.render`, the one
renderer), the built-in templates, the template a checkpoint stores, and the template's special tokens in a
model and tokenizer.

Templates (``TEMPLATES``):

* ``"decoderlab"`` (the default): ``<|system|> S <|end|> <|user|> U <|end|> <|assistant|> A <|end|> ...`` --
  four special tokens, atomic in every tokenizer (typed text like "<|user|>" stays text).
* ``"tools"``: ``"decoderlab"`` with two more tokens for tool calls: an assistant turn that calls a tool is
  ``<|assistant|> A <|tool_call|> NAME {ARGUMENTS} <|end|>`` (one ``<|tool_call|>`` per call, the arguments as
  JSON), a tool's result ``<|tool|> RESULT <|end|>``, and the tools offered ``<|tool|> [FUNCTIONS] <|end|>``
  after the system message (their names, descriptions and parameter schemas as a JSON list).
* ``"lesson"``: the StatQuest lesson's pair scheme ``prompt <EOS> response <EOS>`` (the ``<EOS>`` after the
  prompt opens the assistant turn, the one after the response ends it); a system message is ``S <EOS>``.
  ``train_pairs`` stores it, so the lesson's model is a chat checkpoint like any other.

The loss mask is True on the assistant's content tokens and the end-of-turn token after them: the tokens a
chat model must learn to produce. Everything else (system, user, the openers) is context only.

A Hugging Face model's own template (Jinja) is a :class:`~decoderlab.chat.jinja.JinjaChatTemplate`, with the
same interface (``render``, ``end_of_turn_id``, ``name``, ``to_dict``); ``get_template`` and
``template_from_meta`` return either.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ..checkpoint import CHAT_TEMPLATE_KEY
from ..config.defaults import DEFAULT_TEMPERATURE
from ..config.names import DEFAULT_TEMPLATE
from ..lesson import LESSON_TEMPLATE
from ..tokenizers import EOS, Tokenizer
from .gemma import GEMMA_CHAT, GEMMA_NAME, GEMMA_TOKENS
from .hermes import CHATML_TOOLS, CHATML_TOOLS_NAME
from .jinja import JinjaChatTemplate
from .messages import check_messages


#: the characters of a tool call's and a tool block's JSON (:attr:`ChatTemplate.text_characters`)
TOOL_CALL_CHARACTERS = ' {}[]":,.-+0123456789eE_truefalsn'
#: the tool-call format of decoderlab's "tools" template: ``<|tool_call|> NAME {ARGUMENTS}`` after a token
TOOL_TOKENS = "tokens"


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes tokens. Each field is a special-token string (None: no token).

    Layout, message by message (``+`` joins token lists; content is ``tokenizer.encode(content,
    allow_special=False)``):

    * system: ``[system] + content + [end]``
    * user: ``[user] + content + ([end] if end_after_user)``
    * assistant: ``[assistant] + content + [end]`` -- mask True on content and ``end``
    * generation prompt (``add_generation_prompt=True``): ``[assistant]``

    With ``tool_call`` and ``tool`` (the ``"tools"`` template): an assistant message's ``tool_calls`` follow its
    content, each ``[tool_call] + tool_call_text(name, arguments)`` (mask True, as content); a ``tool`` message
    is ``[tool] + content + [end]`` (context); ``tools=`` (function definitions) renders ``[tool] +
    tools_text(tools) + [end]`` after the system message.

    Attributes:
        name: the template's name (a key of ``TEMPLATES`` for the built-in ones).
        user, assistant, end, system: special-token strings (user/system may be None).
        end_after_user: close user turns with ``end`` too.
        tool_call, tool: the tool-call opener and the tool-result opener (None: no tools).
    """

    name: str
    user: str | None
    assistant: str
    end: str
    system: str | None = None
    end_after_user: bool = True
    tool_call: str | None = None
    tool: str | None = None

    @property
    def special_tokens(self) -> list[str]:
        """The distinct special tokens of the template, in a fixed order (system, user, assistant, end, tool_call,
        tool)."""
        return list(dict.fromkeys(t for t in (self.system, self.user, self.assistant, self.end, self.tool_call,
                                              self.tool) if t))

    @property
    def has_tools(self) -> bool:
        """The template can render tool calls and tool results."""
        return bool(self.tool_call and self.tool)

    @property
    def tool_call_format(self) -> str | None:
        """How the template writes tool calls: ``"tokens"`` (after its ``<|tool_call|>`` token) for a template
        with tools, else None; a Jinja template's is ``"hermes"`` or None
        (:attr:`JinjaChatTemplate.tool_call_format`)."""
        return TOOL_TOKENS if self.has_tools else None

    @property
    def text_characters(self) -> str:
        """The characters the template writes itself, beyond its special tokens: a tools template's JSON
        (braces, brackets, quotes, colon, comma, digits, sign, point, true/false/null, the name's underscore and
        the space after it). A character vocabulary built for the template holds them, as it holds its special
        tokens, so that a call can be written whatever the data happened to contain."""
        return TOOL_CALL_CHARACTERS if self.has_tools else ""

    @property
    def default_temperature(self) -> float:
        """The sampling temperature when none is given: 0 (greedy) for the lesson's template, as the lesson
        answers, else ``DEFAULT_TEMPERATURE``."""
        return 0.0 if self.name == LESSON_TEMPLATE["name"] else DEFAULT_TEMPERATURE

    def to_dict(self) -> dict:
        """The fields (what a checkpoint stores); the tool tokens only when set, so a template without tools is
        stored as before they existed."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in ("tool_call", "tool") or v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "ChatTemplate":
        """Raises ``ValueError`` naming unknown or missing fields."""
        if not isinstance(d, dict):
            raise ValueError(f"a chat template must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown chat template field(s) {unknown}; known: {', '.join(sorted(known))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"incomplete chat template {d!r}: {e}") from None

    def _ids(self, tokenizer: Tokenizer) -> dict[str, int | None]:
        out = {}
        for field in ("system", "user", "assistant", "end", "tool_call", "tool"):
            tok = getattr(self, field)
            if tok is None:
                out[field] = None
                continue
            i = tokenizer.token_to_id.get(tok)
            if i is None and tok == EOS:
                i = tokenizer.eos_id
            if i is None:
                raise ValueError(
                    f"the tokenizer has no {tok!r} token, which the {self.name!r} chat template needs; add the "
                    f"template's tokens first (decoderlab.chat.add_chat_tokens or Tokenizer.add_special_tokens)")
            out[field] = i
        return out

    def end_of_turn_id(self, tokenizer: Tokenizer) -> int:
        """The id of the end-of-turn token in ``tokenizer``. Raises ``ValueError`` if it lacks it."""
        return self._ids(tokenizer)["end"]

    def tool_call_id(self, tokenizer: Tokenizer) -> int:
        """The id of the tool-call opener in ``tokenizer``. Raises ``ValueError`` when the template has no tools
        or the tokenizer lacks the token."""
        if not self.has_tools:
            raise ValueError(f"the {self.name!r} chat template has no tool-call tokens (fine-tune with the "
                             f"\"tools\" template for tool calls)")
        return self._ids(tokenizer)["tool_call"]

    def render(self, messages: Sequence[dict], tokenizer: Tokenizer, *, add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and a per-id loss mask (True: assistant content and its end of turn).

        Args:
            messages: ``[{"role", "content"}, ...]`` (checked: roles, order, strings; see
                :func:`~decoderlab.chat.check_messages`).
            tokenizer: a tokenizer holding the template's special tokens (:func:`add_chat_tokens`).
            add_generation_prompt: end with the assistant opener, the point where a model continues
                (the conversation must then end with a user message or a tool result).
            tools: function definitions offered to the model (``[{"name", "description", "parameters"}]`` or
                OpenAI's ``[{"type": "function", "function": {...}}]``); needs a template with tools.

        Returns:
            ``(ids, mask)``: two lists of equal length.

        Raises:
            ValueError: bad messages (naming the message and what is wrong); the tokenizer lacks a special
                token of the template; content the tokenizer cannot encode.
            KeyError: a word tokenizer without ``<unk>`` and a word not in its vocabulary.
        """
        check_messages(messages, final="user" if add_generation_prompt else None)
        sp = self._ids(tokenizer)
        if (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)) and not self.has_tools:
            raise ValueError(f"the {self.name!r} chat template has no tool-call tokens, so it cannot render tools, "
                             f"tool calls or tool results (the \"tools\" template can: fine-tune with "
                             f"--template tools)")
        ids: list[int] = []
        mask: list[bool] = []

        def put(tokens, supervised):
            ids.extend(tokens)
            mask.extend([supervised] * len(tokens))

        for i, m in enumerate(messages):
            if tools and i == (1 if messages[0]["role"] == "system" else 0):
                put([sp["tool"], *encode_text(tokenizer, tools_text(tools)), sp["end"]], False)
            role = m["role"]
            if sp[role] is not None:
                put([sp[role]], False)
            put(encode_text(tokenizer, m["content"] or ""), role == "assistant")
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                put([sp["tool_call"], *encode_text(tokenizer, tool_call_text(fn["name"], fn["arguments"]))], True)
            if role in ("assistant", "system", "tool") or self.end_after_user:
                put([sp["end"]], role == "assistant")
        if add_generation_prompt:
            put([sp["assistant"]], False)
        return ids, mask


TEMPLATES: dict[str, ChatTemplate] = {
    "decoderlab": ChatTemplate("decoderlab", user="<|user|>", assistant="<|assistant|>", end="<|end|>",
                               system="<|system|>", end_after_user=True),
    "lesson": ChatTemplate(**LESSON_TEMPLATE),
    "tools": ChatTemplate("tools", user="<|user|>", assistant="<|assistant|>", end="<|end|>", system="<|system|>",
                          end_after_user=True, tool_call="<|tool_call|>", tool="<|tool|>"),
}


def _function(tool: dict) -> dict:
    """A function definition from OpenAI's ``{"type": "function", "function": {...}}`` or the bare ``{...}``."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def tools_text(tools: Sequence[dict]) -> str:
    """The text the ``"tools"`` template renders for the tools offered: a JSON list of ``{"name",
    "description", "parameters"}`` (the fields given), in the order given."""
    keep = ("name", "description", "parameters")
    return json.dumps([{k: _function(t)[k] for k in keep if k in _function(t)} for t in tools], ensure_ascii=False)


def tool_call_text(name: str, arguments: str | dict) -> str:
    """The text of one tool call after the ``<|tool_call|>`` token: ``NAME {ARGUMENTS}``, the arguments as JSON
    (a JSON text is normalised to ``json.dumps``' spacing, the spacing the model is constrained to write;
    empty text is ``{}``, no arguments, as vLLM renders it; other text that is not JSON is kept as it is)."""
    if isinstance(arguments, str) and not arguments.strip():
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"{name} {arguments}"
    return f"{name} {json.dumps(arguments, ensure_ascii=False)}"


def parse_tool_call(text: str) -> tuple[str, str]:
    """``(name, arguments JSON text)`` of a tool call's text (``NAME {ARGUMENTS}``, :func:`tool_call_text`)."""
    name, _, arguments = text.strip().partition(" ")
    return name, arguments.strip() or "{}"


#: decoderlab's templates written in Hugging Face's format (Jinja), by name: ``"chatml-tools"``, SmolLM2's ChatML
#: with tool calls (:data:`decoderlab.chat.hermes.CHATML_TOOLS`); ``"gemma"``, Gemma's turns
#: (:data:`decoderlab.chat.gemma.GEMMA_CHAT`)
JINJA_TEMPLATES: dict[str, str] = {CHATML_TOOLS_NAME: CHATML_TOOLS, GEMMA_NAME: GEMMA_CHAT}
#: the named tokens a built-in Jinja template writes (``bos_token`` ...), by name
JINJA_TOKENS: dict[str, dict] = {GEMMA_NAME: GEMMA_TOKENS}


def get_template(template: str | os.PathLike | ChatTemplate | JinjaChatTemplate | None = None
                 ) -> ChatTemplate | JinjaChatTemplate:
    """A template by name (None: the default, ``"decoderlab"``; a key of ``TEMPLATES`` or of
    ``JINJA_TEMPLATES``, such as ``"chatml-tools"``, a :class:`JinjaChatTemplate` of that name), a Jinja
    template from a file (``*.jinja``, named ``jinja:<file name>``), or the template itself.

    Raises:
        ValueError: an unknown name, listing the known ones; a file that is not valid Jinja.
    """
    if template is None:
        return TEMPLATES[DEFAULT_TEMPLATE]
    if isinstance(template, (ChatTemplate, JinjaChatTemplate)):
        return template
    if isinstance(template, str) and template in JINJA_TEMPLATES:
        return JinjaChatTemplate(JINJA_TEMPLATES[template], name=template, tokens=JINJA_TOKENS.get(template))
    if isinstance(template, (str, os.PathLike)) and str(template) not in TEMPLATES:
        path = Path(template)
        if path.is_file() and path.suffix == ".jinja":
            return JinjaChatTemplate(path.read_text(encoding="utf-8"), name=f"jinja:{path.name}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; known templates: "
                         f"{', '.join([*TEMPLATES, *JINJA_TEMPLATES])} (or a *.jinja file)")
    return TEMPLATES[template]


#: the conversations a template must render as ``chatml-tools`` renders them (with and without the generation
#: prompt) for ``chatml-tools`` to stand in for it when tools are asked for: no system message (the template's
#: default one, if any), a system message, several turns, text over lines
_STAND_IN_PROBES = (
    ({"role": "user", "content": "What is 12 + 7?"},),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello.\nHow can I help?"}, {"role": "user", "content": "2 + 2 = ?"}),
)


@lru_cache(maxsize=16)
def _is_chatml_tools_without_tools(template: JinjaChatTemplate) -> bool:
    chatml = get_template(CHATML_TOOLS_NAME)
    try:
        return all(template.render_text(list(c), add_generation_prompt=p)
                   == chatml.render_text(list(c), add_generation_prompt=p)
                   for c in _STAND_IN_PROBES for p in (False, True))
    except ValueError:  # a template that raises on a probe is no ChatML that chatml-tools extends
        return False


def tools_template(template: ChatTemplate | JinjaChatTemplate | None):
    """The template a conversation with tools is rendered with, for a model whose chat template is ``template``:
    ``chatml-tools`` when ``template`` writes no tool calls and is SmolLM2-Instruct's ChatML -- which
    ``chatml-tools`` extends: a conversation without tools renders to the same text (checked by rendering
    ``_STAND_IN_PROBES``), so the switch changes no prompt without tools --, else ``template`` itself (one that
    writes tool calls; or one that writes none, which :func:`~decoderlab.chat.check_tool_template` then refuses
    by name). ``decoderlab chat --tools``, the tool loop (``Model.chat(tools=...)``) and the server's ``tools``
    take it, as llama.cpp's server gives a template without tool calls a generic tool-call format."""
    if (isinstance(template, JinjaChatTemplate) and template.tool_call_format is None
            and template.name != CHATML_TOOLS_NAME and _is_chatml_tools_without_tools(template)):
        return get_template(CHATML_TOOLS_NAME)
    return template


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer,
                template: str | ChatTemplate | JinjaChatTemplate | None = None, *,
                add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """``get_template(template).render(messages, tokenizer, add_generation_prompt=...)``: ``(ids, mask)``."""
    return get_template(template).render(messages, tokenizer, add_generation_prompt=add_generation_prompt)


def template_from_meta(meta: dict) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template stored in a checkpoint's ``meta.json`` (key ``"chat_template"``: a built-in template's
    fields, or a Jinja template's ``{"name", "jinja", "tokens"}``); None for a base model. A checkpoint of the
    lesson's pair training written before pair models stored their template (``"task": "pairs"``, no template)
    reads as the ``lesson`` template, the scheme it was trained with.

    Raises:
        ValueError: a malformed stored template.
    """
    meta = meta or {}
    d = meta.get(CHAT_TEMPLATE_KEY)
    if d is None and meta.get("task") == "pairs":
        d = LESSON_TEMPLATE
    if isinstance(d, dict) and "jinja" in d:
        return JinjaChatTemplate.from_dict(d)
    return None if d is None else ChatTemplate.from_dict(d)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as plain text: special-token look-alikes (``"<|user|>"``, ``"<EOS>"``) stay text."""
    return list(tokenizer.encode(text, allow_special=False))


def add_chat_tokens(model, tokenizer: Tokenizer, template: str | ChatTemplate | JinjaChatTemplate | None = None,
                    *, inplace: bool = False):
    """Give ``(model, tokenizer)`` the special tokens of ``template``: ``(model, tokenizer, added)`` with the
    tokenizer extended (:meth:`Tokenizer.add_special_tokens`) and the model resized
    (:meth:`DecoderOnlyTransformer.resize_token_embeddings`: new rows at the mean of the old ones, tying
    kept) -- a copy when it grows, so the model given is left as it was (``inplace``: the model itself, for a
    caller that just loaded it: no second model held for a moment); ``added`` lists the new tokens ([] when all
    were there). ``model`` may be None (only the tokenizer is extended)."""
    template = get_template(template)
    new_tok = tokenizer.add_special_tokens(template.special_tokens)
    added = [t for t in new_tok.added_special_tokens if t not in tokenizer.token_to_id]
    if model is not None and new_tok.vocab_size != model.config.num_tokens:
        model = model if inplace else copy.deepcopy(model)
        model.resize_token_embeddings(new_tok.vocab_size)
    return model, new_tok, added
