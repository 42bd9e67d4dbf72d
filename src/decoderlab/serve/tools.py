"""Tool calls on ``/v1/chat/completions``: ``tools`` + ``tool_choice`` checked, and a turn that may call one.

A turn runs in up to two generations on the scheduler. With ``tool_choice: "auto"`` the model first writes as
usual; the template's ``<|tool_call|>`` token (an end-of-text token) ends that text, and then -- only then --
the call follows: a second generation from the prompt, the text and ``<|tool_call|>``, constrained by the
grammar of a call (a function's name, then arguments valid against its parameters' JSON schema:
:class:`decoderlab.chat.ToolSet`), which ends the turn when the JSON is complete (``finish_reason:
"tool_calls"``; ``"stop"`` for a function forced by name, as OpenAI answers). ``"required"`` and a named function
skip the first; ``"none"`` bans ``<|tool_call|>``.
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
    named function, and the ids of the template's tool-call opener and end of turn."""

    tools: ToolSet
    choice: str
    name: str | None
    tool_call_id: int
    end_id: int


def check_tools(state: AppState, tools: list[dict] | None) -> ToolSet | None:
    """The ``tools`` of a request, checked (None without them): a 400 naming ``tools`` for a template without
    tool tokens or a bad definition (:class:`decoderlab.chat.ToolSet`). Chat completions and ``/tokenize``."""
    if not tools:
        return None
    if not getattr(state.template, "has_tools", False):
        raise bad("tools", f"the model {state.model_id!r} has a chat template without tool-call tokens "
                           f"({getattr(state.template, 'name', '?')!r}); fine-tune it with the \"tools\" template")
    try:
        return ToolSet.of(tools)
    except ToolError as e:
        raise bad(e.param, str(e)) from None


def tool_turn(state: AppState, body: ChatCompletionRequest, settings: Settings) -> ToolTurn | None:
    """The request's tools (None without ``tools``). Raises a 400 naming the field: a ``tool_choice`` without
    tools or naming a function not offered, a bad definition (:class:`decoderlab.chat.ToolSet`), a template
    without tool tokens, and what a tool call cannot combine with (``n`` > 1, ``logprobs``, a
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
    tok = state.tokenizer
    if mode != "none":  # a call this vocabulary cannot write is refused now, not mid-stream
        try:
            settings.params.replace(grammar=tools.grammar(name)).bind(state.model.config.num_tokens, tok)
        except ValueError as e:
            raise bad("tools", f"tools: a call cannot be written with this model's vocabulary: {e}",
                      "invalid_grammar") from None
    return ToolTurn(tools, mode, name, int(state.template.tool_call_id(tok)),
                    int(state.template.end_of_turn_id(tok)))


def banned_calls(settings: Settings, turn: ToolTurn) -> Settings:
    """``tool_choice: "none"``: the settings with ``<|tool_call|>`` banned (logit bias -100)."""
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


async def turn_events(request: Request, state: AppState, settings: Settings, ids: list[int], turn: ToolTurn,
                      poll: bool = False) -> AsyncIterator[tuple]:
    """The events of a turn that may call a tool (see the module docstring)."""
    content, produced, call_prompt = "", 0, ids + [turn.tool_call_id]
    if turn.choice == "auto":
        stop = None
        async for ev in _generation(request, state, settings, ids, [turn.end_id, turn.tool_call_id], poll):
            if ev[0] == "delta" and ev[2]:
                content += ev[2]
                yield "content", ev[2]
            elif ev[0] == "finish":
                reason, stop = ev[2], (ev[3] if len(ev) > 3 else None)
            elif ev[0] == "done":
                produced = ev[1]["completion_tokens"]
        if stop != (turn.tool_call_id,):
            yield "finish", reason
            yield "done", {"prompt_tokens": len(ids), "completion_tokens": produced}
            return
        call_prompt = ids + encode_text(state.tokenizer, content) + [turn.tool_call_id]
    left = min(settings.max_tokens - produced, state.max_len - len(call_prompt))
    if left <= 0:
        yield "finish", "length"
        yield "done", {"prompt_tokens": len(ids), "completion_tokens": produced}
        return
    params = settings.params.replace(grammar=turn.tools.grammar(turn.name), max_new_tokens=left, stop=None)
    text, named = "", False
    async for ev in _generation(request, state, dataclasses.replace(settings, params=params), call_prompt,
                                [turn.end_id], poll):
        if ev[0] == "delta" and ev[2]:
            text += ev[2]
            if not named and " " in text:
                named, (name, _, rest) = True, text.partition(" ")
                yield "call", name, "call_" + uuid.uuid4().hex[:24]
                ev = (ev[0], ev[1], rest)
            if named and ev[2]:
                yield "arguments", ev[2]
        elif ev[0] == "finish":
            # OpenAI's (and vLLM's): a call the request forced by name ends with "stop", any other "tool_calls"
            reason = ("stop" if turn.choice == "named" else "tool_calls") if ev[2] == "stop" else ev[2]
        elif ev[0] == "done":
            produced += ev[1]["completion_tokens"]
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
