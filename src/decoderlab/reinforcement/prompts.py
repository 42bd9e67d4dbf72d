"""The prompts of a reinforcement-learning run: a JSONL file of conversations to answer, each row with the
fields its reward needs.

One row per line, either of:

* ``{"messages": [..., {"role": "user", "content": "..."}], ...}`` -- decoderlab's conversation format,
  ending with the user turn to answer (an optional system message first, as in fine-tuning data);
* ``{"prompt": "text" | [messages], ...}`` -- TRL's prompt-only format (a text is one user turn).

Every other key of a row is a field for the reward (``words`` for ``contains_words``, ``reference`` for
``exact`` and ``number``, ``pattern`` for ``regex``, anything for a ``module:function`` reward); the reward
receives the row as read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..chat import check_messages
from ..jsonl import jsonl_rows
from .rewards import RewardFn, reward_name


@dataclass
class PromptRow:
    """One prompt: ``messages`` (a conversation ending with a user message), ``row`` (the JSON object as
    read, which the reward receives) and ``line`` (its 1-based line in the file, or position in a list)."""

    messages: list[dict]
    row: dict
    line: int


def _messages_of(obj) -> list[dict]:
    if not isinstance(obj, dict):
        raise ValueError(f"a prompt row must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj and "prompt" in obj:
        raise ValueError("a prompt row has either \"messages\" or \"prompt\", not both")
    if "messages" in obj:
        messages = obj["messages"]
    elif "prompt" in obj:
        messages = obj["prompt"]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
    else:
        raise ValueError(f"a prompt row needs \"messages\" (a conversation ending with a user turn) or "
                         f"\"prompt\" (text or messages); this row has {sorted(obj)}")
    check_messages(messages, final="user")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_for_reward(reward: RewardFn | None, obj: dict) -> None:
    if reward is None:
        return
    check = getattr(reward, "check_row", None)
    if callable(check):
        check(obj)
        return
    missing = [f for f in getattr(reward, "fields", ()) if f not in obj]
    if missing:
        raise ValueError(f"the reward {reward_name(reward)!r} needs the field(s) {missing} in every row; "
                         f"this row has {sorted(obj)}")


def load_prompts(data: str | os.PathLike | Sequence[dict], reward: RewardFn | None = None) -> list[PromptRow]:
    """Read the prompts of a run (see the module docstring) and check each row for ``reward``.

    Args:
        data: a JSONL path, or a list of row dicts (numbered 1, 2, ... in messages).
        reward: the run's reward; every row is checked with its ``check_row`` (the built-ins) or for its
            ``fields`` before anything is sampled.

    Returns:
        one :class:`PromptRow` per row, in file order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``"<path>, line N: <what is wrong>"`` -- malformed JSON, a row without ``messages`` or
            ``prompt``, a conversation that does not end with a user turn, a field the reward needs missing
            or malformed; an empty file.
    """
    if isinstance(data, (str, os.PathLike)):
        source, rows = str(data), jsonl_rows(data, "prompts file")
    elif isinstance(data, (list, tuple)) and data:
        source, rows = "prompts", enumerate(data, start=1)
    else:
        raise ValueError("prompts must be a JSONL path or a non-empty list of rows")
    out = []
    for line, obj in rows:
        try:
            messages = _messages_of(obj)
            _check_for_reward(reward, obj)
        except ValueError as e:
            raise ValueError(f"{source}, {'line' if source != 'prompts' else 'row'} {line}: {e}") from None
        out.append(PromptRow(messages, obj, line))
    return out
