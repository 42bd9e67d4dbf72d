"""Preference data for DPO: TRL's ``prompt`` / ``chosen`` / ``rejected`` rows, read and rendered.

One row per line of a JSONL file, each field as text or as messages (TRL's "standard" and "conversational"
preference formats; the two may be mixed)::

    {"prompt": "Name a colour.", "chosen": "Red.", "rejected": "Seven."}
    {"prompt": [{"role": "user", "content": "Name a colour."}],
     "chosen": [{"role": "assistant", "content": "Red."}], "rejected": [{"role": "assistant", "content": "7"}]}

A text ``prompt`` is one user turn; a text ``chosen`` / ``rejected`` is one assistant turn. As messages the
prompt is a conversation ending with a user turn and each completion continues it (starting with the
assistant). :func:`render_pair` renders ``prompt + chosen`` and ``prompt + rejected`` with the chat template
-- the one renderer -- with the loss mask on the completion's tokens only (an assistant turn inside the
prompt is context).

Source: TRL's preference dataset formats (``DPOTrainer``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..chat import ChatTemplate, check_messages, get_template
from ..tokenizers import Tokenizer
from ..jsonl import jsonl_rows

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    """One preference: ``prompt`` (messages ending with a user turn), ``chosen`` and ``rejected`` (messages
    continuing it, starting with the assistant), ``line`` (1-based line in the file, or position in a list)."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    line: int


def _is_empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return not value or all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                and not m["content"].strip() for m in value)
    return False


def _as_messages(value, role: str, name: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in value]
    raise ValueError(f"\"{name}\" must be text or a list of messages, got {type(value).__name__}")


def parse_pair(obj, line: int) -> PreferencePair:
    """A :class:`PreferencePair` from one row (a dict with ``prompt``, ``chosen``, ``rejected``).

    Raises:
        ValueError: a missing field (naming it), an empty ``chosen`` or ``rejected``, extra keys, a prompt
            that does not end with a user turn, a completion that does not start with the assistant or breaks
            the turn order.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a preference row must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in PREFERENCE_FIELDS if f not in obj]
    if missing:
        raise ValueError(f"a preference row needs \"prompt\", \"chosen\" and \"rejected\"; this row lacks "
                         f"{', '.join(repr(m) for m in missing)} (it has {sorted(obj)})")
    extra = sorted(set(obj) - set(PREFERENCE_FIELDS))
    if extra:
        raise ValueError(f"unexpected key(s) {extra} in a preference row; allowed: {', '.join(PREFERENCE_FIELDS)}")
    for name in ("chosen", "rejected"):
        if _is_empty(obj[name]):
            raise ValueError(f"\"{name}\" is empty; a preference needs a non-empty {name} reply")
    prompt = _as_messages(obj["prompt"], "user", "prompt")
    check_messages(prompt, final="user")
    out = {}
    for name in ("chosen", "rejected"):
        completion = _as_messages(obj[name], "assistant", name)
        if completion[0].get("role") != "assistant":
            raise ValueError(f"\"{name}\" must start with an assistant message, got role "
                             f"{completion[0].get('role')!r}")
        try:
            check_messages(prompt + completion, final="assistant")
        except ValueError as e:
            raise ValueError(f"prompt + \"{name}\": {e}") from None
        out[name] = completion
    return PreferencePair(prompt, out["chosen"], out["rejected"], line)


def load_preferences(data: str | os.PathLike | Sequence[dict]) -> list[PreferencePair]:
    """Read preference rows (see the module docstring): a JSONL path, or a list of row dicts.

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``"<path>, line N: <what is wrong>"`` (see :func:`parse_pair`; malformed JSON); an empty
            file or list.
    """
    if isinstance(data, (str, os.PathLike)):
        source, rows, unit = str(data), jsonl_rows(data, "preference file"), "line"
    elif isinstance(data, (list, tuple)) and data:
        source, rows, unit = "preferences", enumerate(data, start=1), "row"
    else:
        raise ValueError("preferences must be a JSONL path or a non-empty list of rows")
    out = []
    for line, obj in rows:
        try:
            out.append(parse_pair(obj, line))
        except ValueError as e:
            raise ValueError(f"{source}, {unit} {line}: {e}") from None
    return out


def render_completion(prompt: list[dict], completion: list[dict], tokenizer: Tokenizer,
                      template: ChatTemplate) -> tuple[list[int], list[bool]]:
    """``(ids, mask)`` of ``prompt + completion`` rendered with ``template``, the mask True only on the
    completion's supervised tokens (its assistant content and ends of turn).

    Raises:
        ValueError: the template does not render the prompt as a prefix of the whole conversation (each
            built-in one does), or the tokenizer lacks the template's tokens.
    """
    ids, mask = template.render(prompt + completion, tokenizer)
    head, _ = template.render(prompt, tokenizer, add_generation_prompt=True)
    if ids[: len(head)] != head:
        raise ValueError(f"the {template.name!r} chat template does not render a prompt as the start of the "
                         f"conversation that continues it; it cannot be used for preference pairs")
    return ids, [False] * len(head) + mask[len(head):]


def render_pair(pair: PreferencePair, tokenizer: Tokenizer, template: str | ChatTemplate | None = None):
    """``((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))`` of a pair (:func:`render_completion`)."""
    template = get_template(template)
    return (render_completion(pair.prompt, pair.chosen, tokenizer, template),
            render_completion(pair.prompt, pair.rejected, tokenizer, template))
