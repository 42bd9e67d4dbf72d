"""``/health``, ``/v1/models``, the API key and CORS."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


from .helpers import MODEL_ID, client  # noqa: E402


def test_health_and_models(server, mt):
    url, _ = server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    models = client(url).models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    card = httpx.get(url + "/v1/models").json()["data"][0]
    model, tok = mt
    assert card["max_len"] == 32 and card["vocab_size"] == tok.vocab_size
    assert card["parameters"] == model.num_parameters() and card["chat_template"] is None
    assert httpx.get(url + "/v1/models/other").status_code == 404


def test_api_key_and_cors(chat_server):
    url, _ = chat_server
    assert httpx.get(url + "/health").status_code == 200  # never needs the key
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    assert client(url, "sekret").models.list().data[0].id == MODEL_ID
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://example.test"
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sekret", "Origin":
                   "http://example.test"}, json={"messages": [{"role": "user", "content": "x"}] * 9})
    assert r.status_code == 400 and r.json()["error"]["code"] == "messages_limit"
    assert r.headers["access-control-allow-origin"] == "http://example.test"


def test_cors_preflight_allows_the_headers_the_browser_asks_for(chat_server):
    """openai-node in a browser sends its x-stainless-* headers; the preflight allows what it names."""
    url, _ = chat_server
    asked = "authorization, content-type, x-stainless-os, x-stainless-lang, x-stainless-retry-count"
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    assert pre.status_code == 200, pre.text
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in asked.split(",")} <= allowed
    other = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://evil.test", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers  # the origin guards


def test_cors_off_by_default(server):
    url, _ = server
    pre = httpx.options(url + "/v1/completions", headers={"Origin": "http://example.test",
                                                          "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
