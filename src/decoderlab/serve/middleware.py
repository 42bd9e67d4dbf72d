"""The API key (a plain ASGI middleware) and CORS.

The key is a plain ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``, which would feed a
streaming response a false "disconnect" once the body is read. CORS, added after it, wraps it, so even 401s
carry the CORS headers.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI

from .errors import APIError, error_response

#: paths that never need the key: the health check and the page (the page asks for the key itself)
OPEN_PATHS = frozenset({"/health", "/", "/index.html"})


class APIKey:
    """Answer 401 unless ``Authorization: Bearer <key>`` (or ``api-key: <key>``) is given, except on
    :data:`OPEN_PATHS` and CORS preflights. ``/openapi.json`` and ``/docs`` need the key too."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            header = hdrs.get("authorization", "")
            given = header[7:].strip() if header.lower().startswith("bearer ") else hdrs.get("api-key", "")
            if not given or not hmac.compare_digest(given.encode(), self.key.encode()):
                what = "a wrong API key" if given else "no API key"
                resp = error_response(APIError(
                    401, f"this server needs an API key ('Authorization: Bearer <key>'); the request had {what}",
                    code="invalid_api_key"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_access(app: FastAPI, api_key: str | None, cors_origins: list[str] | None) -> None:
    """The API key check (when ``api_key``) and CORS for ``cors_origins`` (None: CORS off; also answers the
    preflight, allowing whatever request headers it names)."""
    if api_key is not None:
        app.add_middleware(APIKey, key=api_key)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # any header the browser asks for in the preflight: the official clients send their own (openai-node's
        # x-stainless-*, langchain's), and the origin list is what guards the server
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], max_age=600)
