"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` and the app's handlers.

400 bad request (request-validation errors included, naming ``param`` as ``messages[1].role``), 401 missing or
wrong API key, 404 unknown model or route, 405, 413 body too large, 429 queue full (``Retry-After``), 503
shutting down, 500 (``x-should-retry: false``). A 500 never carries internal text: the exception goes to the
log (``decoderlab.serve``) and the client reads a generic message with code ``internal_error``.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import REQUIRED_HINTS, ErrorDetail, ErrorResponse

log = logging.getLogger("decoderlab.serve")

#: the text of every 500 (the details are in the server's log)
INTERNAL_MESSAGE = "the server failed to answer this request (its log has the details); it goes on serving"


class APIError(StarletteHTTPException):
    """An error answered in OpenAI's shape. (An ``HTTPException``: FastAPI passes it on unchanged when it is
    raised while the body is read.)"""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(status, message, headers=headers)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code))


#: the error answers of an endpoint with a body, for the OpenAPI schema
ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a bad request: the field is named in `param`"), (401, "a missing or wrong API key"),
    (404, "an unknown model"), (413, "a body over --max-body-bytes"), (429, "the queue is full (Retry-After)"),
    (500, "the server failed (its log has the details)"))}


def bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    return APIError(500, INTERNAL_MESSAGE, type="server_error", code="internal_error")


def error_response(err: APIError) -> JSONResponse:
    headers = dict(err.headers or {})
    if err.status >= 500:
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=headers)


# ----------------------------------------------------------------------------------------------------------
# Validation errors -> 400 naming the field
# ----------------------------------------------------------------------------------------------------------

# pydantic names the member of a union in an error's location ("str", "list[int]", "function-after[...]")
_UNION_TAG = re.compile(r"[\[\]-]|^(str|int|float|bool|none|list|dict)$")

_PHRASES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer", "float_type": "must be a number",
    "float_parsing": "must be a number", "bool_type": "must be true or false", "string_type": "must be a string",
    "list_type": "must be a list", "model_type": "must be an object", "model_attributes_type": "must be an object",
    "dict_type": "must be an object", "finite_number": "must be a finite number",
}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}


def param_of(loc) -> str | None:
    """A pydantic error location (after ``"body"``) as the ``param`` OpenAI names: ``messages[1].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.search(str(part)):
            out += ("." if out else "") + str(part)
    return out or None


def _shown(value) -> str:
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def message_of(err: dict, param: str | None) -> str:
    """One line naming the field, what is allowed and what was given."""
    kind, ctx, name = err.get("type", ""), err.get("ctx") or {}, param or "the request body"
    got = f", got {_shown(err['input'])}" if "input" in err else ""
    if kind == "missing":
        hint = REQUIRED_HINTS.get(param or "")
        return f"{name} is required" + (f": {hint}" if hint else "")
    if kind in _PHRASES:
        return f"{name} {_PHRASES[kind]}{got}"
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"{name} must be {sign} {ctx.get(key)}{got}"
    if kind == "literal_error":
        return f"{name} must be {ctx.get('expected')}{got}"
    if kind in ("too_short", "too_long"):
        return f"{name} must have {'at least' if kind == 'too_short' else 'at most'} " \
               f"{ctx.get('min_length', ctx.get('max_length'))} items{got}"
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', '')}"
    if "param" in ctx:  # ours (protocol.refuse): the message is complete
        return err.get("msg", "invalid request")
    return f"{name}: {err.get('msg', 'invalid value')}{got}"


def from_validation(errors: list[dict]) -> APIError:
    """The 400 for FastAPI's request-validation errors (the first one; each names its field)."""
    if not errors:
        return bad(None, "invalid request")
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    loc = loc[1:] if loc[:1] == ("body",) else loc
    ctx = err.get("ctx") or {}
    kind = err.get("type", "")
    if kind == "json_invalid":
        return bad(None, message_of(err, None), "invalid_json")
    if not loc and kind == "missing":
        return bad(None, "the request body is empty: send a JSON object", "invalid_json")
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        return bad(None, f"the request body must be a JSON object, got {_shown(err.get('input'))}", "invalid_json")
    param = ctx.get("param") or param_of(loc)
    code = "missing_required_parameter" if kind == "missing" else (
        kind if "param" in ctx else "invalid_value")
    return bad(param, message_of(err, param), code)


# ----------------------------------------------------------------------------------------------------------
# Handlers
# ----------------------------------------------------------------------------------------------------------


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # a backstop: routes log and answer their own
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(internal_error())
