"""``/openapi.json`` and ``/docs``: every endpoint and field described, behind the API key; and a short
schemathesis run over the schema: no request it can build makes the server answer 500."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402
from decoderlab.serve import protocol as P  # noqa: E402
from decoderlab.serve import trace_protocol as TP  # noqa: E402

from .helpers import MODEL_ID, FakeTemplate  # noqa: E402

KEY = {"Authorization": "Bearer sekret"}


def resolve(schema: dict, ref: dict) -> dict:
    return schema["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]


def test_openapi_lists_the_endpoints_with_their_request_schemas(chat_server):
    url, _ = chat_server
    schema = httpx.get(url + "/openapi.json", headers=KEY).json()
    paths = schema["paths"]
    for path in ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/decoderlab/trace", "/"):
        assert path in paths, path
    for path, model in (("/v1/completions", P.CompletionRequest), ("/v1/chat/completions", P.ChatCompletionRequest),
                        ("/v1/decoderlab/trace", TP.TraceRequest)):
        op = paths[path]["post"]
        body = resolve(schema, op["requestBody"]["content"]["application/json"]["schema"])
        props = body["properties"]
        assert set(model.model_fields) <= set(props), path  # every field
        assert set(P.IGNORED) | set(P.UNSUPPORTED) <= set(props), path  # and the ignored and refused ones
        assert all(p.get("description") or "$ref" in p or p.get("anyOf") or p.get("type") for p in props.values())
        assert "422" not in op["responses"]  # validation errors are OpenAI's 400s
        assert resolve(schema, op["responses"]["400"]["content"]["application/json"]["schema"])["title"] == \
            "ErrorResponse"
    chat = resolve(schema, paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
                   ["schema"])
    assert "messages" in chat["required"]
    streamed = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert resolve(schema, streamed)["properties"]["object"]["const"] == "chat.completion.chunk"
    role = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert role["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]["maximum"] == 2


def test_openapi_and_docs_need_the_api_key(chat_server):
    url, _ = chat_server
    for path in ("/openapi.json", "/docs"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(url + path, headers=KEY).status_code == 200, path
    assert "swagger" in httpx.get(url + "/docs", headers=KEY).text.lower()


def test_schemathesis_finds_no_500(mt):
    """Property-based requests built from /openapi.json (bodies that fit the schema and bodies that do not):
    every answer is below 500. Bounded: 25 examples per operation, small limits so that a valid request decodes
    a few tokens."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    from schemathesis.generation.modes import GenerationMode

    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=FakeTemplate(),
                     limits=Limits(max_tokens=4, default_max_tokens=4, max_n=2, max_messages=4))
    with ServerThread(app) as url:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        seen: dict[str, list[int]] = {}
        for result in schema.get_all_operations():
            op = result.ok()

            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
            def check(case):
                r = case.call(base_url=url, timeout=30)
                seen.setdefault(op.label, []).append(r.status_code)
                assert r.status_code < 500, (op.label, case.body, r.text)

            check()
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/decoderlab/trace"} <= set(seen)
    assert any(s == 200 for s in seen["POST /v1/completions"]), seen
