"""The scheduler: rows with different settings decoded together each give their own ``generate`` run, and a
control token that ends text ends a row with finish reason "stop"."""

import pytest
import torch
from tiny_models import end_of_turn_model, one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.generation import SamplingParams, stream_text
from decoderlab.generation.scheduler import GenerationRequest, Scheduler

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:!?\n"


@pytest.fixture(scope="module")
def char_model():
    """A float64 character model (exact: batched and alone give the same logits), <EOS> rare."""
    torch.manual_seed(0)
    tok = dl.CharTokenizer.from_text(CHARS)
    cfg = dl.preset("baby-shakespeare", n_layer=2, n_head=2, d_model=32, max_len=32, num_tokens=tok.vocab_size)
    cfg.lm_head_bias = True
    model = dl.DecoderOnlyTransformer(cfg).double()
    with torch.no_grad():
        model.fc_layer.weight.mul_(3.0)
        model.fc_layer.bias.zero_()
        model.fc_layer.bias[tok.eos_id] = -30.0
    return model.eval(), tok


def drive(model, tok, requests, max_batch=16):
    """Run ``requests`` through a scheduler's steps on this thread, all admitted in the first step (so they
    are sampled together): returns ({(request, choice): text}, {(request, choice): finish}, the scheduler)."""
    sch = Scheduler(model, tok, max_batch=max_batch)
    sch.close()  # no thread: the steps are driven here
    texts, finish = {}, {}

    def on(k):
        def f(ev):
            if ev[0] == "delta":
                texts[(k, ev[1])] = texts.get((k, ev[1]), "") + ev[2]
            elif ev[0] == "finish":
                finish[(k, ev[1])] = ev[2]
        return f

    reqs = [GenerationRequest(prompt_ids=tok.encode(p), params=params, n=n, on_event=on(k))
            for k, (p, params, n) in enumerate(requests)]
    for r in reqs:
        sch._prepare(r)
    with torch.inference_mode():
        sch._step(reqs)
        while sch._rows:
            sch._step([])
    return texts, finish, sch


ROWS = [
    ("hello", SamplingParams(max_new_tokens=30, temperature=0)),
    ("hello", SamplingParams(max_new_tokens=30, temperature=0.9, top_k=5, seed=1)),
    ("the cat", SamplingParams(max_new_tokens=25, temperature=1.2, top_p=0.8, seed=2)),
    ("a", SamplingParams(max_new_tokens=40, min_p=0.2, seed=3)),
    ("to be, or", SamplingParams(max_new_tokens=30, repetition_penalty=1.5, frequency_penalty=0.7,
                                 presence_penalty=0.5, seed=4)),
    ("xyz", SamplingParams(max_new_tokens=30, temperature=0, logit_bias={5: 3.0, 6: -100})),
    ("xyz", SamplingParams(max_new_tokens=30, temperature=0, repetition_penalty=2.0)),
    ("q", SamplingParams(max_new_tokens=12, temperature=0.7, stop=["rr"], seed=5)),  # a stop across tokens
]


def test_rows_with_different_settings_each_equal_their_own_generate(char_model):
    model, tok = char_model
    texts, finish, sch = drive(model, tok, [(p, params, 1) for p, params in ROWS])
    assert sch.stats()["max_rows_seen"] == len(ROWS)  # all decoded together
    for k, (prompt, params) in enumerate(ROWS):
        want = "".join(stream_text(model, tok, prompt, params))
        assert texts.get((k, 0), "") == want, (prompt, params)
        assert finish[(k, 0)] == ("stop" if params.stop else "length"), (prompt, params)
    assert len({texts[(0, 0)], texts[(5, 0)], texts[(6, 0)]}) == 3  # the settings change the text
    # n choices: choice i is seeded with seed + i, each with its own penalties' state
    params = ROWS[4][1]
    texts, _, _ = drive(model, tok, [(ROWS[4][0], params, 3)])
    for i in range(3):
        assert texts[(0, i)] == "".join(stream_text(model, tok, ROWS[4][0], params.replace(seed=4 + i)))


def test_an_end_of_turn_ends_a_row_with_stop():
    """A completion on a chat model's tokens: <|end|> ends the row ("stop"), as generate ends there."""
    tok, model, _ = end_of_turn_model()
    texts, finish, _ = drive(model, tok, [("a", SamplingParams(max_new_tokens=10, temperature=0), 1),
                                          ("a", SamplingParams(max_new_tokens=10, temperature=0.8, seed=1), 2),
                                          ("a", SamplingParams(max_new_tokens=5, temperature=0, stop_at_eos=False),
                                           1)])
    assert (texts[(0, 0)], finish[(0, 0)]) == ("bc", "stop")
    assert [texts[(1, i)] for i in range(2)] == ["bc", "bc"] and finish[(1, 1)] == "stop"
    assert (texts[(2, 0)], finish[(2, 0)]) == ("bcab", "length")  # let through: no text, goes on


def test_submit_checks_the_request(char_model):
    model, tok = char_model
    sch = Scheduler(model, tok)
    try:
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
            sch.submit(GenerationRequest(prompt_ids=[3], params=SamplingParams(max_new_tokens=0)))
        with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
            sch.submit(GenerationRequest(prompt_ids=[3], params={"temperature": 0}))
        with pytest.raises(ValueError, match="logit_bias: token id 99 is out of range"):
            sch.submit(GenerationRequest(prompt_ids=[3], params=SamplingParams(logit_bias={99: 1})))
    finally:
        sch.close()
