"""Conversations: JSONL data, chat templates, the one renderer, special tokens, and chat replies.

One function turns a conversation into token ids plus a loss mask -- :meth:`ChatTemplate.render` (also
:func:`render_chat`) -- and it is the only renderer: fine-tuning (:func:`decoderlab.finetuning.finetune`),
``decoderlab chat``, ``decoderlab generate --chat``, ``decoderlab explain --chat``, :func:`chat_reply` /
:func:`stream_chat_reply` (and so the server) all call it, so a model sees at inference exactly the token
layout it was trained on.

Layer: above ``generation`` and ``checkpoint`` (it streams replies and reads checkpoints), below ``finetune``
and the CLI; it never imports Lightning.

A conversation (``messages``) is a list of ``{"role": "system" | "user" | "assistant", "content": str}``: an
optional system message first, then user and assistant turns alternating, starting with the user.

Templates (``TEMPLATES``):

* ``"decoderlab"`` (the default): ``<|system|> S <|end|> <|user|> U <|end|> <|assistant|> A <|end|> ...`` --
  four special tokens, atomic in every tokenizer (typed text like "<|user|>" stays text).
* ``"lesson"``: the StatQuest lesson's pair scheme ``prompt <EOS> response <EOS>`` (the ``<EOS>`` after the
  prompt opens the assistant turn, the one after the response ends it); a system message is ``S <EOS>``.

The loss mask is True on the assistant's content tokens and the end-of-turn token after them: the tokens a
chat model must learn to produce. Everything else (system, user, the openers) is context only.

Data (:func:`load_conversations`): JSONL, one conversation per line, the format detected per file from its
first line -- ``{"messages": [...]}``, ``{"prompt", "completion"}`` (the lesson's pairs), or Alpaca
``{"instruction", "input", "output"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .checkpoint import load_checkpoint, read_meta
from .config.names import DEFAULT_TEMPLATE
from .generation import ChatSession, SamplingParams, TextStreamer, stream
from .tokenizers import EOS, Tokenizer

ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "prompt-completion", "alpaca")
CHAT_TEMPLATE_KEY = "chat_template"


# ---------------------------------------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes tokens. Each field is a special-token string (None: no token).

    Layout, message by message (``+`` joins token lists; content is ``tokenizer.encode(content,
    allow_special=False)``):

    * system: ``[system] + content + [end]``
    * user: ``[user] + content + ([end] if end_after_user)``
    * assistant: ``[assistant] + content + [end]`` -- mask True on content and ``end``
    * generation prompt (``add_generation_prompt=True``): ``[assistant]``

    Attributes:
        name: the template's name (a key of ``TEMPLATES`` for the built-in ones).
        user, assistant, end, system: special-token strings (user/system may be None).
        end_after_user: close user turns with ``end`` too.
    """

    name: str
    user: str | None
    assistant: str
    end: str
    system: str | None = None
    end_after_user: bool = True

    @property
    def special_tokens(self) -> list[str]:
        """The distinct special tokens of the template, in a fixed order (system, user, assistant, end)."""
        return list(dict.fromkeys(t for t in (self.system, self.user, self.assistant, self.end) if t))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        for field in ("system", "user", "assistant", "end"):
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

    def render(self, messages: Sequence[dict], tokenizer: Tokenizer, *,
               add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and a per-id loss mask (True: assistant content and its end of turn).

        Args:
            messages: ``[{"role", "content"}, ...]`` (checked: roles, order, strings; see
                :func:`check_messages`).
            tokenizer: a tokenizer holding the template's special tokens (:func:`add_chat_tokens`).
            add_generation_prompt: end with the assistant opener, the point where a model continues
                (the conversation must then end with a user message).

        Returns:
            ``(ids, mask)``: two lists of equal length.

        Raises:
            ValueError: bad messages (naming the message and what is wrong); the tokenizer lacks a special
                token of the template; content the tokenizer cannot encode.
            KeyError: a word tokenizer without ``<unk>`` and a word not in its vocabulary.
        """
        check_messages(messages, final="user" if add_generation_prompt else None)
        sp = self._ids(tokenizer)
        ids: list[int] = []
        mask: list[bool] = []

        def put(tokens, supervised):
            ids.extend(tokens)
            mask.extend([supervised] * len(tokens))

        for m in messages:
            role = m["role"]
            content = encode_text(tokenizer, m["content"])
            opener = sp[role]
            if opener is not None:
                put([opener], False)
            if role == "assistant":
                put(content, True)
                put([sp["end"]], True)
            else:
                put(content, False)
                if role == "system" or self.end_after_user:
                    put([sp["end"]], False)
        if add_generation_prompt:
            put([sp["assistant"]], False)
        return ids, mask


TEMPLATES: dict[str, ChatTemplate] = {
    "decoderlab": ChatTemplate("decoderlab", user="<|user|>", assistant="<|assistant|>", end="<|end|>",
                               system="<|system|>", end_after_user=True),
    "lesson": ChatTemplate("lesson", user=None, assistant=EOS, end=EOS, system=None, end_after_user=False),
}


def get_template(template: str | ChatTemplate | None = None) -> ChatTemplate:
    """A template by name (None: the default, ``"decoderlab"``), or the template itself.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if template is None:
        return TEMPLATES[DEFAULT_TEMPLATE]
    if isinstance(template, ChatTemplate):
        return template
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; known templates: {', '.join(TEMPLATES)}")
    return TEMPLATES[template]


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer, template: str | ChatTemplate | None = None, *,
                add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """``get_template(template).render(messages, tokenizer, add_generation_prompt=...)``: ``(ids, mask)``."""
    return get_template(template).render(messages, tokenizer, add_generation_prompt=add_generation_prompt)


def template_from_meta(meta: dict) -> ChatTemplate | None:
    """The chat template stored in a checkpoint's ``meta.json`` (key ``"chat_template"``); None for a base
    model. Raises ``ValueError`` for a malformed stored template."""
    d = (meta or {}).get(CHAT_TEMPLATE_KEY)
    return None if d is None else ChatTemplate.from_dict(d)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as plain text: special-token look-alikes (``"<|user|>"``, ``"<EOS>"``) stay text."""
    return list(tokenizer.encode(text, allow_special=False))


# ---------------------------------------------------------------------------------------------------------
# Messages and JSONL data
# ---------------------------------------------------------------------------------------------------------


def check_messages(messages, *, final: str | None = "assistant") -> None:
    """Check a conversation: a list of ``{"role", "content"}`` dicts with string content, roles among
    system/user/assistant, an optional system message first, then user and assistant alternating from the
    user; assistant turns non-empty. ``final``: the role the last message must have ("assistant" for
    training data, "user" before a reply, None: either).

    Raises:
        ValueError: naming the message index and what is wrong.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    expect = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be an object with \"role\" and \"content\", got {str(m)[:80]}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) content must be a string, got {type(content).__name__}")
        if role == "system":
            if i != 0:
                raise ValueError(f"message {i} is a system message; only the first message may be one")
            continue
        if role != expect:
            what = "two user turns in a row" if role == "user" else (
                "two assistant turns in a row" if i > 0 and messages[i - 1].get("role") == "assistant"
                else "an assistant turn before any user turn")
            raise ValueError(f"message {i}: {what}; after an optional system message, user and assistant "
                             f"turns must alternate, starting with the user")
        if role == "assistant" and not content.strip():
            raise ValueError(f"message {i} is an empty assistant turn")
        expect = "assistant" if role == "user" else "user"
    last = messages[-1]["role"]
    if final is not None and last != final:
        raise ValueError(f"the conversation must end with a{'n' if final == 'assistant' else ''} {final} message, "
                         f"but its last message ({len(messages) - 1}) is a {last} message")


def _detect_format(obj) -> str:
    if isinstance(obj, dict):
        if "messages" in obj:
            return "messages"
        if "prompt" in obj and "completion" in obj:
            return "prompt-completion"
        if "instruction" in obj and "output" in obj:
            return "alpaca"
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise ValueError(f"unknown conversation format (keys {keys}); allowed: {{\"messages\": [...]}}, "
                     f"{{\"prompt\", \"completion\"}} or {{\"instruction\", \"input\", \"output\"}} (Alpaca)")


def _to_messages(obj, fmt: str) -> list[dict]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if fmt == "messages":
        extra = sorted(set(obj) - {"messages"})
        if extra:
            raise ValueError(f"unexpected key(s) {extra} in a {{\"messages\": ...}} file")
        return list(obj["messages"]) if isinstance(obj["messages"], list) else obj["messages"]
    if fmt == "prompt-completion":
        extra = sorted(set(obj) - {"prompt", "completion"})
        if extra or "prompt" not in obj or "completion" not in obj:
            raise ValueError(f"expected keys \"prompt\" and \"completion\" (the file's format), got {sorted(obj)}")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    extra = sorted(set(obj) - {"instruction", "input", "output"})
    if extra or "instruction" not in obj or "output" not in obj:
        raise ValueError(f"expected Alpaca keys \"instruction\", \"input\" (optional), \"output\" (the file's "
                         f"format), got {sorted(obj)}")
    inp = obj.get("input") or ""
    if not isinstance(inp, str) or not isinstance(obj["instruction"], str):
        raise ValueError("Alpaca \"instruction\" and \"input\" must be strings")
    user = obj["instruction"] + (f"\n\n{inp}" if inp.strip() else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]


class Conversations(list):
    """A list of conversations (each a list of messages) read from a file; ``path``, ``format`` and
    ``lines`` (the 1-based line number of each conversation) say where they came from."""

    path: str | None = None
    format: str | None = None
    lines: list[int]


def load_conversations(path: str | os.PathLike) -> Conversations:
    """Read a JSONL file of conversations, one per line (blank lines skipped), all in one format detected
    from the first: ``{"messages": [...]}``, ``{"prompt", "completion"}`` or Alpaca ``{"instruction",
    "input", "output"}``. Every conversation is checked (:func:`check_messages`, ending with the assistant).

    Returns:
        a :class:`Conversations` list (``.path``, ``.format``, ``.lines``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path`` is not a regular file (a folder, ``/dev/null``); ``"<path>, line N: <what is wrong>"`` for malformed JSON, a line in another format, an
            unknown role, two user turns in a row, an empty assistant turn, ...; an empty file. Nothing is
            returned unless every line is good.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder, /dev/null, a pipe
        raise ValueError(f"conversation file {path} is not a regular file (give a JSONL file)")
    if not path.is_file():
        raise FileNotFoundError(f"no conversation file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte offset {e.start})") from None
    out = Conversations()
    out.path, out.lines = str(path), []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: malformed JSON: {e.msg} (column {e.colno})") from None
        try:
            if out.format is None:
                out.format = _detect_format(obj)
            messages = _to_messages(obj, out.format)
            check_messages(messages, final="assistant")
        except ValueError as e:
            raise ValueError(f"{path}, line {n}: {e}") from None
        out.append([{"role": m["role"], "content": m["content"]} for m in messages])
        out.lines.append(n)
    if not out:
        raise ValueError(f"{path} holds no conversations (it is empty)")
    return out


def as_conversations(data) -> Conversations:
    """A path (loaded with :func:`load_conversations`) or a list of conversations (checked) as
    :class:`Conversations`."""
    if isinstance(data, (str, os.PathLike)):
        return load_conversations(data)
    if isinstance(data, Conversations):
        return data
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("conversations must be a JSONL path or a non-empty list of conversations")
    out = Conversations()
    out.lines = []
    for i, conv in enumerate(data):
        try:
            check_messages(conv, final="assistant")
        except ValueError as e:
            raise ValueError(f"conversation {i}: {e}") from None
        out.append([{"role": m["role"], "content": m["content"]} for m in conv])
        out.lines.append(i + 1)
    out.format = "messages"
    return out


def check_representable(conversations: Conversations, tokenizer: Tokenizer) -> None:
    """Raise ``ValueError`` naming the characters (char tokenizer) or words (word tokenizer) of the data
    that ``tokenizer`` cannot encode, with the line of their first appearance. A tokenizer with ``<unk>``, or
    byte-level BPE, can encode anything."""
    where = "line" if conversations.path else "conversation"
    missing: dict[str, int] = {}
    for conv, line in zip(conversations, conversations.lines):
        for m in conv:
            try:
                encode_text(tokenizer, m["content"])
            except (ValueError, KeyError):
                if tokenizer.kind == "char":
                    units = [c for c in m["content"] if c not in tokenizer.token_to_id]
                elif tokenizer.kind == "word":
                    units = [w for w in m["content"].split() if w not in tokenizer.token_to_id
                             or w in (EOS, "<PAD>", *tokenizer.added_special_tokens)]
                else:
                    units = [m["content"][:20]]
                for u in units:
                    missing.setdefault(u, line)
    if missing:
        kind = {"char": "character", "word": "word"}.get(tokenizer.kind, "text")
        shown = ", ".join(f"{u!r}" + (f" (U+{ord(u):04X})" if len(u) == 1 else "") + f" ({where} {ln})"
                          for u, ln in list(missing.items())[:10])
        raise ValueError(
            f"the tokenizer ({tokenizer.kind}, {tokenizer.vocab_size} tokens) cannot represent "
            f"{len(missing)} {kind}{'s' if len(missing) > 1 else ''} of the data"
            f"{' in ' + conversations.path if conversations.path else ''}: {shown}"
            f"{' ...' if len(missing) > 10 else ''}; fine-tune a checkpoint whose tokenizer covers them, "
            f"or start from a preset (a new tokenizer is built from the data)")


# ---------------------------------------------------------------------------------------------------------
# Special tokens in a model: tokenizer + embedding resize
# ---------------------------------------------------------------------------------------------------------


def resize_token_embeddings(model, num_tokens: int):
    """A copy of ``model`` with a vocabulary of ``num_tokens`` (>= the current one): the word embedding
    (num_tokens, d_model) and an untied ``fc_layer`` (weight rows and bias) get new rows set to the mean of
    the old rows (so new tokens start as an "average" token rather than at random); every other weight is
    copied. A tied head follows the embedding. Returns the model itself when the size is unchanged.

    Raises:
        ValueError: ``num_tokens`` smaller than the current vocabulary.
    """
    old = model.config.num_tokens
    if num_tokens == old:
        return model
    if num_tokens < old:
        raise ValueError(f"cannot shrink the vocabulary from {old} to {num_tokens} tokens")
    cfg = model.config.replace(num_tokens=int(num_tokens))
    new = type(model)(cfg)
    if hasattr(model, "lr"):
        new.lr = model.lr
    p = next(model.parameters())
    new = new.to(device=p.device, dtype=p.dtype)
    state = dict(model.state_dict())
    extra = num_tokens - old

    def grow(t: torch.Tensor) -> torch.Tensor:
        mean = t.mean(dim=0, keepdim=True)
        return torch.cat([t, mean.expand(extra, *t.shape[1:])], dim=0)

    state["we.weight"] = grow(state["we.weight"])
    if cfg.tie_weights:
        state["fc_layer.weight"] = state["we.weight"]
    else:
        state["fc_layer.weight"] = grow(state["fc_layer.weight"])
    if "fc_layer.bias" in state:
        state["fc_layer.bias"] = grow(state["fc_layer.bias"])
    new.load_state_dict(state)
    new.train(model.training)
    return new


def add_chat_tokens(model, tokenizer: Tokenizer, template: str | ChatTemplate | None = None):
    """Give ``(model, tokenizer)`` the special tokens of ``template``: ``(model, tokenizer, added)`` with the
    tokenizer extended (:meth:`Tokenizer.add_special_tokens`) and the model resized
    (:func:`resize_token_embeddings`); ``added`` lists the new tokens ([] when all were there). ``model`` may
    be None (only the tokenizer is extended)."""
    template = get_template(template)
    new_tok = tokenizer.add_special_tokens(template.special_tokens)
    added = [t for t in new_tok.added_special_tokens if t not in tokenizer.token_to_id]
    if model is not None:
        model = resize_token_embeddings(model, new_tok.vocab_size)
    return model, new_tok, added


def load_chat_checkpoint(directory, map_location="cpu"):
    """``(model, tokenizer, template)`` of a checkpoint; ``template`` is the stored one (None for a base
    model). The tokenizer holds its special tokens (saved in ``tokenizer.json``)."""
    model, tok = load_checkpoint(directory, map_location=map_location)
    return model, tok, template_from_meta(read_meta(directory))


# ---------------------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------------------


def fit_messages(messages: Sequence[dict], tokenizer: Tokenizer, template: ChatTemplate, max_len: int,
                 reserve: int) -> tuple[list[dict], int, list[int]]:
    """Drop the oldest turns (a user message with the assistant reply after it; never the system message)
    until the rendered prompt (with the generation prompt) plus ``reserve`` new tokens fits in ``max_len``.

    Returns:
        ``(kept_messages, number_of_messages_dropped, prompt_ids)``. When even the last user message alone
        leaves less than ``reserve`` tokens, it is kept with what room there is.

    Raises:
        ValueError: the system message and the last user message alone render to ``max_len`` tokens or more.
    """
    messages = list(messages)
    check_messages(messages, final="user")
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    dropped = 0
    while True:
        ids, _ = template.render(head + body, tokenizer, add_generation_prompt=True)
        if len(ids) + reserve <= max_len or len(body) == 1:
            break
        body = body[2:]
        dropped += 2
    if len(ids) >= max_len:
        what = "system message and the last user message alone render" if head else "last user message alone renders"
        raise ValueError(f"the {what} to {len(ids)} tokens, which leaves no room for a reply within the model's "
                         f"max_len={max_len}; shorten the message")
    return head + body, dropped, ids


def stream_chat_reply(model, tokenizer: Tokenizer, messages: Sequence[dict],
                      template: str | ChatTemplate | None = None, params: SamplingParams | int | None = None, *,
                      info: dict | None = None, **sampling) -> Iterator[str]:
    """Stream the assistant's reply to ``messages`` (ending with a user message) as text pieces.

    The prompt is ``template.render(messages, add_generation_prompt=True)`` -- the renderer training used.
    If it does not fit in ``max_len`` with room for ``min(max_new_tokens, max_len // 2)`` new tokens, the
    oldest turns are dropped (:func:`fit_messages`; never the system message). Generation
    (:func:`decoderlab.generation.stream`, KV cache) stops at the end-of-turn token (not part of the reply)
    or after ``min(max_new_tokens, max_len - prompt length)`` tokens, so the context never slides.

    Args:
        model, tokenizer: e.g. from :func:`load_chat_checkpoint`; template: the checkpoint's (None: default).
        params, **sampling: the settings (a :class:`decoderlab.generation.SamplingParams`, or an int for
            max_new_tokens, and fields over it: ``temperature=0``), as :func:`decoderlab.generation.stream`.
        info: a dict to receive ``prompt_ids``, ``dropped_messages`` (count), ``reply_ids``,
            ``ended_with_end_of_turn`` (bool) and ``max_new_tokens`` (the cap actually used).

    Raises:
        ValueError: bad messages; the tokenizer lacks the template's tokens; bad sampling values; a last
            message too long for the model.
    """
    params = SamplingParams.of(params, **sampling)
    template = get_template(template)
    max_len = model.config.max_len
    reserve = max(1, min(params.max_new_tokens, max_len // 2))
    kept, dropped, ids = fit_messages(messages, tokenizer, template, max_len, reserve)
    eot = template.end_of_turn_id(tokenizer)
    n_new = max(0, min(params.max_new_tokens, max_len - len(ids)))
    if info is not None:
        info.update(prompt_ids=list(ids), dropped_messages=dropped, max_new_tokens=n_new, reply_ids=[],
                    ended_with_end_of_turn=False)
    # the end of turn ends the reply, whatever the settings; <PAD> is never sampled and <EOS> ends it too
    params = params.replace(max_new_tokens=n_new, stop=(eot,) + (params.stop or ()))
    gen = stream(model, ids, params, tokenizer=tokenizer)
    streamer = TextStreamer(tokenizer)
    while True:
        try:
            token = next(gen)
        except StopIteration as end:
            matched = end.value
            break
        if info is not None:
            info["reply_ids"].append(token)
        piece = streamer.put(token)
        if piece:
            yield piece
    tail = streamer.end()
    if tail:
        yield tail
    if info is not None:
        info["ended_with_end_of_turn"] = matched == (eot,)


def chat_reply(model, tokenizer: Tokenizer, messages: Sequence[dict], template: str | ChatTemplate | None = None,
               params: SamplingParams | int | None = None, *, info: dict | None = None, **sampling) -> str:
    """The assistant's reply to ``messages`` as one string (``"".join(stream_chat_reply(...))``)."""
    return "".join(stream_chat_reply(model, tokenizer, messages, template, params, info=info, **sampling))


# ---------------------------------------------------------------------------------------------------------
# An interactive session over a chat template (decoderlab chat on a chat checkpoint)
# ---------------------------------------------------------------------------------------------------------

class TemplateChatSession(ChatSession):
    """``decoderlab chat`` for a chat checkpoint: the conversation is kept as messages and every turn is
    rendered with the stored template (:func:`stream_chat_reply`), so the model sees the layout it was
    fine-tuned on. Replies stop at the end of turn. When the history no longer fits in ``max_len``, the oldest
    turns are dropped (never the system message) and ``notice`` says so until the next reply.

    Args: as :class:`decoderlab.generation.ChatSession`, plus ``template`` and an optional ``system`` message.
    Defaults: greedy for the "lesson" template (as the lesson), temperature 1.0 otherwise; max_new_tokens
    the :class:`~decoderlab.generation.SamplingParams` default.
    """

    def __init__(self, model, tokenizer, template: ChatTemplate, params: SamplingParams | None = None, *,
                 system: str | None = None, **sampling):
        if params is None and template.name == "lesson":
            sampling = {"temperature": 0.0, **sampling}  # the lesson: greedy
        super().__init__(model, tokenizer, params, **sampling)
        self.template = get_template(template)
        self.template.end_of_turn_id(tokenizer)  # the tokenizer must hold the template's tokens
        self.system = system
        self.notice: str | None = None
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Iterator[str]:
        messages = self.messages + [{"role": "user", "content": text}]
        info: dict = {}
        self.notice = None
        pieces: list[str] = []
        for piece in stream_chat_reply(self.model, self.tokenizer, messages, self.template, self.turn_params(),
                                       info=info):
            pieces.append(piece)
            yield piece
        head = 1 if messages[0]["role"] == "system" else 0
        kept = messages[:head] + messages[head + info["dropped_messages"]:]
        self.messages = kept + [{"role": "assistant", "content": "".join(pieces) or " "}]
        if info["dropped_messages"]:
            self.notice = (f"(the conversation was longer than the model's {self.model.config.max_len}-token "
                           f"context: dropped the {info['dropped_messages']} oldest messages"
                           f"{', kept the system message' if head else ''})")
        if not info["ended_with_end_of_turn"]:
            self.notice = ((self.notice + "\n") if self.notice else "") + (  # one line each
                f"(the reply stopped at {info['max_new_tokens']} tokens without an end of turn)")
        self.turn += 1
