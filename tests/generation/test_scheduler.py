"""The scheduler (continuous batching): rows joining mid-flight, equal prompt lengths prefilled together, stop
strings, and rows with different settings decoded together each give exactly their own ``generate`` /
``stream_text`` text; a control token that ends text ends a row with finish reason "stop"."""

import contextlib
import threading
import time

import pytest
import torch
from tiny_models import CHARS, end_of_turn_model, one_thread, tiny_model  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.generation import SamplingParams, generate, stream_text
from decoderlab.generation.scheduler import GenerationRequest, Scheduler
from decoderlab.quant import quantize_model


@pytest.fixture(scope="module", params=["baby-shakespeare", "llama-gqa", "gemma-sliding"])
def mt(request):
    """The server's model (float32: batched matmuls may round differently from one row's; the tokens must not
    change), the Llama family's shape (its batch cache holds n_kv_head heads) and Gemma's (its sliding layer
    masks the batch cache's columns outside its window; its own generate reads a ring)."""
    return tiny_model(request.param)


def ref_text(mt, prompt_ids, n, temperature, seed):
    """``decoderlab.generate``'s text with the tokenizer (<PAD> never sampled, the end-of-text tokens end it)."""
    model, tok = mt
    return tok.decode(generate(model, list(prompt_ids), n, temperature=temperature, seed=seed, tokenizer=tok),
                      skip_special=True)


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


def test_a_burst_of_different_lengths_is_prefilled_in_one_padded_pass_and_stays_exact(mt):
    """Newcomers of different prompt lengths arriving in one step are prefilled together (left-padded, a padding
    mask, per-row positions): one forward pass for the burst, and each row still gives exactly generate's tokens,
    also with n > 1 and when a second burst joins running rows."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=16)
    sch.close()  # no thread: _step is driven here
    prompts = ["a", "hello there", "x y", "the long prompt, with words: ok", "ab", "hey!"]
    texts: dict = {}

    def on(i):
        def f(ev):
            if ev[0] == "delta":
                texts[i, ev[1]] = texts.get((i, ev[1]), "") + ev[2]
        return f

    reqs = [GenerationRequest(prompt_ids=tok.encode(p), n=2 if i == 1 else 1,
                              params=SamplingParams(max_new_tokens=30, temperature=0 if i % 2 else 0.9, seed=i),
                              on_event=on(i)) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        sch._step(reqs[:4])  # four lengths (1, 11, 3, 31 tokens): one padded prefill
        assert sch.prefills == 1 and len(sch._rows) == 5
        sch._step(reqs[4:])  # a second burst joins the running rows: one more
        assert sch.prefills == 2
        while sch._rows:
            sch._step([])
    assert sch.prefills == 2
    for i, p in enumerate(prompts):
        temperature = 0 if i % 2 else 0.9
        assert texts.get((i, 0), "") == ref_text(mt, tok.encode(p), 30, temperature, i), p
    # choice 1 of the n=2 request samples with seed + 1 (greedy here: the same text)
    assert texts.get((1, 1), "") == ref_text(mt, tok.encode(prompts[1]), 30, 0, 2)


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
            want = "".join(stream_text(model, prompt, tok, 6, temperature=0, stop=stop))
            got = _run(sch, tok.encode(prompt), max_new_tokens=6, temperature=0, stop=stop)
            assert got == (want, "length" if stop is None else "stop"), (prompt, stop)
        assert _run(sch, tok.encode("x"), max_new_tokens=6, temperature=0, stop="bc") == ("a", "stop")
        with pytest.raises(ValueError, match="top_k"):  # generate's own checks
            sch.submit(GenerationRequest(prompt_ids=[ids["p"]], params=SamplingParams(max_new_tokens=3, top_k=-1)))
    finally:
        sch.close()


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
        want = "".join(stream_text(model, prompt, tok, params))
        assert texts.get((k, 0), "") == want, (prompt, params)
        assert finish[(k, 0)] == ("stop" if params.stop else "length"), (prompt, params)
    assert len({texts[(0, 0)], texts[(5, 0)], texts[(6, 0)]}) == 3  # the settings change the text
    # n choices: choice i is seeded with seed + i, each with its own penalties' state
    params = ROWS[4][1]
    texts, _, _ = drive(model, tok, [(ROWS[4][0], params, 3)])
    for i in range(3):
        assert texts[(0, i)] == "".join(stream_text(model, ROWS[4][0], tok, params.replace(seed=4 + i)))


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


def _wait_for(predicate, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the scheduler did not get there in time"
        time.sleep(0.005)


def test_a_scheduler_step_waits_for_the_device_once_whatever_the_batch(mt):
    """A steady step (no newcomer) makes one host sync, the sampled ids of every row together: four rows that
    joined at different times (so a padding mask and per-row positions), greedy and sampled with penalties,
    over more than two windows of max_len (every row's window slides and is re-prefilled). The counter is
    switched on and off on the model thread, between two steps (its modes are per thread)."""
    from support.host_syncs import HostSyncCounter

    model, tok = mt
    sch = Scheduler(model, tok, max_batch=8)
    counter = HostSyncCounter()
    reqs = [GenerationRequest(tok.encode("a"), SamplingParams(max_new_tokens=500, temperature=0)),
            GenerationRequest(tok.encode("hello"), SamplingParams(max_new_tokens=500, temperature=0.8, seed=1,
                                                                  top_k=5, repetition_penalty=1.2), n=2),
            GenerationRequest(tok.encode("x y"), SamplingParams(max_new_tokens=500, temperature=0.9, seed=2,
                                                                top_p=0.9, frequency_penalty=0.5))]
    try:
        sch.submit(reqs[0])
        _wait_for(lambda: sch.stats()["steps"] >= 3)
        for req in reqs[1:]:
            sch.submit(req)
        _wait_for(lambda: sch.stats()["running"] == 4)
        first = sch.call(lambda: (counter.__enter__(), sch.steps)[1]).result(30)
        _wait_for(lambda: sch.stats()["steps"] >= first + 2 * model.config.max_len + 2)
        last = sch.call(lambda: (counter.__exit__(None, None, None), sch.steps)[1]).result(30)
        assert sch.stats()["running"] == 4  # (nobody finished: every counted step decoded all four rows)
    finally:
        for req in reqs:
            req.cancel()
        sch.close()
    assert last - first > 2 * model.config.max_len
    assert len(counter) == last - first, "more than the sampled ids per step:\n" + counter.report()
    assert {e.origin.name for e in counter.events} == {"decoderlab.generation.scheduler.Scheduler._sample"}


def test_chunked_prefill_interleaves_long_prompts_with_decode_steps_and_stays_exact(mt):
    """With ``prefill_chunk`` 4, the two long prompts (11 and 31 tokens) are read 4 tokens per step, one chunk
    between two decode steps, while the short ones (admitted with them) already decode; every row still gives
    exactly generate's tokens, greedy and seeded, and a request cancelled while its prompt is read ends with no
    tokens."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=16, prefill_chunk=4)
    sch.close()  # no thread: _step is driven here
    prompts = ["a", "hello there", "x y", "the long prompt, with words: ok"]
    texts, first_delta = {}, {}

    def on(i):
        def f(ev):
            if ev[0] == "delta":
                texts[i] = texts.get(i, "") + ev[2]
                first_delta.setdefault(i, sch.steps)
        return f

    reqs = [GenerationRequest(prompt_ids=tok.encode(p), on_event=on(i),
                              params=SamplingParams(max_new_tokens=30, temperature=0 if i % 2 else 0.9, seed=i))
            for i, p in enumerate(prompts)]
    gone = GenerationRequest(prompt_ids=tok.encode("a prompt to cancel"), params=SamplingParams(max_new_tokens=5),
                             on_event=lambda ev: texts.setdefault("gone", []).append(ev))
    with torch.inference_mode():
        sch._step(reqs + [gone])
        assert sch.prefills == 1 and len(sch._rows) == 2 and sch.stats()["prefilling"] == 3
        gone.cancel()
        while sch._rows or sch._prefilling:
            sch._step([])
    assert sch.prefill_chunks == 3 + 8  # ceil(11 / 4) + ceil(31 / 4); the cancelled one read none
    assert first_delta[0] == first_delta[2] == 0 and first_delta[1] >= 2 and first_delta[3] >= 10
    for i, p in enumerate(prompts):
        assert texts.get(i, "") == ref_text(mt, tok.encode(p), 30, 0 if i % 2 else 0.9, i), p
    assert texts["gone"] == [("done", {"prompt_tokens": 18, "completion_tokens": 0, "total_tokens": 18})]
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(model, tok, prefill_chunk=0)


def test_chunked_prefill_keeps_one_host_sync_per_step(mt):
    """Reading a long prompt chunk by chunk adds no wait for the device: over the same 24 steps the scheduler
    syncs as often with chunked prefill as without -- once per step (every running row's sampled ids, the last
    step's sampled in the next) and once per row that joins (its first token); the padded prefill of the short
    prompts checks no positions (``check_ids=False``: the scheduler made them), so it waits for nothing."""
    from collections import Counter

    from support.host_syncs import HostSyncCounter

    model, tok = mt
    counts = {}
    for chunk in (None, 4):
        sch = Scheduler(model, tok, max_batch=8, prefill_chunk=chunk)
        sch.close()  # no thread: _step is driven here
        reqs = [GenerationRequest(tok.encode("ab"), SamplingParams(max_new_tokens=200, temperature=0)),
                GenerationRequest(tok.encode("a b."), SamplingParams(max_new_tokens=200, temperature=0.8, seed=1)),
                GenerationRequest(tok.encode("the long prompt, with words: ok"),  # 31 tokens: 8 chunks of 4
                                  SamplingParams(max_new_tokens=200, temperature=0.9, seed=2, top_k=5))]
        with torch.inference_mode(), HostSyncCounter() as counter:
            sch._step(reqs)
            for _ in range(23):
                sch._step([])
        assert len(sch._rows) == 3 and sch.steps == 24
        assert sch.prefill_chunks == (0 if chunk is None else 8)
        counts[chunk] = Counter(e.origin.name for e in counter.events)
    assert counts[None] == counts[4] == {"decoderlab.generation.scheduler.Scheduler._sample": 23 + 3}, counts


@contextlib.contextmanager
def eager_compiled_scheduler(model, tok):
    """``model``'s decode step compiled with dynamo's own backend ("eager": tracing only, no Inductor) and a
    scheduler without its thread (``_step`` driven by the test); yields (scheduler, the list of compiles started),
    and resets dynamo and the model's step after."""
    from torch._dynamo.callback import callback_handler

    compiles = []
    start = lambda *_: compiles.append(1)  # noqa: E731
    torch._dynamo.reset()
    callback_handler.register_start_callback(start)
    try:
        model.compile_decode(backend="eager")
        sch = Scheduler(model, tok, max_batch=4)
        sch.close()  # no thread: _step is driven here
        yield sch, compiles
    finally:
        callback_handler.remove_start_callback(start)
        model.compiled_decode = None
        torch._dynamo.reset()


def test_a_compiled_step_compiles_one_graph_for_every_length_of_the_timeline():
    """The scheduler hands a compiled step the timeline's length (and the rows' position) as sizes dynamic from
    the first compile: one graph serves one row at every length (dynamo compiled a graph for the first length
    it saw, then a second, dynamic one -- two compiles of the whole model, half of SmolLM2's 265 s warm-up).
    Dynamo's own backend counts the graphs; the texts stay generate's."""
    model, tok = tiny_model("baby-shakespeare")
    with eager_compiled_scheduler(model, tok) as (sch, compiles):
        for prompt in ("a", "hello there"):  # the warm-up's one token, then a first client's longer prompt
            text = []
            req = GenerationRequest(prompt_ids=tok.encode(prompt), on_event=lambda ev: ev[0] == "delta" and
                                    text.append(ev[2]), params=SamplingParams(max_new_tokens=6, temperature=0))
            with torch.inference_mode():
                sch._step([req])
                while sch._rows:
                    sch._step([])
            model.compiled_decode, compiled = None, model.compiled_decode  # (the reference decodes eagerly)
            assert "".join(text) == ref_text((model, tok), tok.encode(prompt), 6, 0, None), prompt
            model.compiled_decode = compiled
    assert len(compiles) == 1, compiles


def test_a_compiled_step_compiles_one_graph_for_every_batch_of_two_or_more_rows():
    """Rows joining and leaving change the batch (2, 3, 4 rows, then fewer) and the padding mask's columns: the
    scheduler hands them to a compiled step as dynamic sizes, and the block-weight embedding's dequantize op takes
    its row count as a SymInt -- so one graph serves every batch of 2 or more (an ``int`` there fixed the row
    count: a compile of the whole model at each new batch size while every request waited). The one-row step
    (the warm-up's) and a one-row step under a mask are graphs of their own: at most three in all. The texts
    stay generate's, on the q8_0 model."""
    model, tok = tiny_model("baby-shakespeare")
    quantize_model(model, "q8_0")
    prompts = ["a", "hello", "to be", "the cat sat", "xyz"]
    with eager_compiled_scheduler(model, tok) as (sch, compiles):
        texts = {k: [] for k in range(len(prompts))}
        reqs = [GenerationRequest(prompt_ids=tok.encode(p), on_event=lambda ev, k=k: ev[0] == "delta" and
                                  texts[k].append(ev[2]), params=SamplingParams(max_new_tokens=4 + 2 * k,
                                                                                temperature=0))
                for k, p in enumerate(prompts)]
        for r in reqs:
            sch._prepare(r)
        with torch.inference_mode():
            for r in reqs:  # one more row a step: 1, 2, 3, 4 rows, as the first ends a fifth
                sch._step([r])
            while sch._rows:
                sch._step([])
        model.compiled_decode = None  # (the reference decodes eagerly)
        for k, p in enumerate(prompts):
            assert "".join(texts[k]) == ref_text((model, tok), tok.encode(p), 4 + 2 * k, 0, None), p
    assert len(compiles) <= 3, compiles
