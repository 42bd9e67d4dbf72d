"""A chat turn that may call tools: the model writes, opens a call (``<|tool_call|>``), writes ``NAME
{ARGUMENTS}``; the tool runs here and its result goes back into the conversation as a ``tool`` message; the
model goes on -- until it answers without a call, or the calls reach ``max_calls``.

:func:`run_tool_turn` is the loop, for the library (``Model.chat(..., tools=...)``), ``decoderlab chat
--tools`` and the report card. Nothing the model writes raises: a call to an unknown tool, arguments that are
not JSON, a tool that fails -- each becomes an ``error: ...`` result the model reads on its next step. A result
longer than the context left is cut, ending with ``TRUNCATED``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..generation import SamplingParams, stream
from ..tokenizers import Tokenizer
from .calculator import Tool
from ..generation.text import EMPTY_REPLY
from .replies import TemplateChatSession
from .templates import ChatTemplate, encode_text, get_template, parse_tool_call
from .tools import ToolSet

#: how many tool calls a turn may make before the loop stops it
DEFAULT_MAX_CALLS = 3
#: what ends a tool result cut to the context left
TRUNCATED = " ...[truncated]"
#: tokens kept free after a tool result for the answer that follows it
ANSWER_ROOM = 16
#: why a turn ended: the model answered (end of turn); it ran out of room (max_new_tokens or the context);
#: it asked for a call after ``max_calls`` calls
FINISH_REASONS = ("stop", "length", "max_tool_calls")


@dataclass
class ToolCallRecord:
    """One call of a turn: the tool's ``name``, the ``arguments`` as the model wrote them, the ``result`` text
    the model read (``error: ...`` when refused), and its ``id`` in the conversation."""

    name: str
    arguments: str
    result: str
    id: str


@dataclass
class ToolTurn:
    """A turn's outcome: ``content`` (the final reply's text), ``messages`` (what the turn added to the
    conversation: assistant calls, tool results, the final assistant message), ``calls`` and
    ``finish_reason`` (one of ``FINISH_REASONS``)."""

    content: str
    messages: list[dict] = field(default_factory=list)
    calls: list[ToolCallRecord] = field(default_factory=list)
    finish_reason: str = "stop"


def _generate(model, tokenizer, ids, params: SamplingParams, stops) -> tuple[list[int], tuple | None]:
    gen = stream(model, ids, params.replace(stop=tuple(stops)), tokenizer=tokenizer)
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as end:
            return out, end.value


def _run(tools: Mapping[str, Tool | Callable], name: str, arguments: str) -> str:
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; tools: {', '.join(tools) or 'none'}"
    run = tool.run if isinstance(tool, Tool) else tool
    try:
        return str(run(arguments))
    except Exception as e:  # noqa: BLE001 -- a failing tool is a result the model reads, never a crash here
        return f"error: the tool {name!r} failed: {type(e).__name__}: {e}"


def fit_result(result: str, tokenizer: Tokenizer, room: int) -> str:
    """``result`` cut to at most ``room`` tokens, ending with ``TRUNCATED`` when cut (``TRUNCATED`` alone,
    cut too, when there is no room for any of it)."""
    ids = encode_text(tokenizer, result)
    if len(ids) <= room:
        return result
    marker = encode_text(tokenizer, TRUNCATED)
    keep = max(0, room - len(marker))
    return tokenizer.decode(ids[:keep]) + TRUNCATED if keep else tokenizer.decode(marker[:max(room, 0)])


def _definitions(tools) -> list[dict]:
    return [t.definition for t in tools.values() if isinstance(t, Tool)]


def _call_grammar(tools):
    defs = _definitions(tools)
    return ToolSet.of(defs).grammar() if defs and len(defs) == len(tools) else None


def run_tool_turn(model, tokenizer: Tokenizer, messages: Sequence[dict], template: str | ChatTemplate | None,
                  tools: Mapping[str, Tool | Callable[[str], str]], params: SamplingParams | int | None = None, *,
                  max_calls: int = DEFAULT_MAX_CALLS, offer: bool = False, constrain: bool = True,
                  on_call: Callable[[ToolCallRecord], None] | None = None, **sampling) -> ToolTurn:
    """The assistant's turn after ``messages`` (ending with a user message), running the tools it calls.

    Args:
        model, tokenizer, template: a chat checkpoint whose template has tool tokens (the ``"tools"`` template).
        tools: name -> a :class:`~decoderlab.chat.calculator.Tool` or a function ``run(arguments_json) -> str``
            (``decoderlab.chat.calculator.TOOLS`` holds the built-ins).
        params, **sampling: the sampling settings (as :func:`decoderlab.generation.stream`); ``max_new_tokens``
            bounds each step of the turn.
        max_calls: the most calls in one turn (>= 0); a call asked for beyond them ends the turn with
            ``finish_reason="max_tool_calls"``.
        offer: render the tools' definitions in the prompt (the ``tools`` template's ``<|tool|> [...]``); off by
            default, as the task conversations the report card trains on carry none.
        constrain: write each call under the grammar of a call to one of the tools (name, then arguments valid
            against its JSON schema) when every tool has a definition.
        on_call: called with each :class:`ToolCallRecord` once its result is known (``decoderlab chat`` shows it).

    Returns:
        :class:`ToolTurn`.

    Raises:
        ValueError: bad messages, a template without tool tokens, ``max_calls`` < 0, bad sampling values.
    """
    template = get_template(template)
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
        raise ValueError(f"max_calls must be an integer >= 0, got {max_calls!r}")
    params = SamplingParams.of(params, **sampling)
    tc, eot = template.tool_call_id(tokenizer), template.end_of_turn_id(tokenizer)
    grammar = _call_grammar(tools) if constrain else None
    max_len, offered = model.config.max_len, (_definitions(tools) if offer else None) or None
    convo, turn = list(messages), ToolTurn("")
    while True:
        ids, _ = template.render(convo, tokenizer, add_generation_prompt=True, tools=offered)
        room = min(params.max_new_tokens, max_len - len(ids))
        if room <= 0:
            return _finish(turn, "", "length")
        out, matched = _generate(model, tokenizer, ids, params.replace(max_new_tokens=room), (eot, tc))
        content = tokenizer.decode(out)
        if matched != (tc,):
            return _finish(turn, content, "stop" if matched == (eot,) else "length")
        if len(turn.calls) >= max_calls:
            return _finish(turn, content, "max_tool_calls")
        head = ids + encode_text(tokenizer, content) + [tc]
        room = min(params.max_new_tokens, max_len - len(head))
        call_params = params.replace(max_new_tokens=max(room, 0), grammar=grammar)
        call_ids, matched = _generate(model, tokenizer, head, call_params, (eot,)) if room > 0 else ([], None)
        name, arguments = parse_tool_call(tokenizer.decode(call_ids))
        name = name or "?"  # a call without a name still enters the conversation, refused as an unknown tool
        call_id = f"call_{len(turn.calls)}"
        used = len(head) + len(call_ids) + 3  # the call's end, the result's opener and end
        result = fit_result(_run(tools, name, arguments), tokenizer, max_len - used - ANSWER_ROOM - 1)
        record = ToolCallRecord(name, arguments, result, call_id)
        turn.calls.append(record)
        if on_call is not None:
            on_call(record)
        added = [{"role": "assistant", "content": content, "tool_calls": [{
            "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": result}]
        convo += added
        turn.messages += added


def _finish(turn: ToolTurn, content: str, reason: str) -> ToolTurn:
    turn.content, turn.finish_reason = content, reason
    turn.messages.append({"role": "assistant", "content": content})
    return turn


def call_line(call: ToolCallRecord) -> str:
    """How ``decoderlab chat`` shows a call and its result: ``[calculator {"expression": "2 * 3"} -> 6]``."""
    return f"[{call.name} {call.arguments} -> {call.result}]"


class ToolChatSession(TemplateChatSession):
    """``decoderlab chat --tools``: :class:`~decoderlab.chat.TemplateChatSession` whose turns run
    :func:`run_tool_turn` with ``tools``; a reply shows each call and its result on a line of its own
    (:func:`call_line`) before the answer, and the calls and results stay in the conversation.

    Raises:
        ValueError: a template without tool tokens (fine-tune with the ``"tools"`` template).
    """

    def __init__(self, model, tokenizer, template: ChatTemplate, tools: Mapping[str, Tool], params=None, *,
                 system: str | None = None, max_calls: int = DEFAULT_MAX_CALLS, **sampling):
        super().__init__(model, tokenizer, template, params, system=system, **sampling)
        self.template.tool_call_id(tokenizer)
        self.tools, self.max_calls = dict(tools), max_calls

    def reply(self, text: str):
        messages = self.messages + [{"role": "user", "content": text}]
        self.notice = None
        turn = run_tool_turn(self.model, self.tokenizer, messages, self.template, self.tools, self.turn_params(),
                             max_calls=self.max_calls)
        for call in turn.calls:
            yield call_line(call) + "\n"
        if turn.content:
            yield turn.content
        self.messages = messages + turn.messages
        if turn.finish_reason == "stop" and not turn.content:
            self.notice = EMPTY_REPLY
        elif turn.finish_reason != "stop":
            self.notice = {"length": f"(the reply stopped at {self.turn_params().max_new_tokens} tokens or the "
                                     f"context's end without an end of turn)",
                           "max_tool_calls": f"(the turn reached {self.max_calls} tool calls, the most per turn)"
                           }[turn.finish_reason]
        self.turn += 1
