"""Fixtures of the server's tests: a real uvicorn on a free port serving the tiny model (``server``: a base
model; ``chat_server``: with a chat template, an API key and CORS)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("httpx")

from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, FakeTemplate, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def mt():
    return tiny_model()


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None,
                     limits=Limits(max_tokens=3000, max_n=3, max_messages=8, max_body_bytes=100_000))
    with ServerThread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def chat_server(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=FakeTemplate(), api_key="sekret",
                     cors_origins=["http://example.test"], limits=Limits(max_messages=8))
    with ServerThread(app) as url:
        yield url, app
