"""``/v1/decoderlab/trace``: the glass-box numbers are ``decoderlab.trace``'s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import decoderlab as dl  # noqa: E402


def test_trace_endpoint_numbers_are_trace(server, mt):
    url, _ = server
    model, tok = mt
    r = httpx.post(url + "/v1/decoderlab/trace", json={"prompt": "abc d", "temperature": 0.5, "top_k": 3})
    assert r.status_code == 200
    d = r.json()
    tr = dl.trace(model, tok.encode("abc d"), tok)
    for lt, got in zip(tr.layers, d["layers"]):
        assert torch.allclose(lt.percents[0], torch.tensor(got["percents"]), atol=1e-6)
    probs = torch.softmax(tr.logits[0, -1], -1)
    assert abs(d["top_before"][0]["prob"] - float(probs.max())) < 1e-6
    assert len([b for b in d["top_after"] if b["prob"] > 0]) <= 3
    assert abs(sum(b["prob"] for b in d["top_after"]) - 1) < 1e-5


def test_a_prompt_longer_than_the_context_is_refused_as_by_completions(server, mt):
    """A 10,000-token prompt: the same 400 context_length_exceeded as /v1/completions, not the last 32 traced."""
    url, _ = server
    model, tok = mt
    for path, body in (("/v1/decoderlab/trace", {"prompt": "ab" * 5000}), ("/v1/completions", {"prompt": "ab" * 5000})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
        assert "32" in err["message"] and "10000" in err["message"]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"token_ids": tok.encode("a" * 33)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_generated_continuation_slides_the_window_as_generation_does(server, mt):
    """What the model generated past max_len is traced over the last max_len tokens: the window it saw."""
    url, _ = server
    model, tok = mt
    cont = "the quick brown fox jumps over the lazy dog"
    r = httpx.post(url + "/v1/decoderlab/trace", json={"prompt": "ab", "continuation": cont, "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["token_ids"] == (tok.encode("ab") + tok.encode(cont))[-32:]
    tr = dl.trace(model, d["token_ids"], tok)
    assert torch.allclose(tr.layers[1].percents[0], torch.tensor(d["layers"][1]["percents"]), atol=1e-6)
    assert d["next"]["id"] == dl.generate(model, d["token_ids"], 1, temperature=0, tokenizer=tok)[0]  # greedy


def test_a_conversation_longer_than_the_context_is_refused_but_a_long_reply_slides(chat_server, mt):
    url, _ = chat_server
    model, tok = mt
    key = {"Authorization": "Bearer sekret"}
    long_user = [{"role": "user", "content": "x" * 40}]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"messages": long_user}, headers=key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y" * 40}]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"messages": reply}, headers=key)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 32


def test_trace_bad_fields_name_them(server):
    url, _ = server
    for body, param in (({"prompt": "a", "layers": [7]}, "layers"), ({"prompt": "a", "top": 51}, "top"),
                        ({"prompt": "a", "bogus": 1}, "bogus"), ({"temperature": 0}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
                        ({"prompt": "a", "temperature": -1}, "temperature")):
        r = httpx.post(url + "/v1/decoderlab/trace", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
