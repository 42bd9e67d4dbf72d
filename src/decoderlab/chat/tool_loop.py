"""A chat turn that may call tools: the model writes, calls a tool, the tool runs here and its result goes back
into the conversation as a ``tool`` message; the model goes on -- until it answers without a call, or the calls
reach ``max_calls``.

Calls are read in the template's format (its ``tool_call_format``): ``"tokens"``, decoderlab's ``"tools"``
template (``<|tool_call|>`` then ``NAME {ARGUMENTS}``); ``"hermes"``, a Hugging Face template that writes each
call as JSON between ``<tool_call>`` and ``</tool_call>`` (decoderlab's ``chatml-tools``, Qwen2.5, Qwen3:
:mod:`decoderlab.chat.hermes`). A model whose template is SmolLM2-Instruct's ChatML, which writes no calls, is
given ``chatml-tools`` for its tool turns: the same text without tools (:func:`~decoderlab.chat.tools_template`).
Constrained (the default, when every tool has a definition), a call is written
under the grammar of a call to one of the tools once the model opens it (the token, or the text ``<tool_call>``);
else the reply is read back as written, several calls in one reply included.

:func:`run_tool_turn` is the loop, for the library (``Model.chat(..., tools=...)``) and ``decoderlab chat
--tools``; :func:`run_tool_turns` runs many turns with their generations batched (the report card). Nothing the model writes raises: a call to an unknown tool, arguments that are
not JSON, a tool that fails -- each becomes an ``error: ...`` result the model reads on its next step. A result
longer than the context left is cut, ending with ``TRUNCATED``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..generation import SamplingParams, generate_batch, stream, stream_text
from ..tokenizers import Tokenizer
from .calculator import Tool
from ..generation.text import EMPTY_REPLY
from .hermes import CALL_BREAK, HERMES, OPENER, ParsedCall, arguments_as_objects, parse_hermes_calls
from .jinja import JinjaChatTemplate, encode_with_offsets
from .replies import TemplateChatSession
from .templates import TOOL_TOKENS, ChatTemplate, encode_text, get_template, parse_tool_call, tools_template
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


@dataclass
class _Ask:
    """One generation a turn asks for: ``ids`` continued under ``params`` up to one of ``stops`` -- token ids
    (answered ``(ids, stop)``, as :func:`~decoderlab.generation.stream` ends) or, ``text``, strings (answered
    ``(text, stop)``, as :func:`~decoderlab.generation.stream_text` ends)."""

    ids: list[int]
    params: SamplingParams
    stops: tuple
    text: bool = False


def _answer(model, tokenizer, ask: _Ask) -> tuple:
    """``ask`` generated alone."""
    params = ask.params.replace(stop=tuple(ask.stops))
    gen = (stream_text(model, ask.ids, tokenizer, params) if ask.text
           else stream(model, ask.ids, params, tokenizer=tokenizer))
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as end:
            return ("".join(out) if ask.text else out), end.value


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


def _call_grammar(tools, fmt: str):
    defs = _definitions(tools)
    return ToolSet.of(defs).grammar(format=fmt) if defs and len(defs) == len(tools) else None


def check_tool_template(template, tokenizer: Tokenizer) -> str:
    """The tool-call format of ``template`` (``"tokens"`` or ``"hermes"``). Raises ``ValueError`` for a template
    that writes no tool calls decoderlab reads (naming it and the templates that do), or a tokenizer without the
    ``"tools"`` template's tool-call token."""
    fmt = getattr(template, "tool_call_format", None)
    if fmt is None:
        raise ValueError(f"the {template.name!r} chat template writes no tool calls decoderlab reads; tools need "
                         f"the \"tools\" or \"chatml-tools\" template, or a Hugging Face template that writes "
                         f"each call as JSON between <tool_call> and </tool_call> (as Qwen2.5's does)")
    if fmt == TOOL_TOKENS:
        template.tool_call_id(tokenizer)
    return fmt


@dataclass
class _Step:
    """What one generation of a turn gave: the text before any call, the calls, and why the turn ends instead
    (None: the calls run and the turn goes on)."""

    content: str
    calls: list[ParsedCall]
    finish: str | None = None


def _token_step(model, tokenizer, template, ids, params, room, grammar, budget):
    """The ``"tools"`` template: text up to the end of turn or ``<|tool_call|>``, then ``NAME {ARGUMENTS}``
    (a generator: yields its :class:`_Ask` s, returns the :class:`_Step`)."""
    tc, eot = template.tool_call_id(tokenizer), template.end_of_turn_id(tokenizer)
    out, matched = yield _Ask(ids, params.replace(max_new_tokens=room), (eot, tc))
    content = tokenizer.decode(out)
    if matched != (tc,):
        return _Step(content, [], "stop" if matched == (eot,) else "length")
    if budget <= 0:
        return _Step(content, [], "max_tool_calls")
    head = ids + encode_text(tokenizer, content) + [tc]
    room = min(params.max_new_tokens, model.config.max_len - len(head))
    call_params = params.replace(max_new_tokens=max(room, 0), grammar=grammar)
    call_ids, _ = (yield _Ask(head, call_params, (eot,))) if room > 0 else ([], None)
    name, arguments = parse_tool_call(tokenizer.decode(call_ids))
    return _Step(content, [ParsedCall(name, arguments)])


def _writes(tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text)
    except (KeyError, ValueError):
        return False
    return True


def _hermes_step(model, tokenizer, template, ids, params, room, grammar, budget):
    """A template that writes calls as text: constrained, text up to the end of turn or ``<tool_call>``, then
    one call's JSON under the grammar; else the reply up to the end of turn, read back
    (:func:`~decoderlab.chat.hermes.parse_hermes_calls`). A generator, as :func:`_token_step`."""
    eot = template.end_of_turn_id(tokenizer)
    opener = grammar is not None and _writes(tokenizer, OPENER)
    text, matched = yield _Ask(ids, params.replace(max_new_tokens=room), (eot, OPENER) if opener else (eot,), True)
    if opener and matched and OPENER in tokenizer.decode(list(matched)):
        if budget <= 0:
            return _Step(text.rstrip(), [], "max_tool_calls")
        head = ids + encode_with_offsets(tokenizer, text + OPENER + CALL_BREAK)[0]
        room = min(params.max_new_tokens, model.config.max_len - len(head))
        call_params = params.replace(max_new_tokens=max(room, 0), grammar=grammar)
        call, _ = (yield _Ask(head, call_params, (eot,), True)) if room > 0 else ("", None)
        return _Step(text.rstrip(), parse_hermes_calls(OPENER + call)[1])
    content, calls = parse_hermes_calls(text)
    if matched is None or not calls:
        return _Step(text, [], "length" if matched is None else "stop")
    return _Step(content, calls, "max_tool_calls" if len(calls) > budget else None)


def _rendered(convo: list[dict], template) -> list[dict]:
    """The conversation as the template reads it: a Hugging Face template reads arguments as objects."""
    return arguments_as_objects(convo) if isinstance(template, JinjaChatTemplate) else convo


def _result_room(template, tokenizer, convo, added, offered, max_len) -> int:
    """The tokens each result of ``added`` (an assistant message and its tool messages, results empty) may
    take: the context left after them and ``ANSWER_ROOM``, shared."""
    ids, _ = template.render(_rendered(convo + added, template), tokenizer, add_generation_prompt=True,
                             tools=offered)
    return (max_len - len(ids) - ANSWER_ROOM) // max(len(added) - 1, 1)


def run_tool_turn(model, tokenizer: Tokenizer, messages: Sequence[dict], template: str | ChatTemplate | None,
                  tools: Mapping[str, Tool | Callable[[str], str]], params: SamplingParams | int | None = None, *,
                  max_calls: int = DEFAULT_MAX_CALLS, offer: bool | None = None, constrain: bool = True,
                  on_call: Callable[[ToolCallRecord], None] | None = None, **sampling) -> ToolTurn:
    """The assistant's turn after ``messages`` (ending with a user message), running the tools it calls.

    Args:
        model, tokenizer, template: a chat checkpoint whose template writes tool calls (its
            ``tool_call_format``: the ``"tools"`` template, ``"chatml-tools"``, a Hugging Face template that
            writes ``<tool_call>`` blocks), or SmolLM2-Instruct's ChatML, rendered with ``chatml-tools``
            (:func:`~decoderlab.chat.tools_template`).
        tools: name -> a :class:`~decoderlab.chat.calculator.Tool` or a function ``run(arguments_json) -> str``
            (``decoderlab.chat.calculator.TOOLS`` holds the built-ins).
        params, **sampling: the sampling settings (as :func:`decoderlab.generation.stream`); ``max_new_tokens``
            bounds each step of the turn.
        max_calls: the most calls in one turn (>= 0); a call asked for beyond them ends the turn with
            ``finish_reason="max_tool_calls"``.
        offer: render the tools' definitions in the prompt (the template's tool block). None (default): as the
            template's format expects -- offered by a Hugging Face template (its models read the tools from the
            system turn), not by the ``"tools"`` template (the task conversations the report card trains on
            carry none).
        constrain: write each call under the grammar of a call to one of the tools (name, then arguments valid
            against its JSON schema) when every tool has a definition; else read the reply as written.
        on_call: called with each :class:`ToolCallRecord` once its result is known (``decoderlab chat`` shows it).

    Returns:
        :class:`ToolTurn`.

    Raises:
        ValueError: bad messages, a template that writes no tool calls, ``max_calls`` < 0, bad sampling values.
    """
    turn = _turn(model, tokenizer, messages, template, tools, SamplingParams.of(params, **sampling),
                 max_calls=max_calls, offer=offer, constrain=constrain, on_call=on_call)
    try:
        ask = next(turn)
        while True:
            ask = turn.send(_answer(model, tokenizer, ask))
    except StopIteration as end:
        return end.value


def run_tool_turns(model, tokenizer: Tokenizer, conversations: Sequence[Sequence[dict]],
                   template: str | ChatTemplate | None, tools: Mapping[str, Tool | Callable[[str], str]],
                   params: SamplingParams | int | None = None, *, batch_size: int = 64,
                   max_calls: int = DEFAULT_MAX_CALLS, offer: bool | None = None, constrain: bool = True,
                   **sampling) -> list[ToolTurn]:
    """:func:`run_tool_turn` for each of ``conversations`` (each ending with a user message), their
    generations run together: at each round every turn still going asks for its next generation, and those
    stopped by tokens (the ``"tools"`` template's) go through
    :func:`~decoderlab.generation.generate_batch`, ``batch_size`` rows at a time -- so turn i is
    ``run_tool_turn(model, tokenizer, conversations[i], ...)``'s, token for token, at a batch's cost. A
    template that writes calls as text (Hugging Face's ``<tool_call>``) stops on strings: those generations run
    one at a time, as in :func:`run_tool_turn`.

    Returns: one :class:`ToolTurn` per conversation. Raises: what :func:`run_tool_turn` raises, and
    ValueError for ``batch_size`` < 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    params = SamplingParams.of(params, **sampling)
    going = {i: _turn(model, tokenizer, c, template, tools, params, max_calls=max_calls, offer=offer,
                      constrain=constrain, on_call=None) for i, c in enumerate(conversations)}
    turns: list[ToolTurn | None] = [None] * len(conversations)
    asks = {i: _next(going, turns, i, None) for i in list(going)}
    while asks := {i: a for i, a in asks.items() if a is not None}:
        answers = {i: _answer(model, tokenizer, a) for i, a in asks.items() if a.text}
        batched = [i for i, a in asks.items() if not a.text]
        for k in range(0, len(batched), batch_size):
            rows = batched[k : k + batch_size]
            got = generate_batch(model, [asks[i].ids for i in rows],
                                 [asks[i].params.replace(stop=tuple(asks[i].stops)) for i in rows],
                                 tokenizer=tokenizer, return_stops=True)
            answers.update(zip(rows, got))
        asks = {i: _next(going, turns, i, answers[i]) for i in asks}
    return turns


def _next(going: dict, turns: list, i: int, answer) -> _Ask | None:
    """Turn i's next ask after ``answer`` (None: its first), or None when it has ended (its turn in ``turns``)."""
    try:
        return next(going[i]) if answer is None else going[i].send(answer)
    except StopIteration as end:
        turns[i] = end.value
        del going[i]
        return None


def _turn(model, tokenizer, messages, template, tools, params: SamplingParams, *, max_calls, offer, constrain,
          on_call):
    """The tool loop of one turn, checked at the call (:func:`_checked`); a generator that yields each
    generation it needs (:class:`_Ask`), is sent its answer, and returns the :class:`ToolTurn`."""
    template, fmt, grammar, offered = _checked(tokenizer, template, tools, max_calls, offer, constrain)
    return _loop(model, tokenizer, list(messages), template, tools, params, max_calls, fmt, grammar, offered,
                 on_call)


def _checked(tokenizer, template, tools, max_calls, offer, constrain) -> tuple:
    """``(template, its call format, the calls' grammar or None, the definitions offered or None)``; raises
    ValueError for a template that writes no calls or a bad ``max_calls``."""
    template = tools_template(get_template(template))  # SmolLM2's ChatML: chatml-tools, its tool-call extension
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
        raise ValueError(f"max_calls must be an integer >= 0, got {max_calls!r}")
    fmt = check_tool_template(template, tokenizer)
    grammar = _call_grammar(tools, fmt) if constrain else None
    offer = fmt == HERMES if offer is None else offer
    return template, fmt, grammar, (_definitions(tools) if offer else None) or None


def _loop(model, tokenizer, convo, template, tools, params, max_calls, fmt, grammar, offered, on_call):
    max_len = model.config.max_len
    step = _token_step if fmt == TOOL_TOKENS else _hermes_step
    turn = ToolTurn("")
    while True:
        ids, _ = template.render(_rendered(convo, template), tokenizer, add_generation_prompt=True, tools=offered)
        room = min(params.max_new_tokens, max_len - len(ids))
        if room <= 0:
            return _finish(turn, "", "length")
        got = yield from step(model, tokenizer, template, ids, params, room, grammar, max_calls - len(turn.calls))
        if got.finish is not None:
            return _finish(turn, got.content, got.finish)
        added = _call_messages(turn, got)
        room = _result_room(template, tokenizer, convo, added, offered, max_len)
        for call, message in zip(got.calls, added[1:]):
            result = f"error: {call.error}" if call.error else _run(tools, call.name or "?", call.arguments)
            message["content"] = fit_result(result, tokenizer, room)
            record = ToolCallRecord(call.name or "?", call.arguments, message["content"], message["tool_call_id"])
            turn.calls.append(record)
            if on_call is not None:
                on_call(record)
        convo += added
        turn.messages += added


def _call_messages(turn: ToolTurn, step: _Step) -> list[dict]:
    """The assistant message of ``step``'s calls (ids ``call_N``, counting the turn's calls) and one tool
    message per call, its result still empty."""
    ids = [f"call_{len(turn.calls) + k}" for k in range(len(step.calls))]
    calls = [{"id": i, "type": "function", "function": {"name": c.name or "?", "arguments": c.arguments}}
             for i, c in zip(ids, step.calls)]
    return [{"role": "assistant", "content": step.content, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": i, "content": ""} for i in ids)]


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
        ValueError: a template that writes no tool calls (:func:`check_tool_template`).
    """

    def __init__(self, model, tokenizer, template: ChatTemplate, tools: Mapping[str, Tool], params=None, *,
                 system: str | None = None, max_calls: int = DEFAULT_MAX_CALLS, **sampling):
        super().__init__(model, tokenizer, template, params, system=system, **sampling)
        self.template = tools_template(self.template)  # (the same text as before for a turn without tools)
        check_tool_template(self.template, tokenizer)
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
