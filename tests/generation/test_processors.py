"""The logits processors: each equals a float64 reference computed by hand on hand-made logits, per-row
settings equal each row alone, the order of the pipeline, and each processor's own argument checks."""

import math

import pytest
import torch
from tiny_models import make_model, one_thread  # noqa: F401 -- one_thread: autouse

from decoderlab.generation import (FrequencyPenalty, LogitBias, LogitsProcessorList, MinP, PresencePenalty,
                                   RepetitionPenalty, Sampler, SamplingParams, SuppressTokens, Temperature,
                                   TokenCounts, TopK, TopP, generate, generate_batch)

INF = float("inf")
# one row of hand-made logits over a vocabulary of 6; the prompt holds token 0, the model generated 1, 1, 2
LOGITS = [2.0, -1.0, 0.5, -3.0, 0.0, 1.5]
PROMPT, GENERATED = [0], [1, 1, 2]


def counts_for(prompts, generated, v=6):
    c = TokenCounts.for_prompts(prompts, v)
    for step in zip(*generated):
        c.add(torch.tensor(step))
    return c


def row(values):
    return torch.tensor([values], dtype=torch.float64)


def test_token_counts_count_the_generated_tokens_and_mark_the_prompt():
    c = counts_for([PROMPT, [3, 3]], [GENERATED, [4, 4, 4]])
    assert c.generated.tolist() == [[0, 2, 1, 0, 0, 0], [0, 0, 0, 0, 3, 0]]
    assert c.in_prompt.tolist() == [[True] + [False] * 5, [False] * 3 + [True] + [False] * 2]
    assert c.seen.tolist()[0] == [True, True, True, False, False, False]
    both = TokenCounts.cat([counts_for([PROMPT], [GENERATED]), counts_for([[3, 3]], [[4, 4, 4]])])
    assert torch.equal(both.generated, c.generated) and torch.equal(both.in_prompt, c.in_prompt)


def test_repetition_penalty_is_ctrl_over_prompt_and_generated_tokens():
    """CTRL / Hugging Face: a seen token's logit >= 0 is divided by the penalty, a negative one multiplied."""
    p = 1.5
    # seen: 0 (prompt), 1 and 2 (generated); 3, 4, 5 unseen and unchanged
    want = [2.0 / 1.5, -1.0 * 1.5, 0.5 / 1.5, -3.0, 0.0, 1.5]
    got = RepetitionPenalty(p)(row(LOGITS), counts_for([PROMPT], [GENERATED]))
    assert got.tolist() == [want]
    assert RepetitionPenalty(1.0)(row(LOGITS), counts_for([PROMPT], [GENERATED])).tolist() == [LOGITS]


def test_frequency_and_presence_penalties_are_openais_over_the_generated_tokens():
    """OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty; the prompt does not count."""
    counts = counts_for([PROMPT], [GENERATED])  # c = [0, 2, 1, 0, 0, 0]
    freq, pres = 0.5, 0.25
    want = [2.0, -1.0 - 2 * 0.5 - 0.25, 0.5 - 1 * 0.5 - 0.25, -3.0, 0.0, 1.5]
    got = PresencePenalty(pres)(FrequencyPenalty(freq)(row(LOGITS), counts), counts)
    assert torch.allclose(got, row(want), rtol=0, atol=1e-15)
    assert FrequencyPenalty(-1.0)(row(LOGITS), counts).tolist() == [[2.0, 1.0, 1.5, -3.0, 0.0, 1.5]]  # < 0 favours


def test_logit_bias_adds_and_minus_100_bans():
    got = LogitBias({1: 2.5, "3": -100, 5: -0.5})(row(LOGITS))  # a JSON-style string key is the id
    assert got.tolist() == [[2.0, 1.5, 0.5, -INF, 0.0, 1.0]]
    assert LogitBias({0: 100})(row(LOGITS)).tolist() == [[102.0, *LOGITS[1:]]]
    # a ban holds also against a logit of +inf and when greedy
    assert Sampler(temperature=0, logit_bias={0: -100})(row(LOGITS), []).tolist() == [5]


def test_suppress_tokens():
    assert SuppressTokens([0, 5])(row(LOGITS)).tolist() == [[-INF, *LOGITS[1:5], -INF]]
    assert SuppressTokens([7])(row(LOGITS)).tolist() == [LOGITS]  # ids past this vocabulary change nothing


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_probable():
    probs = [0.5, 0.3, 0.12, 0.05, 0.03]
    logits = row([math.log(q) for q in probs])
    kept = lambda m: torch.isfinite(MinP(m)(logits))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.2) == [0, 1, 2]  # threshold 0.1
    assert kept(0.5) == [0, 1]  # 0.25
    assert kept(0.9) == [0]  # 0.45
    assert kept(0.05) == [0, 1, 2, 3, 4]  # 0.025
    assert MinP(0.0).value is None and MinP(0)(logits).tolist() == logits.tolist()  # 0 is off
    # min-p reads the scaled distribution: at temperature 2 the ratios are square roots (0.12 / 0.5 = 0.24 is
    # below 0.45, its square root 0.49 above)
    assert kept(0.45) == [0, 1]
    s = Sampler(temperature=2.0, min_p=0.45)
    assert torch.isfinite(s.filter(logits))[0].nonzero().flatten().tolist() == [0, 1, 2]


def test_temperature_top_k_top_p_by_hand():
    z = row(LOGITS)
    assert Temperature(0.5)(z).tolist() == [[x / 0.5 for x in LOGITS]]
    assert TopK(2)(z).tolist() == [[2.0, -INF, -INF, -INF, -INF, 1.5]]
    assert TopK(0).value is None and TopK(0)(z).tolist() == [LOGITS]  # 0: no filter
    total = sum(math.exp(x) for x in LOGITS)
    probs = [math.exp(x) / total for x in LOGITS]  # most probable first: 0, 5, 2, 4, 1, 3
    two = probs[0] + probs[5]
    assert torch.isfinite(TopP(two - 1e-9)(z))[0].nonzero().flatten().tolist() == [0, 5]  # two reach it
    assert torch.isfinite(TopP(two + 1e-9)(z))[0].nonzero().flatten().tolist() == [0, 2, 5]  # a third is needed
    assert TopP(1.0)(z).tolist() == [LOGITS]


def test_the_pipeline_runs_in_the_documented_order():
    """Sampler.filter = penalties, bias, suppression (raw), then temperature, top-k, top-p, min-p -- here
    checked against the formulas written out in that order in float64."""
    counts = counts_for([PROMPT], [GENERATED])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={4: 3.0, 3: -100}, suppress_tokens=(5,), temperature=0.5, top_k=3)
    c = [0, 2, 1, 0, 0, 0]
    seen = [True, True, True, False, False, False]
    want = []
    for j, x in enumerate(LOGITS):
        if seen[j]:
            x = x * 1.5 if x < 0 else x / 1.5
        x = x - c[j] * 0.5 - (c[j] > 0) * 0.25
        x = x + {4: 3.0}.get(j, 0.0)
        if j in (3, 5):
            x = -INF
        want.append(x / 0.5)
    kth = sorted(want, reverse=True)[2]
    want = [x if x >= kth else -INF for x in want]
    sampler = Sampler(params)
    assert [p.field for p in sampler.raw + sampler.warpers] == [
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "suppress_tokens",
        "temperature", "top_k"]
    got = sampler.filter(row(LOGITS), counts)
    assert torch.allclose(got, row(want), rtol=0, atol=1e-14)
    by_hand = LogitsProcessorList([RepetitionPenalty(1.5), FrequencyPenalty(0.5), PresencePenalty(0.25),
                                   LogitBias({4: 3.0, 3: -100}), SuppressTokens([5]), Temperature(0.5), TopK(3)])
    assert torch.equal(by_hand(row(LOGITS), counts), got) and by_hand.uses_counts
    assert torch.isinf(got).tolist() == [[False, True, False, True, False, True]]
    # greedy: the argmax after the raw processors (token 4 carries the bias; 0 is penalised)
    assert Sampler(params.replace(temperature=0))(row(LOGITS), [], counts).tolist() == [4]


SETTINGS = [dict(), dict(temperature=0.7, top_k=2), dict(top_p=0.6), dict(min_p=0.3, temperature=1.3),
            dict(repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=-0.3, logit_bias={5: -1.0}),
            dict(temperature=0, repetition_penalty=2.0), dict(temperature=0, logit_bias={3: 9.0}),
            dict(suppress_tokens=(0, 1), top_k=4, top_p=0.9)]


def test_per_row_settings_equal_each_row_alone():
    """Rows with different settings in one call give each row's own result (float64, exactly)."""
    torch.manual_seed(0)
    logits = torch.randn(len(SETTINGS), 6, dtype=torch.float64) * 2
    prompts = [[i % 6] for i in range(len(SETTINGS))]
    generated = [[(i + 1) % 6, (2 * i) % 6, (i + 1) % 6] for i in range(len(SETTINGS))]
    counts = counts_for(prompts, generated)
    rows = [SamplingParams(**s) for s in SETTINGS]
    batch = Sampler(rows)
    assert any(p.values is not None for p in batch.raw + batch.warpers)  # per-row values, not one shared
    together = batch.filter(logits, counts)
    gens = [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(rows)]
    ids = batch(logits, gens, counts)
    for i, p in enumerate(rows):
        alone = Sampler(p)
        one = counts_for([prompts[i]], [generated[i]])
        assert torch.equal(together[i:i + 1], alone.filter(logits[i:i + 1], one)), SETTINGS[i]
        g = [] if p.greedy else [torch.Generator().manual_seed(i)]
        assert ids[i] == alone(logits[i:i + 1], g, one)[0], SETTINGS[i]
    # per-row values also when built directly (and shared values broadcast to any number of rows)
    two = row(LOGITS).expand(2, 6)
    assert TopK.per_row([1, None])(two).tolist() == [[2.0] + [-INF] * 5, LOGITS]
    assert Temperature.per_row([0.5, 2.0])(two).tolist() == [[x / 0.5 for x in LOGITS], [x / 2 for x in LOGITS]]
    assert TopK(1)(two).tolist() == [[2.0] + [-INF] * 5] * 2
    with pytest.raises(ValueError, match="settings for 2 rows, got logits for 3"):
        TopK.per_row([1, 2])(row(LOGITS).expand(3, 6))


@pytest.mark.parametrize("make, message", [
    (lambda: RepetitionPenalty(0), r"repetition_penalty must be a finite number > 0 \(1 = off\), got 0.0"),
    (lambda: RepetitionPenalty(float("inf")), "repetition_penalty must be a finite number > 0"),
    (lambda: FrequencyPenalty(2.5), r"frequency_penalty must be a number from -2 to 2 \(0 = off\), got 2.5"),
    (lambda: PresencePenalty(-3), "presence_penalty must be a number from -2 to 2"),
    (lambda: PresencePenalty(float("nan")), "presence_penalty must be a number from -2 to 2"),
    (lambda: MinP(1.5), r"min_p must be a number from 0 to 1 \(0 = off\), got 1.5"),
    (lambda: MinP(-0.1), "min_p must be a number from 0 to 1"),
    (lambda: LogitBias({3: 101}), r"logit_bias\[3\] must be a number from -100 to 100 \(-100 bans the token\), "
                                  r"got 101.0"),
    (lambda: LogitBias({1: 1, "1": 2}), "logit_bias gives token id 1 twice"),
    (lambda: TopK(-1), "top_k must be an integer >= 0, got -1"),
    (lambda: TopP(0), r"top_p must be in \(0, 1\]"),
    (lambda: Temperature(-1), "temperature must be a finite number >= 0"),
    (lambda: Temperature(0), "temperature 0 is greedy"),
    (lambda: SuppressTokens([-1]), "suppress_tokens id must be an integer >= 0, got -1"),
])
def test_each_processor_checks_its_own_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make, message", [
    (lambda: RepetitionPenalty("1.2"), "repetition_penalty must be a finite number > 0"),
    (lambda: FrequencyPenalty(True), "frequency_penalty must be a number from -2 to 2"),
    (lambda: LogitBias([(1, 2)]), "logit_bias must be a map of token id -> bias"),
    (lambda: LogitBias({"x": 1}), r"logit_bias keys must be token ids \(integers >= 0\), got 'x'"),
    (lambda: LogitBias({-1: 1}), r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
    (lambda: MinP("0.1"), "min_p must be a number from 0 to 1"),
    (lambda: SuppressTokens("ab"), "suppress_tokens must be a sequence of token ids"),
    (lambda: TopK(2.0), "top_k must be an integer >= 0"),
])
def test_processors_refuse_values_of_the_wrong_type(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def penalized_greedy(model, prompt, n, rep=1.0, freq=0.0, pres=0.0, bias=None):
    """The float64 reference: the whole sequence through the model each step (no cache), the penalties and
    bias applied to the last logits by the formulas, element by element in Python, then the argmax."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor(ids))[-1].tolist()
            adjusted = []
            for j, x in enumerate(logits):
                c = out.count(j)
                if j in prompt or c:
                    x = x * rep if x < 0 else x / rep
                x = x - c * freq - (c > 0) * pres
                b = (bias or {}).get(j, 0.0)
                adjusted.append(-INF if b == -100 else x + b)
            t = max(range(len(adjusted)), key=lambda j: (adjusted[j], -j))  # the first maximum, as argmax
            ids.append(t)
            out.append(t)
    return out


def test_generate_with_penalties_equals_the_hand_written_reference():
    model = make_model("baby-shakespeare", "explicit", seed=5)  # float64
    with torch.no_grad():
        model.fc_layer.weight.mul_(0.1)  # logits of about the size of the penalties, so that they matter
    prompt = [3, 7, 3]
    n = model.config.max_len - len(prompt)  # no sliding window: the reference runs the whole sequence
    plain = generate(model, prompt, n, temperature=0)
    assert penalized_greedy(model, prompt, n) == plain
    names = dict(rep="repetition_penalty", freq="frequency_penalty", pres="presence_penalty", bias="logit_bias")
    for kw in (dict(rep=1.7), dict(freq=0.6), dict(pres=1.1), dict(rep=1.3, freq=0.4, pres=0.5),
               dict(bias={plain[0]: -100, 30: 4.0})):
        settings = {names[k]: v for k, v in kw.items()}
        want = penalized_greedy(model, prompt, n, **kw)
        assert want != plain, kw  # the setting changes the text
        got = generate(model, prompt, n, temperature=0, **settings)
        assert got == want, kw
        assert got == generate(model, prompt, n, temperature=0, use_cache=False, **settings)


def test_sampled_penalties_cache_batch_and_alone_agree():
    model = make_model("baby-shakespeare", "sdpa", seed=6)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    rows = [SamplingParams(max_new_tokens=25, seed=1, repetition_penalty=1.4, frequency_penalty=0.3),
            SamplingParams(max_new_tokens=10, seed=2, presence_penalty=1.5, min_p=0.05, temperature=0.8),
            SamplingParams(max_new_tokens=25, temperature=0, logit_bias={0: -100, 1: -100})]
    alone = [generate(model, p, r) for p, r in zip(prompts, rows)]
    assert [len(a) for a in alone] == [25, 10, 25]
    assert generate_batch(model, prompts, rows) == alone
    assert generate_batch(model, prompts, rows, use_cache=False) == alone
    assert alone[0] != generate(model, prompts[0], rows[0].replace(repetition_penalty=1.0, frequency_penalty=0.0))
