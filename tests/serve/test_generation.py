"""The request fields that become sampling settings, through the official ``openai`` client against a real
uvicorn: penalties, min-p and logit bias give ``decoderlab.generate``'s text with the same settings;
``best_of`` returns the best choices by logprob per token; ``echo`` + ``logprobs`` (+ ``max_tokens`` 0) returns
the prompt's scores of ``decoderlab.generation.scoring``; ``response_format`` and the ``guided_*`` fields
constrain the reply, which ends when the grammar is complete."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import decoderlab as dl  # noqa: E402
from decoderlab.generation.scoring import score_tokens  # noqa: E402
from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402
from tiny_models import JSON_CHARS, PERSON_SCHEMA  # noqa: E402

from .helpers import MODEL_ID, client  # noqa: E402

CONTROLS = [dict(presence_penalty=1.5, frequency_penalty=0.5), dict(repetition_penalty=1.8),
            dict(min_p=0.2), dict(logit_bias={"5": 8.0, "6": -100})]


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: "+".join(c))
def test_sampling_controls_give_generates_text(server, mt, controls):
    url, _ = server
    model, tok = mt
    want = tok.decode(dl.generate(model, tok.encode("hello"), 30, tokenizer=tok, temperature=0.9, seed=5,
                                  **{k: ({int(i): b for i, b in v.items()} if k == "logit_bias" else v)
                                     for k, v in controls.items()}), skip_special=True)
    plain = tok.decode(dl.generate(model, tok.encode("hello"), 30, tokenizer=tok, temperature=0.9, seed=5),
                       skip_special=True)
    assert want != plain  # each control changes this text
    c = client(url)
    extra = {k: controls.pop(k) for k in ("repetition_penalty", "min_p") if k in controls}
    r = c.completions.create(model=MODEL_ID, prompt="hello", max_tokens=30, temperature=0.9, seed=5,
                             extra_body=extra, **controls)
    assert r.choices[0].text == want
    chat_like = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL_ID, prompt="hello", max_tokens=30, temperature=0.9, seed=5, stream=True, extra_body=extra,
        **controls) if ch.choices)
    assert chat_like == want


def test_logit_bias_minus_100_bans_a_token(server, mt):
    url, _ = server
    model, tok = mt
    greedy = client(url).completions.create(model=MODEL_ID, prompt="abc", max_tokens=20, temperature=0)
    first = tok.encode(greedy.choices[0].text[0])[0]
    banned = client(url).completions.create(model=MODEL_ID, prompt="abc", max_tokens=20, temperature=0,
                                            logit_bias={str(first): -100})
    assert greedy.choices[0].text[0] not in banned.choices[0].text


def test_best_of_returns_the_best_choices_by_logprob_per_token(server, mt):
    url, _ = server
    model, tok = mt
    r = client(url).completions.create(model=MODEL_ID, prompt="ab", max_tokens=6, temperature=1.0, seed=3,
                                       best_of=3, n=2)
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == 18  # three choices were generated

    def mean_logprob(text):
        s = score_tokens(model, tok.encode("ab" + text))
        return float(s.logprobs[1:].mean())

    candidates = [tok.decode(dl.generate(model, tok.encode("ab"), 6, tokenizer=tok, temperature=1.0, seed=3 + i),
                             skip_special=True) for i in range(3)]
    best = sorted(candidates, key=mean_logprob, reverse=True)[:2]
    assert [c.text for c in r.choices] == best


def test_echo_with_max_tokens_0_scores_the_prompt(server, mt):
    url, _ = server
    model, tok = mt
    prompt = "the cat sat"
    ids = tok.encode(prompt)
    r = client(url).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    s = score_tokens(model, ids, top=2)
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert ch.logprobs.token_logprobs[1:] == s.logprobs.tolist()
    with torch.no_grad():  # the reference: each prefix through the model alone, float64 log-softmax
        ref = [float(torch.log_softmax(model(torch.tensor(ids[:t])).double()[-1], -1)[ids[t]])
               for t in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(ch.logprobs.token_logprobs[1:], ref)) < 1e-5
    assert list(ch.logprobs.top_logprobs[1].values()) == s.top_logprobs[0].tolist()
    # with max_tokens 1 (lm-eval's request): the prompt's scores, then one generated token
    r1 = client(url).completions.create(model=MODEL_ID, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)
    lp = r1.choices[0].logprobs
    assert lp.token_logprobs[1:-1] == s.logprobs.tolist() and len(lp.tokens) == len(ids) + 1
    assert r1.choices[0].text.startswith(prompt)
    streamed = [ch.choices[0].text for ch in client(url).completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True) if ch.choices]
    assert "".join(streamed).startswith(prompt) and prompt in streamed


@pytest.fixture(scope="module")
def json_server():
    torch.manual_seed(0)
    tok = dl.CharTokenizer(set(JSON_CHARS))
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=96)
    app = create_app(dl.DecoderOnlyTransformer(cfg).eval(), tok, model_id=MODEL_ID, template=None,
                     limits=Limits(max_tokens=200))
    with ServerThread(app) as url:
        yield url


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_json_schema_is_followed(json_server, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    c = client(json_server)
    for seed in range(5):
        r = c.completions.create(model=MODEL_ID, prompt="\n", max_tokens=150, seed=seed, extra_body={
            "response_format": fmt})
        jsonschema.validate(json.loads(r.choices[0].text), PERSON_SCHEMA)
        assert r.choices[0].finish_reason == "stop"  # ended by the grammar, not the token limit


def test_json_object_regex_choice_and_grammar_fields(json_server):
    c = client(json_server)
    r = c.completions.create(model=MODEL_ID, prompt="\n", max_tokens=150, seed=1,
                             extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    r = c.completions.create(model=MODEL_ID, prompt="x", max_tokens=50, seed=2,
                             extra_body={"guided_regex": "[0-9]{3}:[a-z]{2}"})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == ":" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL_ID, prompt="x", max_tokens=50, seed=3,
                             extra_body={"guided_choice": ["cat", "dog", "fish"]})
    assert r.choices[0].text in ("cat", "dog", "fish")
    r = c.completions.create(model=MODEL_ID, prompt="x", max_tokens=50, seed=4,
                             extra_body={"guided_grammar": 'start: "a" ("b" | "c")+ "."'})
    assert r.choices[0].text[0] == "a" and r.choices[0].text[-1] in ".bc"
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model=MODEL_ID, prompt="x", max_tokens=50, seed=2, stream=True, extra_body={"guided_regex": "[0-9]{5}"})
        if ch.choices]
    assert len("".join(pieces)) == 5 and "".join(pieces).isdigit()


def test_a_schema_the_library_cannot_compile_is_a_400_naming_response_format(json_server):
    c = client(json_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="x", max_tokens=5, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "format": "no-such-format"}}}, "strict": True}}})
    assert e.value.body["param"] == "response_format" and "no-such-format" in e.value.body["message"]
    # not strict: the unknown format is ignored and the rest enforced
    r = c.completions.create(model=MODEL_ID, prompt="x", max_tokens=80, seed=0, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": False, "schema": {
            "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format", "maxLength": 3}},
            "required": ["a"], "additionalProperties": False}}}})
    assert set(json.loads(r.choices[0].text)) == {"a"}
    assert c.completions.create(model=MODEL_ID, prompt="x", max_tokens=3).choices  # it serves the others
