"""The OpenAI-compatible server: a real uvicorn on a free port, driven by the official ``openai`` client.

Every reply is compared with ``decoderlab.generate`` for the same prompt and seed (the scheduler batches
requests together; the texts must not change), and every bad input gets an OpenAI-shaped error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import decoderlab as dl  # noqa: E402
from decoderlab.generation import SamplingParams  # noqa: E402
from decoderlab.generation.scheduler import GenerationRequest, Scheduler  # noqa: E402
from decoderlab.generation.stops import TextStopMatcher  # noqa: E402
from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:!?\n"
MODEL_ID = "tiny"


def tiny_model():
    torch.manual_seed(0)
    tok = dl.CharTokenizer.from_text(CHARS)
    cfg = dl.preset("baby-shakespeare", n_layer=2, n_head=2, d_model=32, max_len=32, num_tokens=tok.vocab_size)
    cfg.lm_head_bias = True
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():  # sharpen the random model a little, and make <EOS> rare (long replies)
        model.fc_layer.weight.mul_(4.0)
        model.fc_layer.bias.zero_()
        model.fc_layer.bias[tok.eos_id] = -30.0
    model.eval()
    return model, tok


class FakeTemplate:
    """The duck-typed interface of ``decoderlab.chat.ChatTemplate`` (render, end_of_turn_id, name)."""

    name = "fake"

    def render(self, messages, tokenizer, *, add_generation_prompt=False):
        ids, mask = [], []
        for m in messages:
            part = tokenizer.encode(f"{m['role'][0]}:{m['content']}") + [tokenizer.eos_id]
            ids += part
            mask += [m["role"] == "assistant"] * len(part)
        if add_generation_prompt:
            part = tokenizer.encode("a:")
            ids += part
            mask += [False] * len(part)
        return ids, mask

    def end_of_turn_id(self, tokenizer):
        return tokenizer.eos_id


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


def ref_text(mt, prompt_ids, n, temperature, seed, stop=None, top_k=None, top_p=None):
    """``decoderlab.generate`` called as the server's semantics imply: with the tokenizer (``<PAD>`` never
    sampled, ``<EOS>`` ends the text), stop strings on the text; its text without control tokens."""
    model, tok = mt
    ids = dl.generate(model, list(prompt_ids), n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop=stop, tokenizer=tok)
    return tok.decode(ids, skip_special=True)


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def aclient(url, key="none"):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


# ----------------------------------------------------------------------------------------------------------


def test_text_stop_holds_back_and_cuts(mt):
    """The scheduler's stop strings are generation.stops' (one implementation): what could become a stop is
    held back, and the text ends exactly before it."""
    _, tok = mt

    def push(s, text):
        ids, matched = s.feed(tok.encode(text))
        return tok.decode(ids), matched is not None

    s = TextStopMatcher(["ab", "xyz"], tok.decode)
    assert push(s, "qa") == ("q", False)  # "a" could start "ab"
    assert push(s, "c") == ("ac", False)
    assert push(s, "xy") == ("", False)
    assert push(s, "zzz") == ("", True)  # ends exactly before "xyz"
    s = TextStopMatcher(["ab"], tok.decode)
    assert push(s, "xa") == ("x", False) and tok.decode(s.flush()) == "a"


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


@pytest.mark.parametrize("temperature,seed,top_k,top_p", [(0, None, None, None), (1.0, 3, None, None),
                                                          (0.8, 11, 5, 0.9), (1.0, 4, 0, None)])
def test_completion_equals_generate_streamed_and_not(server, mt, temperature, seed, top_k, top_p):
    url, _ = server
    model, tok = mt
    prompt = "hello world"
    # 40 tokens: past max_len=32, so the context window slides (re-prefill) inside the scheduler too
    want = ref_text(mt, tok.encode(prompt), 40, temperature, seed, top_k=top_k, top_p=top_p)
    extra = {} if top_k is None else {"extra_body": {"top_k": top_k}}
    c = client(url)
    r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=temperature, seed=seed,
                             top_p=top_p, **extra)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 40
    assert r.object == "text_completion" and r.model == MODEL_ID and r.id.startswith("cmpl-")
    chunks = list(c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, temperature=temperature,
                                       seed=seed, top_p=top_p, stream=True, **extra))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_wire_format(server, mt):
    url, _ = server
    body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events[:-1])


def test_chat_equals_generate_through_the_template(chat_server, mt):
    url, _ = chat_server
    model, tok = mt
    messages = [{"role": "user", "content": "hi there"}]
    ids, _ = FakeTemplate().render(messages, tok, add_generation_prompt=True)
    want = ref_text(mt, ids, 20, 0.9, 5)
    c = client(url, "sekret")
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_completion_tokens=20, temperature=0.9,
                                  seed=5)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)

    async def streamed():
        ac = aclient(url, "sekret")
        s = await ac.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0.9,
                                             seed=5, stream=True)
        chunks = [ch async for ch in s]
        await ac.close()
        return chunks

    lp = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=2).choices[0]
    assert "".join(t.token for t in lp.logprobs.content) == lp.message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.logprobs.content)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_ID, messages=messages, top_logprobs=2)
    assert e.value.param == "top_logprobs"

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_split_across_tokens_never_appears(server, mt):
    url, _ = server
    model, tok = mt
    full = ref_text(mt, tok.encode("the cat"), 30, 1.0, 2)
    stop = full[10:13]  # three characters: three tokens of the char tokenizer
    cut = full[: full.find(stop)]
    c = client(url)
    r = c.completions.create(model=MODEL_ID, prompt="the cat", max_tokens=30, temperature=1.0, seed=2,
                             stop=[stop, "never-there"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model=MODEL_ID, prompt="the cat", max_tokens=30, temperature=1.0, seed=2, stop=stop, stream=True)
        if ch.choices]
    assert "".join(pieces) == cut and all(stop not in p for p in pieces)


def test_n_choices_and_logprobs(server, mt):
    url, _ = server
    model, tok = mt
    r = client(url).completions.create(model=MODEL_ID, prompt="ab", max_tokens=8, temperature=1.0, seed=7, n=2,
                                       logprobs=2)
    for i, ch in enumerate(sorted(r.choices, key=lambda c: c.index)):
        assert ch.text == ref_text(mt, tok.encode("ab"), 8, 1.0, 7 + i)
        assert "".join(ch.logprobs.tokens) == ch.text and len(ch.logprobs.top_logprobs[0]) == 2
    with torch.no_grad():
        logits = model(torch.tensor(tok.encode("ab")))[-1]
    first = r.choices[0].logprobs
    want = float(torch.log_softmax(logits, -1)[tok.encode(first.tokens[0])[0]])
    assert abs(first.token_logprobs[0] - want) < 1e-4


def test_sixteen_concurrent_async_streams_each_get_their_own_text(server, mt):
    url, app = server
    model, tok = mt
    words = ["a", "bb", "cat", "dog d", "e", "fig", "go go", "hat", "ink", "jam", "kite", "lion", "moon!",
             "nut", "owl", "pear"]
    jobs = [(w, 24 + (i % 3) * 7, 0 if i % 4 == 0 else 0.9, i) for i, w in enumerate(words)]
    want = [ref_text(mt, tok.encode(w), n, t, s) for w, n, t, s in jobs]

    async def one(ac, w, n, t, s):
        st = await ac.completions.create(model=MODEL_ID, prompt=w, max_tokens=n, temperature=t, seed=s,
                                         stream=True)
        return "".join([ch.choices[0].text async for ch in st if ch.choices])

    async def all_():
        ac = aclient(url)
        out = await asyncio.gather(*(one(ac, *j) for j in jobs))
        await ac.close()
        return out

    got = asyncio.run(all_())
    assert got == want
    assert app.state.get_scheduler().stats()["max_rows_seen"] > 1  # they really ran batched


def test_hangup_stops_generation_and_others_go_on(server, mt):
    url, app = server
    sch = app.state.get_scheduler()
    body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 3000, "temperature": 1.0, "seed": 1, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert sch.stats()["running"] == 1
        times = []
        with httpx.Client() as hc:  # (a client per call would time its own SSL set-up, ~40 ms)
            for _ in range(5):  # /health is answered while the model is busy (median: this box is shared)
                t0 = time.perf_counter()
                assert hc.get(url + "/health").status_code == 200
                times.append(time.perf_counter() - t0)
        assert sorted(times)[2] < 0.1, times
        assert sch.stats()["running"] == 1
    # the client hung up (closed the connection mid-stream)
    deadline = time.time() + 5
    while sch.stats()["running"] and time.time() < deadline:
        time.sleep(0.02)
    assert sch.stats()["running"] == 0
    steps = sch.stats()["steps"]
    time.sleep(0.3)
    assert sch.stats()["steps"] == steps  # nothing is decoded any more
    r = client(url).completions.create(model=MODEL_ID, prompt="ok", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_hangup_of_a_non_streamed_request_stops_it_too(server):
    url, app = server
    sch = app.state.get_scheduler()
    steps = sch.stats()["steps"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3000, "temperature": 1.0},
                   timeout=0.4)
    deadline = time.time() + 5
    while sch.stats()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert sch.stats()["running"] == 0
    assert sch.stats()["steps"] - steps < 2900  # stopped (within ~0.5 s of the hang-up), not run to the end


BAD = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {"model": MODEL_ID}, 400, "messages", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3001}, 400, "max_tokens", "max_tokens_limit"),
    ("/v1/completions", {"prompt": "a", "n": 4}, 400, "n", "n_limit"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "a" * 33}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, 400, "top_k", "invalid_value"),  # (0 = no filter, as generate)
    ("/v1/completions", {"prompt": "a", "top_k": 2.5}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed", "invalid_value"),  # (was accepted)
    ("/v1/completions", {"prompt": "a", "seed": 99999999999999999999999}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {"prompt": "#"}, 400, "prompt", "invalid_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
     "no_chat_template"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{b[3]}-{b[4]}" for b in BAD])
def test_bad_inputs_are_openai_shaped(server, path, body, status, param, code):
    url, _ = server
    r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"]


def test_bad_request_error_carries_code_and_param(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="a" * 40, max_tokens=3)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert "32" in e.value.message and "40" in e.value.message  # both lengths named
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="a", max_tokens=5000)
    assert e.value.param == "max_tokens" and "3000" in e.value.message  # the limit is named
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="a")
    assert e.value.code == "model_not_found"


def test_body_not_json_and_too_large(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", content=b"x" * 10_000_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_large"
    assert "100000" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


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


def test_cors_off_by_default(server):
    url, _ = server
    pre = httpx.options(url + "/v1/completions", headers={"Origin": "http://example.test",
                                                          "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_queue_full_answers_429_with_retry_after(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None,
                     limits=Limits(max_batch=1, max_queue=1, max_tokens=3000))
    with ServerThread(app) as url:
        body = {"prompt": "abc", "max_tokens": 3000, "temperature": 1.0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # (kept: dropping the iterator would close the connection)
            next(lines)  # running: the batch (1 row) is full
            waiting = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=dict(
                body, stream=False, max_tokens=2), timeout=30))
            waiting.start()
            deadline = time.time() + 5
            while app.state.get_scheduler().stats()["waiting"] < 1 and time.time() < deadline:
                time.sleep(0.01)
            r = httpx.post(url + "/v1/completions", json=dict(body, stream=False))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        waiting.join(timeout=30)


def test_scheduler_error_reaches_the_stream(mt):
    """A failing forward pass ends the stream with an OpenAI-shaped error event; the server keeps serving."""
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None)
    with ServerThread(app) as url:
        sch = app.state.get_scheduler()

        def boom(*a, **k):
            raise RuntimeError("simulated device failure")

        sch.model.decode = boom  # an instance attribute over the model's method
        try:
            with pytest.raises(openai.APIError) as e:
                list(client(url).completions.create(model=MODEL_ID, prompt="ab", max_tokens=5, stream=True))
            assert "simulated device failure" in str(e.value)
            r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 5})
            assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
        finally:
            del sch.model.decode
        assert httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 5}).status_code == 200


def test_scheduler_joins_rows_mid_flight_greedy_exact(mt):
    """Rows that join a running batch at different steps still give exactly generate(temperature=0)."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=8)
    try:
        results = {}
        done = threading.Event()
        prompts = ["a", "hello there", "x y z", "the long prompt, with words: ok"]

        def on(i):
            def f(ev):
                if ev[0] == "delta":
                    results[i] = results.get(i, "") + ev[2]
                elif ev[0] == "done":
                    results[f"done{i}"] = True
                    if all(f"done{j}" in results for j in range(len(prompts))):
                        done.set()
            return f

        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=45, temperature=0)
            sch.submit(GenerationRequest(prompt_ids=tok.encode(p), params=params, on_event=on(i)))
            time.sleep(0.01 * i)
        assert done.wait(30)
        for i, p in enumerate(prompts):
            assert results.get(i, "") == ref_text(mt, tok.encode(p), 45, 0, None)
    finally:
        sch.close()


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cli_server(directory, *args):
    """``decoderlab serve --checkpoint DIR ARGS`` in a subprocess (the real command): yields its URL."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(dl.__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "serve", "--checkpoint", str(directory),
                             "--port", str(port), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 40
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_serve_runs_a_checkpoint(mt, tmp_path):
    model, tok = mt
    dl.save_checkpoint(tmp_path / "ck", model, tok)
    with cli_server(tmp_path / "ck", "--api-key", "k") as url:
        r = client(url, "k").completions.create(model="ck", prompt="ab", max_tokens=4, temperature=0)
        assert r.choices[0].text == ref_text(mt, tok.encode("ab"), 4, 0, None)


def test_cli_serve_runs_a_hugging_face_gpt2_directory(tmp_path):
    """Issue 14 item 7: a GPT-2 directory (config.json + weights + vocab.json/merges.txt) is a checkpoint for
    serve too; /v1/completions equals generate on the same directory."""
    transformers = pytest.importorskip("transformers")
    from decoderlab.hf import load_any_checkpoint

    bpe = dl.BPETokenizer.train("To be, or not to be, that is the question.\n" * 8, 280)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
        eos_token_id=None))
    hf.save_pretrained(tmp_path / "gpt2-tiny")
    bpe.hf_tokenizer.model.save(str(tmp_path / "gpt2-tiny"))  # vocab.json, merges.txt
    model, tok = load_any_checkpoint(tmp_path / "gpt2-tiny")
    with cli_server(tmp_path / "gpt2-tiny") as url:
        c = client(url)
        assert c.models.list().data[0].id == "gpt2-tiny"
        for temperature, seed in ((0, None), (1.0, 3)):
            r = c.completions.create(model="gpt2-tiny", prompt="To be", max_tokens=6, temperature=temperature,
                                     seed=seed)
            assert r.choices[0].text == ref_text((model, tok), tok.encode("To be"), 6, temperature, seed)


def test_scheduler_prefills_equal_lengths_together_and_stays_exact(mt):
    """Newcomers with prompts of equal length are prefilled in one forward pass; seeded and greedy rows still
    give exactly generate's tokens (driven step by step on this thread, so the grouping is certain)."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=16)
    sch.close()  # no thread: _step is driven here
    prompts = ["abcd", "hey!", "wxyz", "a b.", "ab", "hello there"]
    texts = {i: "" for i in range(len(prompts))}

    def on(i):
        def f(ev):
            if ev[0] == "delta":
                texts[i] += ev[2]
        return f

    reqs = [GenerationRequest(prompt_ids=tok.encode(p),
                              params=SamplingParams(max_new_tokens=40, temperature=0 if i % 2 else 0.9, seed=i),
                              on_event=on(i)) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        sch._step(reqs[:4])  # four prompts of 4 tokens: one prefill of a (4, 4) batch
        sch._step(reqs[4:])  # joining a running batch
        while sch._rows:
            sch._step([])
    for i, p in enumerate(prompts):
        assert texts[i] == ref_text(mt, tok.encode(p), 40, 0 if i % 2 else 0.9, i), p


@pytest.mark.parametrize("args,needle", [(["--checkpoint", "/no/such/dir"], "/no/such/dir"),
                                         (["--checkpoint", ".", "--port", "70000"], "--port"),
                                         (["--checkpoint", ".", "--max-tokens", "0"], "--max-tokens")])
def test_cli_serve_bad_input_is_one_error_line(args, needle, capsys):
    from decoderlab.cli import main as cli_main

    assert cli_main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decoderlab: error:") and needle in err[0]


def _run(sch: Scheduler, prompt_ids, **sampling) -> tuple[str, str]:
    """One request through the scheduler's thread: (its text, its finish reason)."""
    out = {"text": "", "finish": None}
    done = threading.Event()

    def on(ev):
        if ev[0] == "delta":
            out["text"] += ev[2]
        elif ev[0] == "finish":
            out["finish"] = ev[2]
        elif ev[0] in ("done", "error"):
            done.set()

    sch.submit(GenerationRequest(prompt_ids=prompt_ids, params=SamplingParams(**sampling), on_event=on))
    assert done.wait(30)
    return out["text"], out["finish"]


def test_scheduler_stops_as_stream_text_when_a_stop_begins_inside_a_token(newline_bpe):
    """A byte-level BPE whose model writes "\\n" one token at a time, and "x" -> "ab" -> "c": the stop "\\n\\n"
    is found across tokens, the stop "bc" begins inside the token "ab"; the scheduler's text is stream_text's,
    ending exactly before the stop."""
    tok, model, ids = newline_bpe
    sch = Scheduler(model, tok, max_batch=4)
    try:
        for prompt, stop in (("p", "\n\n"), ("x", "bc"), ("x", "c\n"), ("p", ["zz", "a\n\n"]), ("p", None)):
            want = "".join(dl.stream_text(model, tok, prompt, 6, temperature=0, stop=stop))
            got = _run(sch, tok.encode(prompt), max_new_tokens=6, temperature=0, stop=stop)
            assert got == (want, "length" if stop is None else "stop"), (prompt, stop)
        assert _run(sch, tok.encode("x"), max_new_tokens=6, temperature=0, stop="bc") == ("a", "stop")
        with pytest.raises(ValueError, match="top_k"):  # generate's own checks
            sch.submit(GenerationRequest(prompt_ids=[ids["p"]], params=SamplingParams(max_new_tokens=3, top_k=-1)))
    finally:
        sch.close()


def test_completions_on_a_chat_model_end_at_its_end_of_turn():
    """/v1/completions on a chat checkpoint: the model's <|end|> ends the text with finish_reason "stop" -- it
    was hidden and the text went on until "length" -- streamed or not, greedy or seeded; chat replies too."""
    from decoderlab.chat import TEMPLATES
    from tiny_models import end_of_turn_model

    tok, model, _ = end_of_turn_model()
    app = create_app(model, tok, model_id=MODEL_ID, template=TEMPLATES["decoderlab"])
    with ServerThread(app) as url:
        c = client(url)
        for temperature, seed in ((0, None), (0.9, 7)):
            r = c.completions.create(model=MODEL_ID, prompt="a", max_tokens=10, temperature=temperature, seed=seed)
            assert (r.choices[0].text, r.choices[0].finish_reason) == ("bc", "stop")
        chunks = [ch for ch in c.completions.create(model=MODEL_ID, prompt="a", max_tokens=10, temperature=0,
                                                    stream=True) if ch.choices]
        assert "".join(ch.choices[0].text for ch in chunks) == "bc" and chunks[-1].choices[0].finish_reason == "stop"
        r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "b"}], max_tokens=10,
                                      temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("abc", "stop")
