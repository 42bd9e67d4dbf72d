"""The generation engine: the KV cache equals the lesson's loop, seeded sampling with and without the cache,
batches equal each prompt alone, and the engine's argument checks."""

import random

import pytest
import torch
from tiny_models import FAMILIES, lesson_loop, make_model, one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.generation import KVCache, SamplingParams, generate, generate_batch, stream
from decoderlab.hooks import use_hooks
from decoderlab.lesson import greedy_response
from decoderlab.tokenizers import CharTokenizer


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_cache_equals_the_lesson_loop(family, kernel):
    model = make_model(family, kernel)
    cfg = model.config
    rng = random.Random(f"{family}{kernel}")
    for trial in range(3):
        t = rng.randint(1, cfg.max_len)
        prompt = [rng.randrange(cfg.num_tokens) for _ in range(t)]
        n = rng.randint(1, 2 * cfg.max_len + 3)  # most runs pass max_len
        keep = [None, cfg.max_len, 1][trial]
        k = dl.generation.default_keep(cfg.max_len) if keep is None else keep
        want = lesson_loop(model, prompt, n, k)
        assert generate(model, prompt, n, temperature=0, keep=keep) == want
        assert generate(model, prompt, n, temperature=0, keep=keep, use_cache=False) == want
    # a prompt longer than max_len continues on its last max_len tokens
    long_prompt = [rng.randrange(cfg.num_tokens) for _ in range(cfg.max_len + 3)]
    assert generate(model, long_prompt, 5, temperature=0) == lesson_loop(model, long_prompt[3:], 5,
                                                                          dl.generation.default_keep(cfg.max_len))


@pytest.mark.parametrize("static", [False, True], ids=["cache", "static cache"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_step_equals_the_model_forward(family, static):
    """The engine's one-token step (``model.decode``, then ``cache.advance(1)`` by its caller) gives the model's
    own logits (float64), unpadded and left-padded, also while the glass box records -- over a cache that
    grows and over a static one (whole-capacity buffers, the unwritten columns masked)."""
    model = make_model(family, "explicit", seed=4)
    cfg = model.config

    def step(tokens, positions, padding_mask, cache):
        if static and not isinstance(positions, torch.Tensor):
            positions = cache.column  # (a static step reads its position from the device)
        out = model.decode(tokens, positions, padding_mask, cache)
        cache.advance(1)
        return out

    torch.manual_seed(0)
    ids = torch.randint(cfg.num_tokens, (3, cfg.max_len))
    pads = torch.tensor([[0], [2], [cfg.max_len - 2]])
    pad_mask = torch.arange(cfg.max_len)[None] < pads  # (3, max_len), True = padded
    positions = (torch.arange(cfg.max_len)[None] - pads).clamp_min(0)
    with torch.no_grad():
        for padded in (False, True):
            want = model(ids, padding_mask=pad_mask if padded else None, positions=positions if padded else None)
            cache = KVCache.for_model(model, static=static)
            t0 = 2
            model(ids[:, :t0], padding_mask=pad_mask[:, :t0] if padded else None,
                  positions=positions[:, :t0] if padded else None, cache=cache)
            for t in range(t0, cfg.max_len):
                got = step(ids[:, t:t + 1], positions[:, t:t + 1] if padded else t,
                           pad_mask[:, :t + 1] if padded else None, cache)
                rows = [0, 1] if padded and t < cfg.max_len - 2 else [0, 1, 2]  # row 2 is all padding early
                assert torch.allclose(got[rows], want[rows, t], atol=1e-10, rtol=1e-12), (padded, t)
    seen = {}  # the glass box is recording: the same blocks, the same numbers
    record = ("blocks.0.attn.hook_pattern", lambda x, name: seen.update(percents=x))
    cache = KVCache.for_model(model, static=static)
    with torch.no_grad(), use_hooks(model, [record]):
        want = model(ids[:, :3])[:, 2]
        model(ids[:, :2], cache=cache)
        got = step(ids[:, 2:3], 2, None, cache)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-12)
    keys = cfg.max_len if static else 3  # a static step attends to every column (the unwritten ones masked)
    assert seen["percents"].shape == (3, cfg.n_head, 1, keys)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampling_with_the_same_seed_is_the_same_with_and_without_cache(family, kernel):
    model = make_model(family, kernel, seed=1)
    cfg = model.config
    prompt = [1, 2, 3][: cfg.max_len]
    n = 2 * cfg.max_len + 5
    for opts in (dict(), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.9)):
        a = generate(model, prompt, n, seed=11, **opts)
        assert a == generate(model, prompt, n, seed=11, use_cache=False, **opts)
        assert len(set(a)) > 1
    assert a == generate(model, prompt, n, seed=11, **opts)  # reproducible


def test_trained_statquest_cache_matches_greedy_response(statquest_checkpoint):
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    for prompt in ("what is statquest <EOS>", "statquest is what <EOS>"):
        ids = tok.encode(prompt)
        want = greedy_response(model, ids, tok.eos_id)
        got = generate(model, ids, model.config.max_len - len(ids), temperature=0)
        assert tok.decode(got) == tok.decode(want) == "awesome <EOS>"
        assert generate(model, ids, 9, temperature=0, stop=tok.eos_id) == want[:-1]


def test_generation_leaves_training_mode_and_global_rng_alone():
    model = make_model("shakespeare-char", "sdpa")  # dropout 0.2: must be off while generating
    model.train()
    state = torch.get_rng_state()
    a = generate(model, [1, 2], 15, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    assert model.training
    assert a == generate(model, [1, 2], 15, seed=3, use_cache=False)
    assert generate(model, [1, 2], 0) == []
    # the streaming twin yields the same tokens one at a time, and grad mode is not leaked to the caller
    it = stream(model, [1, 2], 15, seed=3)
    first = next(it)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert [first, *it] == a


@pytest.mark.parametrize("family,kernel", [("baby-shakespeare", "sdpa"), ("rope-rmsnorm", "explicit"),
                                           ("statquest", "explicit"), ("gpt2", "sdpa"), ("llama-gqa", "sdpa"),
                                           ("llama-gqa", "explicit"), ("gemma-sliding", "sdpa"),
                                           ("gemma-sliding", "explicit")])
def test_batch_equals_each_prompt_alone(family, kernel):
    model = make_model(family, kernel, seed=3)
    cfg = model.config
    rng = random.Random(family)
    lengths = [1, cfg.max_len, max(1, cfg.max_len // 2), 2, cfg.max_len + 2]
    prompts = [[rng.randrange(cfg.num_tokens) for _ in range(t)] for t in lengths]
    n = 2 * cfg.max_len + 1
    for opts in (dict(temperature=0), dict(seed=21, temperature=0.9, top_k=4)):
        batch = generate_batch(model, prompts, n, **opts)
        assert batch == [generate(model, p, n, **opts) for p in prompts]
    assert batch == generate_batch(model, prompts, n, use_cache=False, **opts)
    # stops end rows at different times; per-row seeds
    alone = [generate(model, p, n, seed=s) for p, s in zip(prompts, range(5))]
    stop = alone[0][3]
    batch = generate_batch(model, prompts, n, seed=list(range(5)), stop=stop)
    assert batch == [generate(model, p, n, seed=s, stop=stop) for p, s in zip(prompts, range(5))]
    assert batch[0] == alone[0][: alone[0].index(stop)]


@pytest.mark.parametrize("family,kernel", [("rope-rmsnorm", "explicit"), ("gpt2", "sdpa"), ("llama-gqa", "sdpa"),
                                           ("gemma-sliding", "sdpa"), ("gemma-sliding", "explicit")])
def test_rows_with_the_same_prompt_are_prefilled_once_and_each_equals_its_row_alone(family, kernel, monkeypatch):
    """The samples of one prompt (RL's groups, the report card's k samples) share a prefill: the distinct
    windows run through the model once, their KV cache rows copied to every row -- padded, longer than the
    context, sliding rings; every row's tokens are still generate's alone with its own seed."""
    from decoderlab.generation import engine

    model = make_model(family, kernel, seed=4)
    cfg = model.config
    rng = random.Random(family)
    distinct = [[rng.randrange(cfg.num_tokens) for _ in range(t)] for t in (2, cfg.max_len - 1, cfg.max_len + 3)]
    prompts = [distinct[i] for i in (0, 1, 0, 2, 0, 1, 2)]
    firsts, first_rows = [], engine._first_rows
    monkeypatch.setattr(engine, "_first_rows", lambda slot: firsts.append(first_rows(slot)) or firsts[-1])
    n = cfg.max_len + 2  # (every window slides once: the re-prefill's windows differ, nothing shared)
    batch = generate_batch(model, prompts, n, seed=list(range(7)), temperature=0.9)
    assert batch == [generate(model, p, n, seed=s, temperature=0.9) for s, p in enumerate(prompts)]
    assert firsts[0] == [0, 1, 3] and len(set(map(tuple, batch))) > 3  # (a prompt's samples differ)


@pytest.mark.parametrize("family,kernel", [("llama-gqa", "sdpa"), ("gemma-sliding", "sdpa"), ("gpt2", "sdpa")])
def test_a_batch_wide_enough_for_the_matmul_step_equals_each_prompt_alone(family, kernel):
    """From MATMUL_DECODE_ROWS rows a step's attention is two products (attention._decode_attention): a batch
    of 40 padded prompts -- grouped-query heads, sliding rings, learned positions -- still gives each row's
    tokens alone (alone: one row, the fused kernel), greedy and sampled."""
    from decoderlab.attention import MATMUL_DECODE_ROWS

    model = make_model(family, kernel, seed=5)
    cfg = model.config
    rng = random.Random(7)
    prompts = [[rng.randrange(cfg.num_tokens) for _ in range(rng.randint(1, cfg.max_len))] for _ in range(40)]
    assert len(prompts) >= MATMUL_DECODE_ROWS
    for opts in (dict(temperature=0), dict(temperature=0.9)):
        batch = generate_batch(model, prompts, cfg.max_len, seed=list(range(40)), **opts)
        assert batch == [generate(model, p, cfg.max_len, seed=s, **opts) for s, p in enumerate(prompts)]


def test_bad_inputs():
    model = make_model("baby-shakespeare", "sdpa")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        generate(model, [1], -1)
    for t in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            generate(model, [1], 3, temperature=t)
    for p in (0, 0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            generate(model, [1], 3, top_p=p)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0, got -1"):  # 0: no top-k filter
        generate(model, [1], 3, top_k=-1)
    with pytest.raises(ValueError, match=r"token id 65 is out of range; allowed ids are 0 \.\. 64"):
        generate(model, [1, 65], 3)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        generate_batch(model, [[1], [-1]], 3)
    with pytest.raises(ValueError, match="empty and the model has no start token"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="keep must be in 1 .. max_len=12"):
        generate(model, [1], 3, keep=13)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate_batch(model, [], 3)
    with pytest.raises(ValueError, match="one int per prompt"):
        generate_batch(model, [[1], [2]], 3, seed=[1, 2, 3])


def test_empty_prompt_starts_from_eos():
    tok = CharTokenizer.from_text("abc def")
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=8,
                                                n_layer=1, n_head=2, max_len=8)).double()
    plain = dict(suppress_tokens=(), stop_at_eos=False)  # the tokenizer only for its start token
    assert generate(model, [], 6, seed=1, tokenizer=tok, **plain) == generate(model, [tok.eos_id], 6, seed=1)


def test_numbers_of_any_kind_are_accepted():
    import numpy as np

    model = make_model("baby-shakespeare", "sdpa", seed=2)
    want = generate(model, [5], 12, temperature=0.7, top_k=3, top_p=0.9, seed=4, keep=6)
    for kinds in (dict(top_k=np.int64(3), temperature=np.float32(0.7), top_p=np.float64(0.9)),
                  dict(top_k=torch.tensor(3), temperature=torch.tensor(0.7, dtype=torch.float64),
                       top_p=torch.tensor(0.9, dtype=torch.float64)),
                  dict(top_k=3, temperature=0.7, top_p=0.9, seed=np.int64(4), keep=np.int32(6)),
                  dict(top_k=3, temperature=0.7, top_p=0.9, max_new_tokens=torch.tensor(12))):
        kw = dict(temperature=0.7, top_k=3, top_p=0.9, seed=4, keep=6, max_new_tokens=12, **{})
        kw.update(kinds)
        n = kw.pop("max_new_tokens")
        got = generate(model, [5], n, **kw)
        if kinds.get("temperature") is not None and isinstance(kinds["temperature"], np.float32):
            assert got == generate(model, [5], 12, temperature=float(np.float32(0.7)), top_k=3, top_p=0.9, seed=4,
                                   keep=6)
        else:
            assert got == want
    assert generate(model, np.array([5, 6]), 4, temperature=0) == generate(model, [5, 6], 4, temperature=0)
    assert generate(model, [5], 4, temperature=0, stop=np.int64(3)) == generate(model, [5], 4, temperature=0,
                                                                                   stop=3)
    # top_k=0 means no top-k filter (as in Hugging Face)
    assert generate(model, [5], 20, top_k=0, seed=4) == generate(model, [5], 20, seed=4)
    # still refused: bools, floats for integers, text, tensors with more than one value
    for bad in (True, 3.0, "3", torch.tensor([3, 4])):
        with pytest.raises(TypeError, match="top_k must be an integer >= 0"):
            generate(model, [5], 3, top_k=bad)
    with pytest.raises(TypeError, match="temperature must be a number >= 0"):
        generate(model, [5], 3, temperature="hot")


def test_a_seed_or_prompt_of_the_wrong_kind_is_named():
    """seed="abc" was read as three seeds ("got 3 seeds"); bytes were read as token ids."""
    model = make_model("baby-shakespeare", "sdpa")
    with pytest.raises(TypeError, match=r"seed must be an integer in 0 \.\. 2\*\*63-1, got 'abc'"):
        generate(model, [1], 3, seed="abc")
    with pytest.raises(TypeError, match=r"seed must be an integer in 0 \.\. 2\*\*63-1, got 'abc'"):
        generate_batch(model, [[1], [2]], 3, seed="abc")
    with pytest.raises(TypeError, match=r"prompt_ids is bytes \(b'hi'\); pass text \(a str, decoded\) or a list"):
        generate(model, b"hi", 3)
    with pytest.raises(TypeError, match=r"prompts\[1\] is bytes"):
        generate_batch(model, [[1], b"hi"], 3)
    with pytest.raises(TypeError, match="unknown sampling setting temprature"):
        generate(model, [1], 3, temprature=0)


def test_batch_rows_with_their_own_settings_equal_each_alone():
    """generate_batch with one SamplingParams per prompt: every row its own settings and token limit."""
    model = make_model("rope-rmsnorm", "explicit", seed=8)
    prompts = [[1, 2], [3], [4, 5, 6, 7], [8]]
    rows = [SamplingParams(max_new_tokens=20, temperature=0),
            SamplingParams(max_new_tokens=7, temperature=0.8, top_k=5, seed=2),
            SamplingParams(max_new_tokens=20, top_p=0.7, min_p=0.1, seed=3, stop=[9]),
            SamplingParams(max_new_tokens=0)]
    alone = [generate(model, p, r) for p, r in zip(prompts, rows)]
    assert [len(a) for a in alone][1] == 7 and alone[3] == []
    assert generate_batch(model, prompts, rows) == alone
    assert generate_batch(model, prompts, rows, use_cache=False) == alone
    assert generate_batch(model, prompts, 12, seed=[5, 6, 7, 8]) == [generate(model, p, 12, seed=s)
                                                                      for p, s in zip(prompts, [5, 6, 7, 8])]
    with pytest.raises(ValueError, match=r"params must be one SamplingParams or one per prompt \(4\), got 2"):
        generate_batch(model, prompts, rows[:2])


def test_rows_that_are_done_leave_the_batch_and_the_others_keep_their_tokens(monkeypatch):
    """Rows done early leave generate_batch's batch once a quarter of the rows stepped are done -- their cache
    rows, seeded generators and penalty counts with them -- and every row's tokens stay those it gets alone."""
    from decoderlab.generation import engine

    model = make_model("llama-gqa", "sdpa", seed=5)
    prompts = [[1, 2], [3], [4, 5, 6], [7], [2, 9, 9]]
    rows = [SamplingParams(max_new_tokens=n, seed=s, temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4)
            for n, s in zip((3, 20, 6, 20, 11), range(5))]
    alone = [generate(model, p, r) for p, r in zip(prompts, rows)]
    sizes, retire = [], engine._Windows.retire
    monkeypatch.setattr(engine._Windows, "retire", lambda self, keep: sizes.append(len(keep)) or retire(self, keep))
    assert generate_batch(model, prompts, rows) == alone
    # row 0 done after 3 tokens (1 of 5: stays), row 2 after 6 (2 of 5: both leave), row 4 after 11 (1 of 3)
    assert sizes == [3, 2]
    greedy = [SamplingParams(max_new_tokens=n, temperature=0) for n in (1, 2, 9, 9)]
    assert generate_batch(model, prompts[:4], greedy) == [generate(model, p, r) for p, r in zip(prompts, greedy)]


# ----------------------------------------------------------------------------------------------------------
# Host syncs: counted on the CPU, where they cost nothing but are the calls that stall a GPU
# ----------------------------------------------------------------------------------------------------------

#: sampled settings that run every kind of processor (penalties, top-k, top-p, temperature) and the draw
SAMPLED = dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.5, seed=1)


@pytest.mark.parametrize("settings", [dict(temperature=0), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family,kernel", [("gpt2", "sdpa"), ("rope-rmsnorm", "sdpa"), ("statquest", "explicit"),
                                           ("shakespeare-char", "explicit")])
def test_a_decode_step_waits_for_the_device_once_per_token(family, kernel, settings):
    """One host sync per token, for the sampled ids the host must read -- with learned, sinusoidal and rotary
    positions, both kernels, greedy and sampled (every processor), one prompt and a left-padded batch, and
    windows that slide (re-prefilled) twice. The ids are checked once per call, on the host."""
    from support.host_syncs import HostSyncCounter

    model = make_model(family, kernel, seed=3)
    n = 3 * model.config.max_len
    with HostSyncCounter() as one:
        ids = generate(model, [1, 2], n, **settings)
    with HostSyncCounter() as batch:
        rows = generate_batch(model, [[1], [1, 2, 3], [2, 2]], n, **settings)
    assert len(ids) == n and [len(r) for r in rows] == [n] * 3
    for counter in (one, batch):
        assert len(counter) == n, "more than the sampled ids per token:\n" + counter.report()
        assert {e.origin.name for e in counter.events} == {"decoderlab.generation.engine._steps"}


def test_a_row_with_no_token_to_choose_raises_from_the_host_copy():
    """The sampler flags a row it cannot choose for (NaN logits; every token suppressed) instead of asking the
    device; the engine raises the sampler's error from the ids it reads anyway."""
    model = make_model("gpt2", "sdpa", seed=3)
    with torch.no_grad():
        model.norm_f.weight.fill_(float("nan"))
    for settings in (dict(temperature=0), SAMPLED):
        with pytest.raises(ValueError, match="the model's logits hold NaN"):
            generate(model, [1, 2], 3, **settings)
    model = make_model("gpt2", "sdpa", seed=3)
    every = list(range(model.config.num_tokens))
    with pytest.raises(ValueError, match="every logit of a row is -inf"):
        generate_batch(model, [[1], [2, 3]], [SamplingParams(max_new_tokens=3, temperature=0),
                                              SamplingParams(max_new_tokens=3, suppress_tokens=every)])


# ----------------------------------------------------------------------------------------------------------
# A decode step that compiles
# ----------------------------------------------------------------------------------------------------------


def _dynamo_counts():
    from torch._dynamo.utils import counters

    return dict(counters["stats"]), sum(counters["recompiles"].values()), dict(counters["graph_break"])


@pytest.mark.parametrize("family", ["gpt2", "rope-rmsnorm", "llama-gqa", "gemma-sliding"])
def test_the_decode_step_compiles_to_one_graph_for_the_whole_context(family):
    """``model.compile_decode`` (``torch.compile(model.decode, fullgraph=True)``) with the static KV cache the
    engine then keeps: 40 tokens -- greedy and sampled, a one-token prompt (its prefill is a step too), a longer
    one and a left-padded batch, past max_len so the window slides -- trace one graph per kind of call (unpadded, padded), never recompile as the context grows,
    and give the eager tokens. Dynamo's own counters are read; the "eager" backend traces exactly what
    Inductor would compile, without the C++ compiler (``bench/generate.py`` times Inductor)."""
    import torch._dynamo

    model = make_model(family, "sdpa", seed=5)
    prompts = [[1], [1, 2, 3], [2, 2]]
    want = [generate(model, [1], 40, temperature=0), generate(model, [1, 2], 40, **SAMPLED),
            generate_batch(model, prompts, 40, temperature=0), generate_batch(model, prompts, 40, **SAMPLED)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        model.compile_decode(backend="eager")
        got = [generate(model, [1], 40, temperature=0), generate(model, [1, 2], 40, **SAMPLED)]
        stats, recompiles, breaks = _dynamo_counts()
        assert stats["unique_graphs"] == 1 and recompiles == 0 and not breaks, (stats, recompiles, breaks)
        got += [generate_batch(model, prompts, 40, temperature=0), generate_batch(model, prompts, 40, **SAMPLED)]
        stats, recompiles, breaks = _dynamo_counts()
        # the padded batch is a new kind of call (B = 3, per-row positions, a padding mask): one more graph
        assert stats["unique_graphs"] == 2 and not breaks, (stats, breaks)
        assert got == want
    finally:
        model.compiled_decode = None
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama-gqa", marks=pytest.mark.slow)])
def test_the_inductor_step_through_its_cpp_wrapper_gives_the_eager_tokens(family):
    """The real compiled step, as ``generate --compile`` makes it on a CPU: Inductor with its C++ wrapper
    (``compile_decode()``'s default there). Greedy and seeded sampled tokens equal eager's over a window that
    slides. The step holds no host sync: it is one graph (``fullgraph=True`` raises at a graph break, which a
    read of a tensor's value would be), so a token waits for the device only where an eager one does, outside
    the step (counted above; the sync counter's dispatch mode cannot run under torch.compile). One graph
    (batch 1) is compiled: about half a minute with a C++ compiler on a loaded 2-core machine."""
    from torch._inductor import config as inductor_config

    model = make_model(family, "sdpa", seed=5)
    n = 2 * model.config.max_len
    want = [generate(model, [1], n, temperature=0), generate(model, [1, 2], n, **SAMPLED)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        step = model.compile_decode()
        got = [generate(model, [1], n, temperature=0), generate(model, [1, 2], n, **SAMPLED)]
        stats, recompiles, breaks = _dynamo_counts()
        assert step is model.compiled_decode and got == want
        assert stats["unique_graphs"] == 1 and recompiles == 0 and not breaks, (stats, recompiles, breaks)
        assert inductor_config.cpp_wrapper is False  # (the option is the compiled step's own, not global)
    finally:
        model.compiled_decode = None
        torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True])
def test_a_static_cache_not_zeroed_never_reads_its_unwritten_columns(padded):
    """A static cache the AOT step decodes over starts as garbage (``zero_unwritten=False``: not zeroed at every
    call). Filled with NaN, then a one-token prefill and eager steps over it (the window unset: the written
    columns are read), give the logits of a zeroed cache exactly -- a NaN read under a mask would leak (0 x NaN)."""
    from decoderlab.attention import KVCache

    model = make_model("gpt2", "sdpa", seed=5)
    rows = 3 if padded else 1
    pm = torch.zeros(rows, model.config.max_len, dtype=torch.bool)
    if padded:
        pm[0, 0] = True  # row 0 is padded at column 0
    outs = []
    for zero in (True, False):
        cache = KVCache.for_model(model, static=True, zero_unwritten=zero)
        with torch.inference_mode():
            logits = [model(torch.ones(rows, 1, dtype=torch.long), cache=cache, last_only=True, check_ids=False,
                            **({"padding_mask": pm[:, :1] & False} if padded else {}))[:, -1]]
            if not zero:  # (the forward pass advanced the cache past the prefill's column 0)
                for layer in cache.layers:
                    layer.k[:, :, 1:].fill_(float("nan"))
                    layer.v[:, :, 1:].fill_(float("nan"))
            for t in range(2, 6):
                positions = cache.column if not padded else (cache.column - pm[:, :1].long()).view(rows, 1)
                logits.append(model.decode(torch.full((rows, 1), t), positions, pm if padded else None, cache))
                cache.advance(1)
        outs.append(torch.stack(logits))
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


def test_a_text_prompt_starts_with_the_start_token_its_tokenizer_puts_first(llama_directory):
    """A Llama 2 / TinyLlama-style tokenizer (add_bos_token) reads a text prompt as transformers'
    ``tokenizer(text)`` does, <s> first, and the greedy tokens are transformers' after those ids; ids are
    taken as given."""
    from hf.families import greedy_tokens

    from decoderlab.generation.engine import check_prompt

    path, hf, auto = llama_directory
    m = dl.load(path)
    tok, text = m.tokenizer, "To be, or not to be"
    ids = auto(text)["input_ids"]
    assert ids[0] == auto.bos_token_id == tok.bos_id and ids[1:] == tok.encode(text)
    want = greedy_tokens(hf, ids, 12)
    assert want != greedy_tokens(hf, ids[1:], 12)  # the start token changes what this model writes
    assert check_prompt(m.model, text, tok) == ids and check_prompt(m.model, ids[1:], tok) == ids[1:]
    greedy = dict(temperature=0, stop_at_eos=False, tokenizer=tok)
    assert generate(m.model, text, 12, **greedy) == generate(m.model, ids, 12, **greedy) == want
    assert list(stream(m.model, text, 12, **greedy)) == want
    assert generate_batch(m.model, [text, ids[1:]], 12, **greedy) == [want, greedy_tokens(hf, ids[1:], 12)]
