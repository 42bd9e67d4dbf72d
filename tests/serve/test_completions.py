"""``/v1/completions`` on a real uvicorn, driven by the official ``openai`` client: every reply is
``decoderlab.generate``'s text for the same prompt and seed (the scheduler batches requests together; the texts
must not change), streamed or not; hang-ups stop generation; a full queue is a 429."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, aclient, client, ref_text  # noqa: E402


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


def test_scheduler_error_reaches_the_stream(mt, caplog):
    """A failing forward pass ends the stream with an OpenAI-shaped error event; the server keeps serving. The
    failure's text goes to the server's log, never to the client (the event and the 500 say it generically)."""
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
            assert "simulated device failure" in caplog.text and "simulated" not in str(e.value)
            assert e.value.code == "internal_error"
            r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 5})
            assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
            assert r.json()["error"]["code"] == "internal_error" and "simulated" not in r.text
        finally:
            del sch.model.decode
        assert httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 5}).status_code == 200


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


def test_a_list_of_prompts_gives_one_choice_per_prompt_per_n_prompt_major(server, mt):
    """OpenAI's batch of prompts (lm-eval with batch_size > 1 sends one): choice p * n + i is prompt p's choice
    i, each the text generate gives that prompt with seed + i; the usage is the batch's."""
    url, _ = server
    _, tok = mt
    prompts = ["the sky", "my name", "ab"]
    r = client(url).completions.create(model=MODEL_ID, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        p, i = divmod(c.index, 2)
        assert c.text == ref_text(mt, tok.encode(prompts[p]), 6, 1.0, 5 + i), c.index
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts) and r.usage.completion_tokens == 36
    ids = [tok.encode(p) for p in prompts[:2]]
    r = client(url).completions.create(model=MODEL_ID, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [ref_text(mt, x, 4, 0, None) for x in ids]


def test_a_list_of_prompts_streams_and_echoes_each_prompt(server, mt):
    url, _ = server
    _, tok = mt
    prompts = ["the sky", "my name"]
    chunks = list(client(url).completions.create(model=MODEL_ID, prompt=prompts, max_tokens=5, temperature=0,
                                                 stream=True))
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [ref_text(mt, tok.encode(p), 5, 0, None) for p in prompts]
    r = client(url).completions.create(model=MODEL_ID, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in r.choices] == prompts
    assert ["".join(c.logprobs.tokens) for c in r.choices] == prompts
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)


@pytest.mark.parametrize("prompt", [["a", [1, 2]], [[1], "b"], [[1, 2], [3, [4]]]])
def test_a_batch_mixing_text_and_ids_is_refused_naming_prompt(server, prompt):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_batch_with_one_prompt_too_long_is_refused_naming_it(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_ID, "prompt": ["a", "b" * 200], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_text_prompt_gets_its_start_token_as_vllm_adds_it_and_ids_are_taken_as_given(llama_server):
    """vLLM's completions: a string prompt is encoded with ``add_special_tokens`` (default true: Llama's <s>
    first, transformers' ``tokenizer(text)``), token ids are the model's input as they are; echo shows no <s>."""
    from hf.families import greedy_tokens

    url, m, hf, auto = llama_server
    text = "To be, or not to be"
    ids = auto(text)["input_ids"]
    want = auto.decode(greedy_tokens(hf, ids, 8), skip_special_tokens=True)
    c = client(url)
    settings = dict(model=MODEL_ID, max_tokens=8, temperature=0)
    as_text = c.completions.create(prompt=text, **settings)
    as_ids = c.completions.create(prompt=ids, **settings)
    assert as_text.choices[0].text == as_ids.choices[0].text == want
    assert as_text.usage.prompt_tokens == as_ids.usage.prompt_tokens == len(ids)
    bare = c.completions.create(prompt=text, extra_body={"add_special_tokens": False}, **settings)
    same = c.completions.create(prompt=ids[1:], **settings)
    assert bare.choices[0].text == same.choices[0].text == auto.decode(greedy_tokens(hf, ids[1:], 8),
                                                                        skip_special_tokens=True) != want
    assert bare.usage.prompt_tokens == len(ids) - 1
    echo = c.completions.create(prompt=text, echo=True, **settings)
    assert echo.choices[0].text == text + want
    r = httpx.post(url + "/v1/completions", json={"prompt": text, "add_special_tokens": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
