"""Sampling: which tokens top-k and top-p keep, the draw's distribution, the extremes (tiny and huge
temperatures, +inf and NaN logits), and the seeds."""

import pytest
import torch
from tiny_models import make_model, one_thread  # noqa: F401 -- one_thread: autouse

from decoderlab.generation import Sampler, generate


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    logits = probs.log()

    def kept(**kw):
        return torch.isfinite(Sampler(**kw).filter(logits))[0].nonzero().flatten().tolist()

    assert kept(top_p=0.5) == [1]
    assert kept(top_p=0.79) == [1, 3]
    assert kept(top_p=0.81) == [1, 2, 3]
    assert kept(top_p=1e-9) == [1]  # always at least one token
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=100) == [0, 1, 2, 3]  # clamped to the vocabulary
    # the draw follows the distribution (inverse CDF on one uniform per row)
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = Sampler(temperature=1.0)(logits.expand(n, 4), [g] * n)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, probs[0], atol=0.015)
    draws = Sampler(temperature=1.0, top_p=0.79)(logits.expand(n, 4), [g] * n)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64), atol=0.015)
    assert Sampler(temperature=0)(logits, []).tolist() == [1]


def test_sampling_options_on_a_model():
    model = make_model("baby-shakespeare", "sdpa", seed=2)
    greedy = generate(model, [5], 20, temperature=0)
    assert generate(model, [5], 20, top_k=1, seed=4) == greedy
    assert generate(model, [5], 20, top_p=1e-9, seed=4) == greedy
    assert generate(model, [5], 20, top_k=1000, seed=4) == generate(model, [5], 20, seed=4)
    assert generate(model, [5], 20, top_p=1.0, seed=4) == generate(model, [5], 20, seed=4)
    assert generate(model, [5], 20, seed=4) != generate(model, [5], 20, seed=5)


def test_sampling_is_safe_at_the_extremes():
    inf = float("inf")
    g = [torch.Generator().manual_seed(0)]
    logits = torch.tensor([[1.0, 3.0, 2.0, -inf]])
    # a tiny temperature is the argmax (logits / 1e-30 overflow to inf: no NaN may drive the choice)
    for t in (1e-30, 1e-300, 5e-324):
        assert Sampler(temperature=t)(logits, g).tolist() == [1]
        assert Sampler(temperature=t, top_k=2, top_p=0.5)(logits, g).tolist() == [1]
    # huge logits, and +inf logits: only the +inf tokens can be chosen
    assert Sampler(temperature=1.0)(torch.tensor([[3e38, -3e38, 1e38]]), g).tolist() == [0]
    picks = {Sampler(temperature=0.5)(torch.tensor([[inf, 0.0, inf, -inf]]), g).item() for _ in range(50)}
    assert picks == {0, 2}
    assert Sampler(temperature=0)(torch.tensor([[0.0, inf, 1.0]]), []).tolist() == [1]
    # half-precision logits; a huge temperature is (close to) uniform
    assert Sampler(temperature=1e-20)(torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float16), g).tolist() == [1]
    draws = Sampler(temperature=1e30)(torch.tensor([[0.0, 50.0]]).expand(4000, 2), g * 4000)
    assert 1800 < int(draws.sum()) < 2200
    # no token possible, or NaN logits: a clear error, never a pick
    for bad in (torch.tensor([[-inf, -inf]]), torch.tensor([[0.0, float("nan")]])):
        for t in (0, 1.0, 1e-30):
            with pytest.raises(ValueError, match="NaN|every logit of a row is -inf"):
                Sampler(temperature=t)(bad, g)
    with pytest.raises(ValueError, match="every logit of a row is -inf"):
        Sampler(temperature=1.0, suppress_tokens=[0, 1])(torch.tensor([[5.0, 1.0]]), g)
    # end to end: a tiny temperature gives the greedy tokens
    model = make_model("gpt2", "sdpa", seed=1)
    assert generate(model, [3, 4], 15, temperature=1e-30, seed=0) == generate(model, [3, 4], 15, temperature=0)


def test_library_seed_checks_match_torch_generators():
    from decoderlab.generation.sampling import MAX_SEED, check_seed, make_generators

    assert MAX_SEED == 2**63 - 1 and check_seed(MAX_SEED) == MAX_SEED and check_seed(torch.tensor(3)) == 3
    torch.Generator().manual_seed(MAX_SEED + 1)  # torch takes more; a chat's seed + turn stays in its range
    for bad in (-1, 2**63, 99999999999999999999999):
        with pytest.raises(ValueError, match=rf"seed must be an integer in 0 \.\. 2\*\*63-1, got {bad}$"):
            make_generators(bad, 1, torch.device("cpu"))
    with pytest.raises(TypeError, match="seed must be an integer"):
        check_seed(1.5)
