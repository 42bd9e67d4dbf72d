"""Conversation data: JSONL files of conversations, one per line, the format detected per file from its first
line -- ``{"messages": [...]}``, ``{"prompt", "completion"}`` (the lesson's pairs), or Alpaca
``{"instruction", "input", "output"}`` -- and the check that a tokenizer can represent them."""

from __future__ import annotations

import os
from pathlib import Path

from ..jsonl import jsonl_rows
from ..tokenizers import EOS, Tokenizer
from .messages import check_messages
from .templates import encode_text, tool_call_text

FORMATS = ("messages", "prompt-completion", "alpaca")


def _detect_format(obj) -> str:
    if isinstance(obj, dict):
        if "messages" in obj:
            return "messages"
        if "prompt" in obj and "completion" in obj:
            return "prompt-completion"
        if "instruction" in obj and "output" in obj:
            return "alpaca"
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    if isinstance(obj, dict) and {"prompt", "chosen", "rejected"} <= set(obj):
        raise ValueError(f"unknown conversation format (keys {keys}): this is a preference pair (prompt, chosen, "
                         f"rejected), which supervised fine-tuning cannot read; train on pairs with method='dpo' "
                         f"(--method dpo)")
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


def _kept(m: dict) -> dict:
    """What the template renders of a message: role, content, and a tool call's or result's fields."""
    return {k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in m}


def message_text(m: dict) -> str:
    """The text of a message as the template renders it: its content and its tool calls (``NAME {ARGUMENTS}``)."""
    return " ".join([m["content"] or ""] + [tool_call_text(c["function"]["name"], c["function"]["arguments"])
                                            for c in m.get("tool_calls") or ()])


class Conversations(list):
    """A list of conversations (each a list of messages) read from a file; ``path``, ``format`` and
    ``lines`` (the 1-based line number of each conversation) say where they came from."""

    path: str | None = None
    format: str | None = None
    lines: list[int]


def load_conversations(path: str | os.PathLike) -> Conversations:
    """Read a JSONL file of conversations, one per line (blank lines skipped), all in one format detected
    from the first: ``{"messages": [...]}``, ``{"prompt", "completion"}`` or Alpaca ``{"instruction",
    "input", "output"}``. Every conversation is checked (:func:`~decoderlab.chat.check_messages`, ending with
    the assistant). The file is read as every JSON Lines file is (:func:`decoderlab.jsonl.jsonl_rows`: UTF-8, a
    leading byte-order mark dropped, CRLF line ends, lines split at ``\\n`` only).

    Returns:
        a :class:`Conversations` list (``.path``, ``.format``, ``.lines``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path`` is not a regular file (a folder, ``/dev/null``); not UTF-8 text; ``"<path>, line
            N: <what is wrong>"`` for malformed JSON, a line in another format, an unknown role, two user turns
            in a row, an empty assistant turn, ...; an empty file. Nothing is returned unless every line is good.
    """
    path = Path(path)
    out = Conversations()
    out.path, out.lines = str(path), []
    for n, obj in jsonl_rows(path, "conversation file"):
        try:
            if out.format is None:
                out.format = _detect_format(obj)
            messages = _to_messages(obj, out.format)
            check_messages(messages, final="assistant")
        except ValueError as e:
            raise ValueError(f"{path}, line {n}: {e}") from None
        out.append([_kept(m) for m in messages])
        out.lines.append(n)
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
        out.append([_kept(m) for m in conv])
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
            text = message_text(m)
            try:
                encode_text(tokenizer, text)
            except (ValueError, KeyError):
                if tokenizer.kind == "char":
                    units = [c for c in text if c not in tokenizer.token_to_id]
                elif tokenizer.kind == "word":
                    units = [w for w in text.split() if w not in tokenizer.token_to_id
                             or w in (EOS, "<PAD>", *tokenizer.added_special_tokens)]
                else:
                    units = [text[:20]]
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
