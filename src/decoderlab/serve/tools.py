"""Tool calls on ``/v1/chat/completions``: ``tools`` + ``tool_choice`` checked, and a turn that may call one.

Any chat template that writes tool calls decoderlab reads (its ``tool_call_format``): decoderlab's ``"tools"``
template (a ``<|tool_call|>`` token, then ``NAME {ARGUMENTS}``), or a Hugging Face template that writes each call
as JSON between ``<tool_call>`` and ``</tool_call>`` (decoderlab's ``"chatml-tools"``, Qwen2.5's, Qwen3's:
:mod:`decoderlab.chat.hermes`) -- SmolLM2-Instruct's ChatML is served with ``"chatml-tools"`` when a request
brings tools (:meth:`AppState.chat_template`); any other template answers ``tools`` with a 400.

A turn runs in up to two generations on the scheduler. With ``tool_choice: "auto"`` the model first writes as
usual; the call's opener -- the ``<|tool_call|>`` token (an end-of-text token), or the text ``<tool_call>``
(a stop string) -- ends that text, and then -- only then -- the call follows: a second generation from the
prompt, the text and the opener, constrained by the grammar of a call in the template's format (a function's
name, then arguments valid against its parameters' JSON schema: :class:`decoderlab.chat.ToolSet`), which ends
the turn when the JSON is complete (``finish_reason: "tool_calls"``; ``"stop"`` for a function forced by name,
as OpenAI answers). ``"required"`` and a named function skip the first; ``"none"`` bans the opener where it is
one token (any text a model writes then stays its content).
One call per turn (``parallel_tool_calls`` is accepted and ignored).

:func:`turn_events` is the turn as events -- ``("content", text)``, ``("call", name, id)``, ``("arguments",
text)``, ``("finish", reason)``, ``("done", usage)`` -- read by :func:`answer` (JSON or server-sent events as
OpenAI streams tool calls: the call's id, type and name with arguments ``""``, then argument pieces).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat import ToolSet, encode_text
from ..chat.hermes import CALL_BREAK, OPENER
from ..chat.jinja import encode_with_offsets
from ..chat.templates import TOOL_TOKENS
from ..chat.tools import ToolError
from .errors import bad, internal_error, log
from .generation import Settings, event_queue, submit
from .metrics import Timing
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta, Usage)
from .state import AppState
from .streaming import sse, usage_of


class HungUp(Exception):
    """The client of a non-streamed turn hung up (its generation is cancelled)."""


@dataclass(frozen=True)
class ToolTurn:
    """A request's tools, checked: the functions, the choice ("auto", "required", "named", "none"), the
    named function, the template's tool-call format ("tokens" or "hermes"), the id of its end of turn and of
    the token that opens a call (None: a template whose opener is text the tokenizer spells in pieces)."""

    tools: ToolSet
    choice: str
    name: str | None
    format: str
    end_id: int
    tool_call_id: int | None


def check_tools(state: AppState, tools: list[dict] | None) -> ToolSet | None:
    """The ``tools`` of a request, checked (None without them): a 400 naming ``tools`` for a template that writes
    no tool calls decoderlab reads or a bad definition (:class:`decoderlab.chat.ToolSet`). Chat completions and
    ``/tokenize``."""
    if not tools:
        return None
    if getattr(state.chat_template(True), "tool_call_format", None) is None:
        raise bad("tools", f"the model {state.model_id!r} has a chat template that writes no tool calls "
                           f"decoderlab reads ({getattr(state.template, 'name', '?')!r}); fine-tune it with the "
                           f"\"tools\" or \"chatml-tools\" template, or serve a template that writes each call "
                           f"as JSON between <tool_call> and </tool_call> (as Qwen2.5's does)")
    try:
        return ToolSet.of(tools)
    except ToolError as e:
        raise bad(e.param, str(e)) from None


def tool_turn(state: AppState, body: ChatCompletionRequest, settings: Settings) -> ToolTurn | None:
    """The request's tools (None without ``tools``). Raises a 400 naming the field: a ``tool_choice`` without
    tools or naming a function not offered, a bad definition (:class:`decoderlab.chat.ToolSet`), a template
    that writes no tool calls, and what a tool call cannot combine with (``n`` > 1, ``logprobs``, a
    ``response_format`` or guided field)."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad("tool_choice", "tool_choice needs tools (the functions the model may call)")
        return None
    tools = check_tools(state, body.tools)
    try:
        choice = body.tool_choice
        name = None if choice is None or isinstance(choice, str) else choice.function.name
        if name is not None:
            tools.grammar(name)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    mode = "named" if name is not None else (choice or "auto")
    if mode != "none":
        for field, given in (("n", settings.n > 1), ("logprobs", settings.logprobs is not None),
                             (settings.grammar_param, settings.grammar_param is not None)):
            if given:
                raise bad(field, f"{field} cannot be combined with tools (tool_choice {mode!r}); this server "
                                 f"calls one tool per turn, in one choice, without logprobs")
    template = state.chat_template(True)  # (SmolLM2's ChatML: chatml-tools)
    tok, fmt = state.tokenizer, template.tool_call_format
    if mode != "none":  # a call this vocabulary cannot write is refused now, not mid-stream
        try:
            settings.params.replace(grammar=tools.grammar(name, format=fmt)).bind(state.model.config.num_tokens, tok)
            if fmt != TOOL_TOKENS:
                tok.encode(OPENER + CALL_BREAK)
        except (KeyError, ValueError) as e:
            raise bad("tools", f"tools: a call cannot be written with this model's vocabulary: {e}",
                      "invalid_grammar") from None
    opener = template.tool_call_id(tok) if fmt == TOOL_TOKENS else tok.token_to_id.get(OPENER)
    return ToolTurn(tools, mode, name, fmt, int(template.end_of_turn_id(tok)),
                    None if opener is None else int(opener))


def banned_calls(settings: Settings, turn: ToolTurn) -> Settings:
    """``tool_choice: "none"``: the settings with the token that opens a call banned (logit bias -100); as they
    are when the opener is text of several tokens."""
    if turn.tool_call_id is None:
        return settings
    bias = dict(settings.params.logit_bias or ())
    bias[turn.tool_call_id] = -100.0
    return dataclasses.replace(settings, params=settings.params.replace(logit_bias=bias))


async def _generation(request: Request, state: AppState, settings: Settings, ids: list[int], stop_ids: list[int],
                      poll: bool) -> AsyncIterator[tuple]:
    """The scheduler's events of one generation; a client that hung up (checked when ``poll``) cancels it."""
    queue, on_event = event_queue()
    req = submit(state, settings, ids, stop_ids, on_event)
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if poll and await request.is_disconnected():
                    raise HungUp from None
                continue
            if ev[0] == "error":
                raise ev[1]
            yield ev
            if ev[0] == "done":
                return
    finally:
        req.cancel()


class _TokenCall:
    """The ``"tools"`` template's call text, ``NAME {ARGUMENTS}``, as events: the call once its name is written
    (at the space), then the arguments' pieces."""

    def __init__(self):
        self.text, self.named = "", False

    def feed(self, piece: str) -> list[tuple]:
        if self.named:
            return [("arguments", piece)]
        self.text += piece
        if " " not in self.text:
            return []
        self.named, (name, _, rest) = True, self.text.partition(" ")
        return [("call", name, _call_id())] + ([("arguments", rest)] if rest else [])

    def end(self, complete: bool) -> list[tuple]:
        return []


class _HermesCall:
    """A ``<tool_call>`` block's JSON, ``{"name": "NAME", "arguments": {ARGUMENTS}}``, as events: the call once
    its name is written, then the arguments' pieces -- the last character held back, the object's own closing
    brace, dropped when the call is complete."""

    HEAD, MIDDLE = '{"name": "', '", "arguments": '

    def __init__(self):
        self.text, self.named, self.sent = "", False, 0

    def feed(self, piece: str) -> list[tuple]:
        self.text += piece
        events = []
        if not self.named:
            at = self.text.find(self.MIDDLE)
            if at < 0:
                return []
            self.named, self.sent = True, at + len(self.MIDDLE)
            events.append(("call", self.text[len(self.HEAD):at], _call_id()))
        if len(self.text) - 1 > self.sent:
            events.append(("arguments", self.text[self.sent:-1]))
            self.sent = len(self.text) - 1
        return events

    def end(self, complete: bool) -> list[tuple]:
        rest = self.text[self.sent:]
        rest = rest[:-1] if complete and rest.endswith("}") else rest
        return [("arguments", rest)] if self.named and rest else []


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _opened(state: AppState, turn: ToolTurn, stop: tuple | None) -> bool:
    """Whether the stop that ended the text is the opener of a call (the token, or the text's tokens)."""
    if turn.format == TOOL_TOKENS:
        return stop == (turn.tool_call_id,)
    return bool(stop) and OPENER in state.tokenizer.decode(list(stop))


def _call_prompt(state: AppState, turn: ToolTurn, ids: list[int], content: str) -> list[int]:
    """The prompt of a call: the turn's prompt, its text so far and the opener, as the template writes them."""
    if turn.format == TOOL_TOKENS:
        return ids + (encode_text(state.tokenizer, content) if content else []) + [turn.tool_call_id]
    return ids + encode_with_offsets(state.tokenizer, content + OPENER + CALL_BREAK)[0]


async def _text_events(request, state, settings, ids, turn, poll, result: dict) -> AsyncIterator[tuple]:
    """``tool_choice: "auto"``: the model's text up to the end of turn or a call's opener, as ``content``
    events; ``result`` gets the text, the finish reason, the stop and the tokens produced."""
    stop_ids = [turn.end_id] + ([turn.tool_call_id] if turn.format == TOOL_TOKENS else [])
    if turn.format != TOOL_TOKENS:
        settings = dataclasses.replace(settings, params=settings.params.replace(stop=(*settings.stop, OPENER)))
    async for ev in _generation(request, state, settings, ids, stop_ids, poll):
        if ev[0] == "delta" and ev[2]:
            result["content"] += ev[2]
            yield "content", ev[2]
        elif ev[0] == "finish":
            result["reason"], result["stop"] = ev[2], (ev[3] if len(ev) > 3 else None)
        elif ev[0] == "done":
            result["produced"] = ev[1]["completion_tokens"]


async def turn_events(request: Request, state: AppState, settings: Settings, ids: list[int], turn: ToolTurn,
                      poll: bool = False) -> AsyncIterator[tuple]:
    """The events of a turn that may call a tool (see the module docstring)."""
    first = {"content": "", "reason": None, "stop": None, "produced": 0}
    if turn.choice == "auto":
        async for ev in _text_events(request, state, settings, ids, turn, poll, first):
            yield ev
        if not _opened(state, turn, first["stop"]):
            yield "finish", first["reason"]
            yield "done", {"prompt_tokens": len(ids), "completion_tokens": first["produced"]}
            return
    produced, call_prompt = first["produced"], _call_prompt(state, turn, ids, first["content"])
    left = min(settings.max_tokens - produced, state.max_len - len(call_prompt))
    if left <= 0:
        yield "finish", "length"
        yield "done", {"prompt_tokens": len(ids), "completion_tokens": produced}
        return
    params = settings.params.replace(grammar=turn.tools.grammar(turn.name, format=turn.format),
                                     max_new_tokens=left, stop=None)
    call, reason = _TokenCall() if turn.format == TOOL_TOKENS else _HermesCall(), None
    async for ev in _generation(request, state, dataclasses.replace(settings, params=params), call_prompt,
                                [turn.end_id], poll):
        if ev[0] == "delta" and ev[2]:
            for out in call.feed(ev[2]):
                yield out
        elif ev[0] == "finish":
            # OpenAI's (and vLLM's): a call the request forced by name ends with "stop", any other "tool_calls"
            reason = ("stop" if turn.choice == "named" else "tool_calls") if ev[2] == "stop" else ev[2]
        elif ev[0] == "done":
            produced += ev[1]["completion_tokens"]
    for out in call.end(reason in ("stop", "tool_calls")):
        yield out
    yield "finish", reason
    yield "done", {"prompt_tokens": len(ids), "completion_tokens": produced}


def _head(state: AppState) -> dict:
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": state.model_id}


async def _collected(request, state, settings, ids, turn, timing) -> AssistantMessage | None:
    content, calls, finish, usage = "", [], None, None
    async for ev in turn_events(request, state, settings, ids, turn, poll=True):
        if ev[0] == "content":
            timing.text(0)
            content += ev[1]
        elif ev[0] == "call":
            calls.append(ToolCall(id=ev[2], function=FunctionCall(name=ev[1], arguments="")))
        elif ev[0] == "arguments":
            timing.text(0)
            calls[-1].function.arguments += ev[1]
        elif ev[0] == "finish":
            finish = ev[1]
        else:
            usage = ev[1]
    timing.done(usage)
    message = AssistantMessage(content=content or (None if calls else ""), tool_calls=calls or None)
    return ChatCompletionResponse(**_head(state), usage=usage_of(usage), choices=[
        ChatChoice(index=0, message=message, finish_reason=finish)])


async def _streamed(request, state, settings, ids, turn, include_usage: bool, timing) -> AsyncIterator[str]:
    head, dump = _head(state), {} if include_usage else {"exclude": {"usage"}}

    def chunk(delta: ChatDelta | None = None, finish=None, usage: Usage | None = None) -> str:
        choices = [] if delta is None else [ChatChunkChoice(index=0, delta=delta, finish_reason=finish)]
        return sse(ChatCompletionChunk(**head, choices=choices, usage=usage), **({} if usage else dump))

    yield chunk(ChatDelta(role="assistant", content=""))
    try:
        async for ev in turn_events(request, state, settings, ids, turn):
            if ev[0] in ("content", "arguments"):
                timing.text(0)
            if ev[0] == "content":
                yield chunk(ChatDelta(content=ev[1]))
            elif ev[0] == "call":
                yield chunk(ChatDelta(tool_calls=[ToolCallDelta(index=0, id=ev[2], type="function", function=(
                    FunctionDelta(name=ev[1], arguments="")))]))
            elif ev[0] == "arguments":
                yield chunk(ChatDelta(tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=ev[1]))]))
            elif ev[0] == "finish":
                yield chunk(ChatDelta(), finish=ev[1])
            else:
                timing.done(ev[1])
                if include_usage:
                    yield chunk(usage=usage_of(ev[1]))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 -- the stream has begun: an error event in OpenAI's shape, logged
        log.error("generation failed mid-stream", exc_info=e)
        yield sse(internal_error().body())


async def answer(request: Request, state: AppState, settings: Settings, ids: list[int], turn: ToolTurn, *,
                 stream: bool, include_usage: bool) -> Response:
    """The turn as OpenAI answers it: JSON (``message.tool_calls``, ``finish_reason: "tool_calls"``, or ``"stop"``
    for a function forced by name) or, with
    ``stream``, server-sent events."""
    timing = Timing(state.metrics)
    if stream:
        return StreamingResponse(_streamed(request, state, settings, ids, turn, include_usage, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        got = await _collected(request, state, settings, ids, turn, timing)
    except HungUp:
        return JSONResponse({}, status_code=499)
    return JSONResponse(got.model_dump(mode="json"))
