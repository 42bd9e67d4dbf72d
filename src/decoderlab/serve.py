"""An OpenAI-compatible HTTP server for a decoderlab model, and the live glass-box page.

``create_app(model, tokenizer, ...)`` returns a FastAPI app; ``serve(checkpoint, ...)`` runs it with uvicorn
(``decoderlab serve --checkpoint DIR``). Generation runs on the :class:`decoderlab.generation.scheduler.Scheduler`'s
thread (continuous batching), never on the event loop.

Endpoints:
    GET  /health                  {"status": "ok", ...}; never needs the API key.
    GET  /v1/models               the model: id, max_len, vocab_size, parameters, chat_template.
    GET  /v1/models/{id}          one model (404 for another id).
    POST /v1/completions          any checkpoint: ``prompt`` (text, or token ids).
    POST /v1/chat/completions     chat checkpoints: ``messages`` rendered with the checkpoint's chat template.
    POST /v1/decoderlab/trace     glass-box numbers of ``decoderlab.trace`` for the page.
    GET  /                        the page (one self-contained HTML file, nothing fetched elsewhere).

Request fields: ``model``, ``prompt`` / ``messages``, ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0 = greedy; a given 0 is never replaced), ``top_p``, ``top_k`` (0, -1 or null: no filter),
``stop`` (a string or up to 4, matched on the decoded text; one the tokenizer cannot write is left out),
``seed``, ``n``, ``stream``, ``stream_options.include_usage``,
``logprobs`` / ``top_logprobs``. A field that would change the output and is not supported is a 400 naming it;
metadata fields (``user``, ``metadata``, ``store``, ...) are ignored. Each choice is the text
``decoderlab.generate`` gives with the same settings and the tokenizer: ``<PAD>`` is never sampled and ``<EOS>``
(and a chat template's end of turn) ends it.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad request (also for
request-validation errors and limits), 401 missing/wrong API key, 404 unknown model or route, 429 queue full
(with ``Retry-After``), 500 (with ``x-should-retry: false``); during a stream the error is sent as an event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config.limits import ServeLimits
from .generation import Sampler
from .generation.sampling import check_int, check_sampling, check_seed, is_integer
from .generation.stops import parse_stops
from .generation.scheduler import GenerationRequest, QueueFull, Scheduler, SchedulerClosed
from .glassbox import trace

from .chat import load_model, template_from_meta


#: request limits (one definition, in the config floor, which ``decoderlab serve --help`` reads too)
Limits = ServeLimits


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# fields that change nothing about the output (ignored)
_METADATA = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
             "stream_options", "parallel_tool_calls"}
# fields that would change the output, accepted only at their neutral value
_NEUTRAL = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "min_p": lambda v: v in (None, 0, 0.0),
    "modalities": lambda v: v is None or v == ["text"],
}
_COMMON = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n",
           "stream", "logprobs"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "top_logprobs"}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------------------------------------
# Request parsing
# ----------------------------------------------------------------------------------------------------------


class _Parsed:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    stop: list[str]
    seed: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed or key in _METADATA:
            continue
        if key in _NEUTRAL:
            if _NEUTRAL[key](value):
                continue
            raise _bad(key, f"{key}={json.dumps(value)[:80]} is not supported by this server (it would change "
                            f"the output); remove it", code="unsupported_parameter")
        raise _bad(key, f"unknown field {key!r}; supported fields: {', '.join(sorted(allowed))}",
                   code="unsupported_parameter")


def _checked(param: str, check, *args):
    """``check(*args)`` (one of :mod:`decoderlab.generation.sampling`'s checks, which name the value and what is
    allowed); its ``TypeError`` / ``ValueError`` becomes a 400 naming ``param``."""
    try:
        return check(*args)
    except (TypeError, ValueError) as e:
        raise _bad(param, str(e)) from None


def _parse_sampling(body: dict, limits: Limits, chat: bool) -> _Parsed:
    """The sampling fields, checked by ``generate``'s own checks (so they mean what they mean there: ``top_k``
    0 = no filter, ``top_p`` 1 keeps every token), plus this API's limits (temperature <= 2, -1 = no top-k)."""
    p = _Parsed()
    mt = body.get("max_completion_tokens") if body.get("max_completion_tokens") is not None else body.get("max_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if mt is None:
        p.max_tokens = min(limits.default_max_tokens, limits.max_tokens)
    else:
        p.max_tokens = _checked(name, check_int, name, mt, 1)
        if p.max_tokens > limits.max_tokens:
            raise _bad(name, f"{name}={mt} is above this server's limit of {limits.max_tokens} tokens "
                             f"(--max-tokens)", code="max_tokens_limit")
    t = body.get("temperature")
    p.temperature = 1.0 if t is None else _checked("temperature", check_sampling, t)[0]
    if p.temperature > 2:
        raise _bad("temperature", f"temperature must be a number from 0 to 2 (0 = greedy), got {json.dumps(t)}")
    tp = body.get("top_p")
    p.top_p = None if tp is None else _checked("top_p", check_sampling, 1.0, None, tp)[2]
    tk = body.get("top_k")
    try:
        p.top_k = None if tk in (None, -1) else check_sampling(1.0, tk)[1]
    except (TypeError, ValueError) as e:
        raise _bad("top_k", f"{e} (0, -1 or null: no top-k filter)") from None
    stop = body.get("stop")
    if stop is None:
        p.stop = []
    else:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", f"stop must be a non-empty string or a list of up to {limits.max_stop} non-empty "
                               f"strings, got {json.dumps(stop)[:80]}")
        if len(stops) > limits.max_stop:
            raise _bad("stop", f"stop has {len(stops)} strings; at most {limits.max_stop} are allowed")
        p.stop = stops
    seed = body.get("seed")
    if seed is not None and not is_integer(seed):
        raise _bad("seed", f"seed must be an integer, got {json.dumps(seed)}")
    p.seed = None if seed is None else _checked("seed", check_seed, seed)
    n = body.get("n")
    p.n = 1 if n is None else _checked("n", check_int, "n", n, 1)
    if p.n > limits.max_n:
        raise _bad("n", f"n={n} is above this server's limit of {limits.max_n} choices", code="n_limit")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"stream must be true or false, got {json.dumps(stream)}")
    p.stream = bool(stream)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise _bad("stream_options", "stream_options must be an object like {\"include_usage\": true}")
        if not p.stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
    p.include_usage = bool(so and so.get("include_usage"))
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise _bad("logprobs", f"logprobs must be true or false, got {json.dumps(lp)}")
        tlp = body.get("top_logprobs")
        if tlp is not None:
            if _checked("top_logprobs", check_int, "top_logprobs", tlp, 0) > 20:
                raise _bad("top_logprobs", f"top_logprobs must be an integer from 0 to 20, got {json.dumps(tlp)}")
            if not lp:
                raise _bad("top_logprobs", "top_logprobs needs logprobs set to true")
        p.logprobs = (tlp or 0) if lp else None
    else:
        if lp is not None and _checked("logprobs", check_int, "logprobs", lp, 0) > 5:
            raise _bad("logprobs", f"logprobs must be an integer from 0 to 5, got {json.dumps(lp)}")
        p.logprobs = lp
    return p


# ----------------------------------------------------------------------------------------------------------
# The app
# ----------------------------------------------------------------------------------------------------------


def page_html() -> str:
    """The glass-box page (``static/index.html`` shipped with the package)."""
    return resources.files("decoderlab").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(model, tokenizer, *, meta: dict | None = None, template: Any = "auto", model_id: str | None = None,
               api_key: str | None = None, cors_origins: list[str] | None = None, limits: Limits | None = None):
    """Build the FastAPI app serving ``model`` (see the module docstring for endpoints, fields and errors).

    Args:
        model, tokenizer: e.g. from ``decoderlab.load_checkpoint``; the app's scheduler thread owns the model.
        meta: the checkpoint's meta.json (for the chat template and the model id).
        template: a chat template (``render(messages, tokenizer, add_generation_prompt=...)`` ->
            (ids, mask) and ``end_of_turn_id(tokenizer)``), None for a base model, or "auto" to take it from
            ``meta`` through ``decoderlab.chat.template_from_meta``.
        model_id: the id clients name (default meta's "name", else "decoderlab").
        api_key: if given, every endpoint but /health and the static page answers 401 without
            ``Authorization: Bearer <api_key>``.
        cors_origins: origins allowed by CORS (None = CORS off); also answers the preflight.
        limits: :class:`Limits`.

    The scheduler starts with the app and stops when uvicorn shuts the app down.
    """
    meta = dict(meta or {})
    limits = limits or Limits()
    if template == "auto":
        template = template_from_meta(meta)
    model_id = model_id or str(meta.get("name") or "decoderlab")
    cfg = model.config
    eos = getattr(tokenizer, "eos_id", None)
    created = int(time.time())
    state: dict[str, Any] = {"scheduler": None}

    def scheduler() -> Scheduler:
        if state["scheduler"] is None:
            state["scheduler"] = Scheduler(model, tokenizer, max_batch=limits.max_batch, max_queue=limits.max_queue)
        return state["scheduler"]

    @asynccontextmanager
    async def lifespan(app):
        scheduler()
        try:
            yield
        finally:
            if state["scheduler"] is not None:
                state["scheduler"].close()

    app = FastAPI(title="decoderlab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.get_scheduler = scheduler

    def error_response(err: APIError) -> JSONResponse:
        headers = dict(err.headers)
        if err.status >= 500:
            headers.setdefault("x-should-retry", "false")
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        loc = errs[0].get("loc", ()) if errs else ()
        param = ".".join(str(x) for x in loc[1:]) or None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return error_response(APIError(400, f"{param or 'request'}: {msg}", param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                                       code="internal_error"))

    # -- API key: a plain ASGI middleware (Starlette's BaseHTTPMiddleware would feed a streaming response a
    # false "disconnect" once the body is read); CORS, added after it, wraps it, so even 401s carry CORS headers
    open_paths = {"/health", "/", "/index.html"}

    class _Auth:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if (api_key is not None and scope["type"] == "http" and scope["path"] not in open_paths
                    and scope["method"] != "OPTIONS"):
                hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
                header = hdrs.get("authorization", "")
                given = header[7:].strip() if header.lower().startswith("bearer ") else hdrs.get("api-key", "")
                if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
                    what = "a wrong API key" if given else "no API key"
                    resp = error_response(APIError(
                        401, f"this server needs an API key ('Authorization: Bearer <key>'); the request had {what}",
                        code="invalid_api_key"))
                    await resp(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    app.add_middleware(_Auth)

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "api-key"], max_age=600)

    async def read_json(request: Request) -> dict:
        limit = limits.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(400, f"the request body is larger than this server's limit of {limit} bytes "
                                f"(--max-body-bytes)", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            async for _ in request.stream():  # drain, so the client gets the answer rather than a reset
                pass
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                async for _ in request.stream():
                    pass
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                           code="invalid_json")
        return body

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is not None and m != model_id:
            raise APIError(404, f"the model {m!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")

    def check_context(ids: list[int], param: str) -> None:
        if len(ids) > cfg.max_len:
            raise APIError(400, f"this model's maximum context length is {cfg.max_len} tokens; the prompt has "
                                f"{len(ids)} tokens", param=param, code="context_length_exceeded")

    def encode_prompt(prompt, window: bool = False) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except (KeyError, ValueError) as e:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else e
                raise _bad("prompt", f"the prompt cannot be encoded by this model's tokenizer: {msg}",
                           code="invalid_prompt") from None
        elif isinstance(prompt, list) and all(is_integer(i) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < cfg.num_tokens]
            if bad:
                raise _bad("prompt", f"token id {bad[0]} is out of range; allowed ids are 0 .. {cfg.num_tokens - 1}")
            ids = list(prompt)
        else:
            raise _bad("prompt", "prompt must be a string, a list of token ids, or a list holding one of these "
                                 "(one prompt per request)")
        if not ids:
            if eos is None:
                raise _bad("prompt", "the prompt is empty and this model has no start token (<EOS>)")
            ids = [eos]
        if window:  # the glass box shows what the model sees: the last max_len tokens
            return ids[-cfg.max_len:]
        check_context(ids, "prompt")
        return ids

    def render_messages(messages, *, add_generation_prompt: bool = True, window: bool = False) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
        if len(messages) > limits.max_messages:
            raise _bad("messages", f"messages has {len(messages)} entries; this server's limit is "
                                   f"{limits.max_messages} (--max-messages)", code="messages_limit")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise _bad(f"messages[{i}].role", f"messages[{i}] must be an object with role system, user or "
                                                  f"assistant, got {json.dumps(m)[:80]}")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
            clean.append({"role": m["role"], "content": content})
        try:
            ids, _mask = template.render(clean, tokenizer, add_generation_prompt=add_generation_prompt)
        except (KeyError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise _bad("messages", f"the messages cannot be rendered with this model's chat template: {msg}",
                       code="invalid_prompt") from None
        ids = list(ids)
        if window:
            return ids[-cfg.max_len:]
        check_context(ids, "messages")
        return ids

    # -- generation bridge ---------------------------------------------------------------------------------
    def producible(stops: list[str]) -> list[str]:
        """The stop strings this model could write. ``generate`` refuses a string its tokenizer cannot encode
        (a ValueError); clients send their usual stops to any model (a character outside a character
        vocabulary), and a stop that can never appear changes no text, so the server leaves it out."""
        out = []
        for s in stops:
            try:
                parse_stops(s, tokenizer, cfg.num_tokens)
            except ValueError:
                continue
            out.append(s)
        return out

    def submit(p: _Parsed, ids: list[int], stop_ids: list[int]) -> tuple[GenerationRequest, asyncio.Queue]:
        """Queue the generation on the scheduler: ``generate``'s semantics with the tokenizer (``<PAD>`` never
        sampled, ``<EOS>`` ends the text, ``p.stop`` matched on the text), plus ``stop_ids``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(ev):
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        req = GenerationRequest(prompt_ids=ids, max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                top_p=p.top_p, stop=producible(p.stop), stop_token_ids=stop_ids, seed=p.seed, n=p.n,
                                logprobs=p.logprobs, on_event=on_event)
        try:
            scheduler().submit(req)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except SchedulerClosed as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        return req, queue

    def stream_error(exc: BaseException) -> APIError:
        return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error",
                        code="generation_failed")

    async def collect(request: Request, req: GenerationRequest, queue: asyncio.Queue, n: int):
        texts = [""] * n
        finish = [None] * n
        lps: list[list] = [[] for _ in range(n)]
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
                kind = ev[0]
                if kind == "delta":
                    texts[ev[1]] += ev[2]
                    lps[ev[1]].extend(ev[3])
                elif kind == "finish":
                    finish[ev[1]] = ev[2]
                elif kind == "done":
                    return texts, finish, lps, ev[1]
                elif kind == "error":
                    raise stream_error(ev[1])
        except asyncio.CancelledError:
            req.cancel()
            raise

    def usage_of(u: dict) -> dict:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}

    def completion_logprobs(items: list[dict], offset0: int = 0) -> dict:
        offsets, pos = [], offset0
        for it in items:
            offsets.append(pos)
            pos += len(it["token"])
        return {"tokens": [it["token"] for it in items], "token_logprobs": [it["logprob"] for it in items],
                "top_logprobs": [{t["token"]: t["logprob"] for t in it["top_logprobs"]} for it in items],
                "text_offset": offsets}

    def chat_logprobs(items: list[dict]) -> dict:
        return {"content": items}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def run(request: Request, body: dict, chat: bool):
        if chat:
            _check_fields(body, _CHAT_FIELDS)
            check_model(body)
            if "messages" not in body:
                raise _bad("messages", "messages is required: a list of {\"role\", \"content\"} objects",
                           code="missing_required_parameter")
            if template is None:
                raise APIError(400, f"the model {model_id!r} is a base model without a chat template: use "
                                    f"/v1/completions, or fine-tune it for chat first (the chat template is "
                                    f"stored in its checkpoint)", param="messages", code="no_chat_template")
            p = _parse_sampling(body, limits, chat=True)
            ids = render_messages(body["messages"])
            stop_ids = [int(template.end_of_turn_id(tokenizer))]  # and <EOS>, as always
        else:
            _check_fields(body, _COMPLETION_FIELDS)
            check_model(body)
            if "prompt" not in body:
                raise _bad("prompt", "prompt is required (a string or a list of token ids)",
                           code="missing_required_parameter")
            p = _parse_sampling(body, limits, chat=False)
            ids = encode_prompt(body["prompt"])
            stop_ids = []  # <EOS> ends the text (generate's stop_at_eos)
        req, queue = submit(p, ids, stop_ids)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())
        if not p.stream:
            got = await collect(request, req, queue, p.n)
            if got is None:
                return JSONResponse({}, status_code=499)
            texts, finish, lps, usage = got
            choices = []
            for i in range(p.n):
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                    "logprobs": chat_logprobs(lps[i]) if p.logprobs is not None else None,
                                    "finish_reason": finish[i]})
                else:
                    choices.append({"index": i, "text": texts[i],
                                    "logprobs": completion_logprobs(lps[i]) if p.logprobs is not None else None,
                                    "finish_reason": finish[i]})
            return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_id,
                                 "system_fingerprint": None, "choices": choices, "usage": usage_of(usage)})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, usage=None) -> str:
            d = {"id": rid, "object": chunk_obj, "created": now, "model": model_id, "system_fingerprint": None,
                 "choices": choices}
            if p.include_usage:
                d["usage"] = usage
            return sse(d)

        async def events():
            offsets = [0] * p.n
            try:
                for i in range(p.n):
                    if chat:
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}])
                    else:
                        yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": None}])
                while True:
                    ev = await queue.get()
                    kind = ev[0]
                    if kind == "delta":
                        _, i, text, items = ev
                        if chat:
                            c = {"index": i, "delta": {"content": text},
                                 "logprobs": chat_logprobs(items) if p.logprobs is not None else None,
                                 "finish_reason": None}
                        else:
                            c = {"index": i, "text": text,
                                 "logprobs": completion_logprobs(items, offsets[i]) if p.logprobs is not None
                                 else None, "finish_reason": None}
                        offsets[i] += len(text)
                        yield chunk([c])
                    elif kind == "finish":
                        _, i, reason = ev
                        if chat:
                            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
                        else:
                            yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": reason}])
                    elif kind == "done":
                        if p.include_usage:
                            yield chunk([], usage_of(ev[1]))
                        yield "data: [DONE]\n\n"
                        return
                    elif kind == "error":
                        yield sse(stream_error(ev[1]).body())
                        return
            finally:  # normal end, a hang-up (cancelled) or an error: the rows stop at the next token
                req.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes --------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        s = state["scheduler"].stats() if state["scheduler"] is not None else {}
        return {"status": "ok", "model": model_id, **s}

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "decoderlab",
                "max_len": cfg.max_len, "vocab_size": cfg.num_tokens, "parameters": model.num_parameters(),
                "n_layer": cfg.n_layer, "n_head": cfg.n_head, "d_model": cfg.d_model,
                "chat_template": getattr(template, "name", True) if template is not None else None,
                "task": meta.get("task")}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, await read_json(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, await read_json(request), chat=True)

    @app.post("/v1/decoderlab/trace")
    async def trace_endpoint(request: Request):
        body = await read_json(request)
        _check_fields(body, {"prompt", "continuation", "messages", "token_ids", "temperature", "top_k", "top_p",
                             "seed", "top", "layers"})
        p = _parse_sampling({k: body[k] for k in ("temperature", "top_k", "top_p", "seed") if k in body},
                            limits, chat=False)
        if body.get("token_ids") is not None:
            ids = encode_prompt(body["token_ids"])
        elif body.get("messages") is not None:
            if template is None:
                raise APIError(400, "this base model has no chat template: trace a prompt instead",
                               param="messages", code="no_chat_template")
            msgs = body["messages"]
            last_assistant = isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and \
                msgs[-1].get("role") == "assistant"
            ids = render_messages(msgs, add_generation_prompt=not last_assistant, window=True)
        elif body.get("prompt") is not None:
            ids = encode_prompt(body["prompt"], window=True)
            cont = body.get("continuation")
            if cont:  # a generated reply, encoded on its own (as it was produced: after the prompt's tokens)
                if not isinstance(cont, str):
                    raise _bad("continuation", "continuation must be a string")
                try:
                    ids = (ids + tokenizer.encode(cont))[-cfg.max_len:]
                except (KeyError, ValueError) as e:
                    raise _bad("continuation", f"the continuation cannot be encoded: {e}",
                               code="invalid_prompt") from None
        else:
            raise _bad("prompt", "give prompt (text), messages, or token_ids", code="missing_required_parameter")
        top = body.get("top", 10)
        if not is_integer(top) or not 1 <= top <= 50:
            raise _bad("top", f"top must be an integer from 1 to 50, got {json.dumps(top)}")
        layers = body.get("layers")
        if layers is not None and (not isinstance(layers, list) or not all(is_integer(x) and 0 <= x < cfg.n_layer
                                                                          for x in layers)):
            raise _bad("layers", f"layers must be a list of layer indices 0 .. {cfg.n_layer - 1}")
        fut = scheduler().call(lambda: trace_numbers(model, tokenizer, ids, p, top, layers))
        return JSONResponse(await asyncio.wrap_future(fut))

    @app.get("/", response_class=HTMLResponse)
    @app.get("/index.html", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})

    return app


def trace_numbers(model, tokenizer, ids: list[int], p: _Parsed, top: int, layers: list[int] | None) -> dict:
    """The page's numbers for ``ids``: ``decoderlab.trace``'s attention percents per layer and head (queries
    down, keys across; masked cells 0 and listed in ``mask``) and the last position's top next-token
    probabilities before (softmax of the logits) and after the sampling filter (``<PAD>`` suppressed,
    temperature, top-k, top-p),
    plus the token the filter's distribution gives next (greedy for temperature 0; else seeded with
    ``seed + len(ids)``, so stepping is reproducible)."""
    tr = trace(model, ids, tokenizer, layers=layers)
    logits = tr.logits[0, -1].float()
    probs = torch.softmax(logits, dim=-1)
    pad = getattr(tokenizer, "pad_id", None)  # never sampled, as in generation
    sampler = Sampler(p.temperature, p.top_k, p.top_p, suppress=() if pad is None else (pad,))
    if sampler.greedy:
        nxt = int(sampler(logits[None], [])[0])
        after = torch.zeros_like(probs)
        after[nxt] = 1.0
    else:
        after = torch.softmax(sampler.filter(logits[None])[0], dim=-1)
        g = torch.Generator().manual_seed((p.seed if p.seed is not None else 0) + len(ids))
        nxt = int(sampler(logits[None], [g])[0])

    def top_list(dist: torch.Tensor) -> list[dict]:
        vals, idx = torch.topk(dist, min(top, dist.numel()))
        return [{"id": int(i), "token": tokenizer.decode([int(i)]), "prob": float(v)}
                for v, i in zip(vals.tolist(), idx.tolist())]

    t = len(ids)
    mask = tr.layers[0].mask if tr.layers else None
    return {
        "token_ids": ids,
        "tokens": [tokenizer.decode([i]) for i in ids],
        "n_layer": model.config.n_layer, "n_head": model.config.n_head,
        "mask": None if mask is None else mask.reshape(t, t).tolist(),
        "layers": [{"layer": lt.index, "heads": lt.heads, "percents": lt.percents[0].tolist()} for lt in tr.layers],
        "top_before": top_list(probs),
        "top_after": top_list(after),
        "next": {"id": nxt, "token": tokenizer.decode([nxt])},
        "sampling": {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed},
    }


class ServerThread:
    """Run an app with uvicorn on a background thread (for tests, benchmarks and notebooks).

    ``with ServerThread(app, port=0) as url: ...``: port 0 picks a free port; ``url`` is ``http://host:port``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket
        import threading

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(checkpoint, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          cors_origins: list[str] | None = None, limits: Limits | None = None, model_id: str | None = None,
          log_level: str = "info") -> None:
    """Load a checkpoint directory and serve it with uvicorn until interrupted (``decoderlab serve``).

    Raises: what ``load_checkpoint`` raises (FileNotFoundError, ValueError) for a bad checkpoint.
    """
    import uvicorn

    model, tokenizer, template, meta = load_model(checkpoint)  # a decoderlab checkpoint or a GPT-2 directory
    if model_id is None and not meta.get("name"):
        model_id = Path(checkpoint).resolve().name
    app = create_app(model, tokenizer, meta=meta, template=template, model_id=model_id, api_key=api_key,
                     cors_origins=cors_origins, limits=limits)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
