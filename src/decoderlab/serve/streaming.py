"""The one streaming adapter: the scheduler's events -> a JSON response, or server-sent events (SSE), for
both text-generating endpoint families.

An endpoint family (completions, chat completions) is a :class:`Family`: how its choices and chunks look.
:func:`respond` submits the generation and answers either way; the events are the scheduler's
(``("delta", index, text, logprob_items)``, ``("finish", index, reason)``, ``("done", usage)``,
``("error", exception)``). A stream is ``data: {chunk}`` events: an opening chunk per choice, one per piece of
text, one with the finish reason per choice, the usage chunk (``stream_options.include_usage``), then
``data: [DONE]``. A failure mid-stream ends it with an error event in OpenAI's shape (generic text; the
exception goes to the log). A client that hangs up cancels its rows at the next token.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from .errors import internal_error, log
from .metrics import Timing
from .generation import Settings, event_queue, submit
from .protocol import Usage
from .state import AppState


def streamed(chunk: type[BaseModel]) -> dict:
    """The OpenAPI description of an answer that is JSON, or with ``stream: true`` SSE of ``chunk`` s."""
    return {"description": f"the answer; with `stream: true` server-sent events instead: `data: <{chunk.__name__}>` "
                           f"events, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}}


class Family(Protocol):
    """How one endpoint family's answers look (see :mod:`.completions` and :mod:`.chat_completions`)."""

    id_prefix: str

    def response(self, head: dict, texts: list[str], finish: list, logprobs: list | None,
                 usage: Usage) -> BaseModel: ...

    def chunk(self, head: dict, choices: list, usage: Usage | None) -> BaseModel: ...

    def opening(self, index: int): ...

    def delta(self, index: int, text: str, logprobs: list | None, offset: int): ...

    def finish(self, index: int, reason: str): ...


@dataclass
class Collected:
    """A finished non-streamed generation: per choice its text, finish reason and logprob items."""

    texts: list[str]
    finish: list
    logprobs: list[list[dict]]
    usage: Usage


@dataclass
class Echo:
    """The prompt an ``echo`` answer starts with: its text and, with logprobs, its tokens' logprob items (the
    first with logprob None: nothing predicts it)."""

    text: str
    items: list[dict]
    tokens: int


def best_of(got: Collected, n: int) -> Collected:
    """The ``n`` choices with the highest mean logprob per token (OpenAI's "best"), best first, as choices
    0 .. n-1."""
    def mean(i: int) -> float:
        lps = [it["logprob"] for it in got.logprobs[i]]
        return sum(lps) / len(lps) if lps else float("-inf")

    keep = sorted(range(len(got.texts)), key=mean, reverse=True)[:n]
    return Collected([got.texts[i] for i in keep], [got.finish[i] for i in keep],
                     [got.logprobs[i] for i in keep], got.usage)


def usage_of(u: dict) -> Usage:
    return Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                 total_tokens=u["prompt_tokens"] + u["completion_tokens"])


def sse(model: BaseModel, **dump) -> str:
    return f"data: {model.model_dump_json(**dump)}\n\n"


async def collect(request: Request, req, queue: asyncio.Queue, n: int, timing: Timing | None = None) -> Collected | None:
    """Wait for every choice; None if the client hung up (its rows are cancelled)."""
    timing = timing or Timing(None)
    got = Collected([""] * n, [None] * n, [[] for _ in range(n)], Usage(prompt_tokens=0, completion_tokens=0,
                                                                         total_tokens=0))
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                ev = None
            if loop.time() - checked >= 0.25:  # a client that hung up stops its generation
                checked = loop.time()
                if await request.is_disconnected():
                    req.cancel()
                    return None
            if ev is None:
                continue
            if ev[0] == "delta":
                got.texts[ev[1]] += ev[2]
                got.logprobs[ev[1]].extend(ev[3])
                if ev[2]:
                    timing.text(ev[1])
            elif ev[0] == "finish":
                got.finish[ev[1]] = ev[2]
            elif ev[0] == "done":
                got.usage = usage_of(ev[1])
                timing.done(ev[1])
                return got
            elif ev[0] == "error":
                raise ev[1]
    except asyncio.CancelledError:
        req.cancel()
        raise


async def events(family: Family, head: dict, choices: int, settings: Settings, include_usage: bool, req,
                 queue: asyncio.Queue, echoes: list[Echo] | None = None,
                 timing: Timing | None = None) -> AsyncIterator[str]:
    """The SSE text of a streamed generation of ``choices`` choices (see the module docstring); prompt p's
    ``echo`` is the first delta of its first choice (index p * n)."""
    dump = {} if include_usage else {"exclude": {"usage"}}
    wants_lp = settings.logprobs is not None
    offsets = [0] * choices
    timing = timing or Timing(None)
    try:
        for i in range(choices):
            yield sse(family.chunk(head, [family.opening(i)], None), **dump)
        for p, echo in enumerate(echoes or ()):
            i = p * settings.n
            yield sse(family.chunk(head, [family.delta(i, echo.text, echo.items if wants_lp else None, 0)], None),
                      **dump)
            offsets[i] = len(echo.text)
        while True:
            ev = await queue.get()
            if ev[0] == "delta":
                _, i, text, items = ev
                if text:
                    timing.text(i)
                yield sse(family.chunk(head, [family.delta(i, text, items if wants_lp else None, offsets[i])], None),
                          **dump)
                offsets[i] += len(text)
            elif ev[0] == "finish":
                yield sse(family.chunk(head, [family.finish(ev[1], ev[2])], None), **dump)
            elif ev[0] == "done":
                timing.done(ev[1])
                if include_usage:
                    yield sse(family.chunk(head, [], usage_of(ev[1])))
                yield "data: [DONE]\n\n"
                return
            elif ev[0] == "error":
                log.error("generation failed mid-stream", exc_info=ev[1])
                yield sse(internal_error().body())
                return
    finally:  # a normal end, a hang-up (cancelled) or an error: the rows stop at the next token
        req.cancel()


class _Batch:
    """The requests of a batch of prompts as one: prompt p's choice i is choice ``p * per + i`` of the answer,
    the usage is the sum, ``("done", usage)`` comes once every prompt's has, ``cancel`` cancels them all."""

    def __init__(self, on_event: Callable[[tuple], None], prompts: int, per: int):
        self.on_event, self.per, self.left, self.reqs = on_event, per, prompts, []
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.lock = threading.Lock()

    def feed(self, p: int) -> Callable[[tuple], None]:
        def on_event(ev: tuple) -> None:
            if ev[0] in ("delta", "finish"):
                ev = (ev[0], p * self.per + ev[1], *ev[2:])
            elif ev[0] == "done":
                with self.lock:
                    for k in self.usage:
                        self.usage[k] += ev[1][k]
                    self.left -= 1
                    if self.left:
                        return
                    ev = ("done", dict(self.usage))
            self.on_event(ev)
        return on_event

    def cancel(self) -> None:
        for req in self.reqs:
            req.cancel()


def _submit_all(state: AppState, settings: Settings, prompts: list[list[int]], stop_ids: list[int],
                echoes: list[Echo] | None) -> tuple[_Batch, asyncio.Queue]:
    """Every prompt's choices on the scheduler, their events in one queue; an echoed prompt with
    ``max_tokens`` 0 generates nothing (its choice finishes at once, "length")."""
    queue, on_event = event_queue()
    batch = _Batch(on_event, len(prompts), settings.choices)
    try:
        for p, ids in enumerate(prompts):
            feed = batch.feed(p)
            if echoes is not None and settings.max_tokens == 0:
                feed(("finish", 0, "length"))
                feed(("done", {"prompt_tokens": echoes[p].tokens, "completion_tokens": 0}))
            else:
                batch.reqs.append(submit(state, settings, ids, stop_ids, feed))
    except BaseException:
        batch.cancel()
        raise
    return batch, queue


def _grouped_best_of(got: Collected, prompts: int, settings: Settings) -> Collected:
    """``best_of`` within each prompt's choices."""
    per, parts = settings.choices, []
    for p in range(prompts):
        sl = slice(p * per, (p + 1) * per)
        parts.append(best_of(Collected(got.texts[sl], got.finish[sl], got.logprobs[sl], got.usage), settings.n))
    return Collected([t for c in parts for t in c.texts], [f for c in parts for f in c.finish],
                     [lp for c in parts for lp in c.logprobs], got.usage)


async def respond(request: Request, state: AppState, family: Family, settings: Settings,
                  prompts: list[list[int]], stop_ids: list[int], *, stream: bool, include_usage: bool,
                  echoes: list[Echo] | None = None) -> Response:
    """Generate ``settings.choices`` continuations of each of ``prompts`` (token ids) and answer as ``family``
    (JSON, or SSE when ``stream``): prompt-major, prompt p's choices at indices p * n .. p * n + n - 1; the ``n``
    best with ``best_of``; each prompt's first choice after its ``echoes`` entry (only the prompt when
    ``max_tokens`` is 0). A failed generation raises (the route answers a generic 500)."""
    timing = Timing(state.metrics)
    batch, queue = _submit_all(state, settings, prompts, stop_ids, echoes)
    head = {"id": family.id_prefix + uuid.uuid4().hex[:24], "created": int(time.time()), "model": state.model_id}
    if stream:
        return StreamingResponse(events(family, head, len(prompts) * settings.n, settings, include_usage, batch,
                                        queue, echoes, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    got = await collect(request, batch, queue, len(prompts) * settings.choices, timing)
    if got is None:
        return JSONResponse({}, status_code=499)
    if settings.best_of is not None:
        got = _grouped_best_of(got, len(prompts), settings)
    for p, echo in enumerate(echoes or ()):
        i = p * settings.n
        got.texts[i] = echo.text + got.texts[i]
        got.logprobs[i] = echo.items + got.logprobs[i]
    lps = got.logprobs if settings.logprobs is not None else None
    return JSONResponse(family.response(head, got.texts, got.finish, lps, got.usage).model_dump(mode="json"))
