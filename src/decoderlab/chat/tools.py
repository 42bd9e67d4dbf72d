"""Tools a model may call: the function definitions a request offers, checked, and the grammar that constrains
a call to them -- a function's name, then arguments valid against its parameters' JSON schema, in the text of
the template's format: ``NAME {ARGUMENTS}`` after the ``"tools"`` template's ``<|tool_call|>``
(:func:`~decoderlab.chat.templates.tool_call_text`), or ``{"name": NAME, "arguments": {ARGUMENTS}}`` between
``<tool_call>`` and ``</tool_call>`` (the ``"hermes"`` format: :mod:`decoderlab.chat.hermes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from ..generation import Grammar

#: how the arguments are written: no free whitespace (a small model cannot wander off in spaces), the
#: separators json.dumps writes (tool_call_text renders past calls the same way), unknown keywords ignored
_ARGUMENT_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

#: a function without parameters takes an empty object
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A bad tool definition or tool choice; ``param`` names where (``tools[1].function.name``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSet:
    """The functions offered, in order: ``names`` and their parameter schemas (``schemas[name]``, a dict).

    Build it with :meth:`of` from OpenAI's ``tools`` (``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``); :meth:`grammar` is the constraint of one call."""

    names: tuple[str, ...]
    schemas: dict
    definitions: tuple[dict, ...]

    @classmethod
    def of(cls, tools: Sequence[dict]) -> "ToolSet":
        """Raises :class:`ToolError` for a definition that is not a function, a name that is empty, not made
        of letters, digits, ``_`` and ``-`` (OpenAI's rule) or given twice, and parameters that are not a JSON
        schema the grammar library compiles."""
        names, schemas = [], {}
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type", "function") != "function":
                raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name) \
                    or len(name) > 64:
                raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, "
                                                          f"_ or -, got {json.dumps(name)[:80]}")
            if name in schemas:
                raise ToolError(f"{where}.function.name", f"{where}.function.name {name!r} is given twice; each "
                                                          f"function needs its own name")
            schemas[name] = _checked_schema(fn.get("parameters"), f"{where}.function.parameters")
            names.append(name)
        return cls(tuple(names), schemas, tuple(tools))

    def grammar(self, name: str | None = None, *, format: str = "tokens") -> Grammar:
        """One call to one of the functions (``name``: that one), the arguments valid against its parameters'
        schema, written in ``format``: ``"tokens"``, ``NAME {ARGUMENTS}``; ``"hermes"``, ``{"name": NAME,
        "arguments": {ARGUMENTS}}`` (what goes between ``<tool_call>\\n`` and ``\\n</tool_call>``).
        Raises :class:`ToolError` for a name not offered; ``ValueError`` for an unknown format."""
        if name is not None and name not in self.schemas:
            raise ToolError("tool_choice", f"tool_choice names the function {name!r}, which tools does not offer "
                                           f"(offered: {', '.join(self.names)})")
        if format not in _HEADS:
            raise ValueError(f"unknown tool-call format {format!r}; known: {', '.join(_HEADS)}")
        head, tail = _HEADS[format]
        after = f" {json.dumps(tail)}" if tail else ""
        calls = [f"{json.dumps(head(n))} %json{json.dumps(_styled(self.schemas[n]))}{after}"
                 for n in ([name] if name is not None else self.names)]
        return Grammar.lark("start: " + " | ".join(calls))


#: each format's text before a call's arguments (of the function's name) and after them
_HEADS = {"tokens": (lambda n: n + " ", ""),
          "hermes": (lambda n: '{"name": ' + json.dumps(n) + ', "arguments": ', "}")}


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": _ARGUMENT_STYLE}


def _checked_schema(schema, where: str) -> dict:
    if schema is None:
        return dict(_NO_PARAMETERS)
    if not isinstance(schema, dict):
        raise ToolError(where, f"{where} must be a JSON schema (an object), got {json.dumps(schema)[:80]}")
    try:
        Grammar.json_schema(_styled(schema), strict=False)
    except (TypeError, ValueError) as e:
        raise ToolError(where, f"{where} is not a JSON schema the grammar library can use: {e}") from None
    return schema
