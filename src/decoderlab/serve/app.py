"""``create_app``: the FastAPI app over one :class:`~decoderlab.serve.state.AppState`.

Routers: :mod:`.models` (``/health``, ``/v1/models``), :mod:`.completions`, :mod:`.chat_completions`,
:mod:`.tokens` (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), :mod:`.metrics` (``/metrics``),
:mod:`.trace` (``/v1/decoderlab/trace``), :mod:`.watched` (``/v1/decoderlab/head_scores``), :mod:`.features`
(``/v1/decoderlab/features``), :mod:`.page`
(``/``). ``/openapi.json`` and ``/docs`` describe every endpoint and field (behind the API key, like the data
endpoints). The scheduler starts with the app and stops when uvicorn shuts the app down.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .._version import __version__
from ..config.limits import ServeLimits
from . import chat_completions, completions, features, metrics, models, page, tokens, trace, watched
from .errors import install_handlers
from .middleware import add_access
from .protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse
from .state import AppState

#: schemas the routes do not name but the wire carries (stream chunks, the error event of a stream)
EXTRA_SCHEMAS = (CompletionChunk, ChatCompletionChunk, ErrorResponse)


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema with OpenAI's errors: no 422 (validation errors are 400s) and the chunk schemas."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        for model in EXTRA_SCHEMAS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps.setdefault(model.__name__, js)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(model, tokenizer, *, meta: dict | None = None, template: Any = "auto", model_id: str | None = None,
               api_key: str | None = None, cors_origins: list[str] | None = None, limits: ServeLimits | None = None,
               run_dir=None, sae=None):
    """Build the FastAPI app serving ``model``.

    Args:
        model, tokenizer: e.g. from ``decoderlab.load_checkpoint``; the app's scheduler thread owns the model.
        meta: the checkpoint's meta.json (for the chat template and the model id).
        template: a chat template (``render(messages, tokenizer, add_generation_prompt=...)`` -> (ids,
            mask) and ``end_of_turn_id(tokenizer)``), None for a base model, or "auto" to take it from
            ``meta`` through ``decoderlab.chat.template_from_meta``.
        model_id: the id clients name (default meta's "name", else "decoderlab").
        api_key: if given, every endpoint but /health and the page answers 401 without
            ``Authorization: Bearer <api_key>``.
        cors_origins: origins allowed by CORS (None = CORS off); also answers the preflight.
        limits: :class:`decoderlab.config.ServeLimits`.
        run_dir: the served run directory: the head scores it recorded while training (``--watch-heads``)
            are ``GET /v1/decoderlab/head_scores``'s (default none).
        sae: a sparse autoencoder on the model (a ``SparseAutoencoder`` or its directory, SAELens's format)
            whose features ``/v1/decoderlab/features`` and the page's Features view show (default none).

    Raises: ``ValueError`` for a malformed chat template in ``meta``, or an SAE whose hook or size the model
    does not have.
    """
    state = AppState.build(model, tokenizer, meta=meta, template=template, model_id=model_id, limits=limits)

    @asynccontextmanager
    async def lifespan(app):
        state.scheduler()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="decoderlab", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="An OpenAI-compatible server for a decoderlab model, and its glass box.")
    app.state.decoderlab = state
    app.state.get_scheduler = state.scheduler
    app.state.metrics = state.metrics = metrics.Metrics(state.stats)
    app.openapi = lambda: openapi_schema(app)
    install_handlers(app)
    add_access(app, api_key, cors_origins)
    app.add_middleware(metrics.CountRequests, metrics=state.metrics)  # outermost: 401s and CORS answers count too
    app.state.run_dir = run_dir  # its head_scores.jsonl: GET /v1/decoderlab/head_scores (serve/watched.py)
    app.state.sae = None if sae is None else features.serve_sae(model, sae)
    for module in (models, completions, chat_completions, tokens, metrics, trace, watched, features, page):
        app.include_router(module.router)
    return app
