"""Reading a request body before FastAPI validates it: the size limit, a client that hangs up, strict JSON.

:class:`JSONRoute` is the route class of every endpoint with a body. It hands FastAPI a :class:`BodyRequest`,
whose ``body()`` reads at most ``--max-body-bytes`` (a larger body is a 413; a client that hangs up before its
``Content-Length`` is complete is one log line, not a traceback) and whose ``json()`` is :func:`loads`. The body
is JSON whatever its ``Content-Type`` says (``curl -d`` sends ``application/x-www-form-urlencoded``).
"""

from __future__ import annotations

import json
import sys

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .errors import APIError, bad, error_response, internal_error, log

#: Python's limit on the digits of an integer read from text (``sys.set_int_max_str_digits``)
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300


class _NotANumber:
    """A JSON number Python cannot (or JSON should not) hold: too many digits, NaN or Infinity."""

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def _number(text: str):
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _NotANumber(text, f"an integer of {digits} digits is more than this server reads (at most "
                                 f"{MAX_INT_DIGITS} digits)")
    return int(text)


def _first_bad(value, path: str = ""):
    """(path, the bad number) of the first :class:`_NotANumber` in ``value``; None if there is none."""
    if isinstance(value, _NotANumber):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_bad(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def loads(raw: bytes):
    """``raw`` as JSON. Raises ``json.JSONDecodeError`` (FastAPI answers it as invalid JSON) and
    :class:`APIError` 400 naming the field that holds a number out of JSON's or Python's range (an integer of
    more than 4,300 digits, ``NaN``, ``Infinity``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(None, f"the request body is not valid JSON: it is not UTF-8 ({e})", "invalid_json") from None
    value = json.loads(text, parse_int=_number,
                       parse_constant=lambda name: _NotANumber(name, f"{name} is not a JSON number"))
    found = _first_bad(value)
    if found is not None:
        path, number = found
        raise bad(path or None, f"{path or 'the request body'}: {number.why}")
    return value


class BodyRequest(Request):
    """A request whose body is read with the server's limits (see the module docstring)."""

    max_body_bytes = 1_000_000

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = await self._read_limited()
        return self._body

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json

    async def _read_limited(self) -> bytes:
        limit, declared = self.max_body_bytes, self.headers.get("content-length", "")
        chunks, size = [], 0
        try:
            over = declared.isdigit() and (len(declared) > 18 or int(declared) > limit)
            async for chunk in self.stream():
                size += len(chunk)
                over = over or size > limit
                if not over:
                    chunks.append(chunk)
        except ClientDisconnect:
            log.info("%s %s: the client hung up after %d of %s bytes of its body", self.method, self.url.path,
                     size, declared or "?")
            raise APIError(499, "the client closed the connection", code="client_closed") from None
        if over:  # read to the end, so that the client gets the answer rather than a reset
            raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                f"(--max-body-bytes)", code="body_too_large")
        return b"".join(chunks)


def _as_json(scope: dict) -> dict:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
    return dict(scope, headers=headers + [(b"content-type", b"application/json")])


class JSONRoute(APIRoute):
    """A route whose body is read by :class:`BodyRequest`; an exception of the route's own code is logged
    with its traceback and answered as a generic 500 (no internal text reaches the client)."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def route(request: Request) -> Response:
            req = BodyRequest(_as_json(request.scope), request.receive)
            req.max_body_bytes = request.app.state.decoderlab.limits.max_body_bytes
            try:
                return await handle(req)
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception:  # noqa: BLE001 -- a bug or a failed generation: logged, answered in OpenAI's shape
                log.exception("%s %s failed", request.method, request.url.path)
                return error_response(internal_error())

        return route
