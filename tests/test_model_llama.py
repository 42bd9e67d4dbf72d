"""The Llama family in the one model class: grouped-query attention (n_kv_head), SwiGLU, rotate-half rope with its
base, q/k/v biases and the QK-norm's gains, against ``transformers``' own classes on tiny random configs built
here (nothing downloaded) -- logits within 1e-5 in float32, 20 greedy tokens equal, cache == no cache -- and the
pieces on their own: the KV cache's heads, the two kernels, the two rope layouts, old configs.

The weight mapping (tests/support/hf_llama.py) is the tests' own, the smallest that shows the forward is the same:
the real conversions are :mod:`decoderlab`'s Hugging Face loader's."""

import json

import pytest
import torch

import decoderlab as dl
from decoderlab.attention import KVCache, MultiHeadAttention
from decoderlab.generation import generate
from decoderlab.positions import RotaryEmbedding

transformers = pytest.importorskip("transformers")

from support.hf_llama import ARCHITECTURES, VOCAB, hf_model, ours_of  # noqa: E402
from tiny_models import one_thread  # noqa: E402, F401 -- one_thread: autouse


def _ids(n: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logits_equal_transformers_to_1e5(name, attention):
    hf = hf_model(name)
    ours = ours_of(hf, attention)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert want.abs().max() > 1.0  # logits far from zero: a missing gain or bias would show
    assert (got - want).abs().max() < 1e-5, float((got - want).abs().max())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_twenty_greedy_tokens_equal_transformers_and_cache_equals_no_cache(name):
    hf = hf_model(name, seed=2)
    ours = ours_of(hf)
    prompt = _ids(1, 7, seed=3)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, 7:].tolist()
    got = generate(ours, prompt[0].tolist(), 20, temperature=0)
    assert got == want
    assert generate(ours, prompt[0].tolist(), 20, temperature=0, use_cache=False) == want
    # the cached logits step by step: the KV cache holds n_kv_head heads and gives the uncached logits
    ids = torch.tensor([prompt[0].tolist() + want])
    cache = KVCache.for_model(ours)
    with torch.no_grad():
        full = ours(ids)
        steps = [ours(ids[:, :7], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(7, ids.size(1))]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5 * full.abs().max()  # (float32 sums in another order)
    cfg = ours.config
    assert cache.layers[0].k.shape == (1, cfg.kv_heads, cfg.max_len, cfg.d_head)


def test_the_kv_cache_holds_n_kv_head_heads_memory_divided_by_the_group():
    """A grouped-query model's cache is n_head / n_kv_head times smaller than the same model's without groups,
    and decodes the uncached logits."""
    sizes = {}
    for n_kv in (8, 2, 1):
        torch.manual_seed(0)
        m = dl.DecoderOnlyTransformer(dl.ModelConfig(num_tokens=40, d_model=32, n_layer=2, n_head=8, n_kv_head=n_kv,
                                                     max_len=20, position="rope", norm="rmsnorm", mlp="swiglu",
                                                     attn_out_proj=True, attention="sdpa")).eval()
        cache = KVCache.for_model(m)
        ids = torch.randint(0, 40, (3, 12))
        with torch.no_grad():
            full = m(ids)
            got = torch.cat([m(ids[:, :5], cache=cache), *(m(ids[:, t:t + 1], cache=cache) for t in range(5, 12))], 1)
        assert (got - full).abs().max() < 1e-5
        sizes[n_kv] = sum(t.numel() * t.element_size() for lay in cache.layers for t in (lay.k, lay.v))
        assert cache.layers[0].k.shape == (3, n_kv, 20, 4)
    assert sizes[8] == 4 * sizes[2] == 8 * sizes[1]


@pytest.mark.parametrize("n_kv_head,head_dim", [(2, 0), (1, 12), (4, 0)])
def test_both_kernels_and_both_gqa_paths_agree(n_kv_head, head_dim):
    """The explicit kernel (keys/values repeated per query head) and sdpa (its enable_gqa) give the same
    outputs, with a padding mask and a cache, to 1e-5; and the percents come with n_head heads."""
    torch.manual_seed(0)
    layers = [MultiHeadAttention(16, 4, n_kv_head=n_kv_head, head_dim=head_dim, kernel=k, qkv_bias=True,
                                 qk_norm=True, qk_norm_gain=True, rope=RotaryEmbedding(head_dim or 4, 12, 50.0,
                                                                                       "rotate_half"))
              for k in ("sdpa", "explicit")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, :2] = True
    for kwargs in (dict(), dict(padding_mask=pad)):
        a, b = (layer(x, **kwargs) for layer in layers)
        assert (a - b).abs().max() < 1e-5
    y, w = layers[0](x, return_weights=True)
    assert w.shape == (3, 4, 7, 7) and (y - layers[1](x)).abs().max() < 1e-5


def test_rotate_half_is_interleaved_with_the_query_and_key_rows_permuted():
    """The two rope layouts compute the same attention when each head's query/key rows are reordered (pair i:
    rows 2i, 2i+1 interleaved; rows i, i + d_head/2 rotate-half) -- the permutation a conversion between the
    layouts makes (and its QK-norm gains with it)."""
    torch.manual_seed(0)
    cfg = dl.ModelConfig(num_tokens=30, d_model=24, n_layer=2, n_head=4, n_kv_head=2, max_len=10, position="rope",
                         norm="rmsnorm", mlp="swiglu", attn_out_proj=True, qk_norm=True, qk_norm_gain=True,
                         rope_theta=300.0, attention="sdpa")
    inter = dl.DecoderOnlyTransformer(cfg).eval()
    with torch.no_grad():  # gains that differ along d_head, so that their order matters
        for p in inter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    half = dl.DecoderOnlyTransformer(cfg.replace(rope_layout="rotate_half")).eval()
    dh = cfg.d_head
    order = torch.cat([torch.arange(0, dh, 2), torch.arange(1, dh, 2)])  # rotate-half row r <- interleaved row
    state = dict(inter.state_dict())
    with torch.no_grad():
        for i in range(cfg.n_layer):
            for gain in ("q_norm", "k_norm"):
                state[f"blocks.{i}.attention.{gain}.weight"] = state[f"blocks.{i}.attention.{gain}.weight"][order]
            w = state[f"blocks.{i}.attention.qkv.weight"]
            n_qk = cfg.n_head + cfg.kv_heads  # the query and key heads are permuted, the values are not
            rows = torch.cat([h * dh + order for h in range(n_qk)] + [torch.arange(n_qk * dh, w.size(0))])
            state[f"blocks.{i}.attention.qkv.weight"] = w[rows]
    half.load_state_dict(state)
    ids = torch.randint(0, 30, (2, 10))
    with torch.no_grad():
        a, b = inter(ids), half(ids)
    assert (a - b).abs().max() < 1e-5 and a.abs().max() > 0.1


def test_rotate_half_pairs_the_halves():
    """Position 1 turns pair i -- (x[i], x[i + d/2]) in rotate_half, (x[2i], x[2i+1]) interleaved -- by base^(-2i/d)."""
    x = torch.arange(1.0, 9.0).view(1, 1, 1, 8).expand(1, 1, 2, 8)
    for layout, (a, b) in (("rotate_half", (1, 5)), ("interleaved", (2, 3))):
        y = RotaryEmbedding(8, 4, base=100.0, layout=layout)(x)[0, 0, 1]
        angle = torch.tensor(100.0 ** (-2 / 8))
        xa, xb = float(x[0, 0, 1, a]), float(x[0, 0, 1, b])
        assert torch.allclose(y[[a, b]], torch.stack([xa * angle.cos() - xb * angle.sin(),
                                                     xa * angle.sin() + xb * angle.cos()]), atol=1e-6)
    with pytest.raises(ValueError, match="unknown rope layout 'halves'; allowed: interleaved, rotate_half"):
        RotaryEmbedding(8, 4, layout="halves")


def test_an_old_config_json_without_the_new_fields_loads_as_before():
    """A checkpoint's config.json from before the Llama family's fields: the defaults are today's model exactly
    (multi-head, d_model / n_head per head, interleaved rope of base 10000, no q/k/v-only biases, no gains)."""
    old = {"attention": "sdpa", "attn_out_proj": True, "bias": False, "d_ff": 0, "d_model": 128, "dropout": 0.0,
           "init": "gpt2", "lm_head_bias": False, "max_len": 64, "mlp": "relu2", "n_head": 4, "n_layer": 4,
           "norm": "layernorm", "norm_eps": 1e-05, "num_tokens": 65, "position": "rope", "qk_norm": True,
           "tie_weights": True, "zero_init": True}
    cfg = dl.ModelConfig.from_json(json.dumps(old))
    assert (cfg.n_kv_head, cfg.head_dim, cfg.rope_theta, cfg.rope_layout, cfg.qkv_bias, cfg.qk_norm_gain) == (
        0, 0, 10000.0, "interleaved", False, False)
    assert (cfg.kv_heads, cfg.d_head) == (4, 32)
    m = dl.DecoderOnlyTransformer(cfg)
    assert sorted(k for k in m.state_dict() if k.startswith("blocks.0.")) == [
        "blocks.0.attention.proj.weight", "blocks.0.attention.qkv.weight", "blocks.0.mlp.fc.weight",
        "blocks.0.mlp.proj.weight", "blocks.0.norm_1.weight", "blocks.0.norm_2.weight"]
    assert m.blocks[0].attention.qkv.weight.shape == (3 * 128, 128)


@pytest.mark.parametrize("fields,match", [
    (dict(n_head=4, n_kv_head=3), r"n_head \(4\) must be a multiple of n_kv_head \(3\); allowed n_kv_head: 0 \(= n_head\), 1, 2, 4"),
    (dict(n_kv_head=-1), r"n_kv_head must be an integer >= 0 \(0 means n_head\)"),
    (dict(head_dim=-2), r"head_dim must be an integer >= 0"),
    (dict(d_model=10, n_head=4), r"d_model \(10\) must be divisible by n_head \(4\); allowed n_head for d_model 10: 1, 2, 5, 10"),
    (dict(head_dim=6, attn_out_proj=False), r"heads' width n_head \* head_dim = 24 must be d_model \(16\)"),
    (dict(rope_layout="halves"), r"unknown rope_layout 'halves'; allowed: interleaved, rotate_half"),
    (dict(rope_theta=0), r"rope_theta must be a finite number > 0"),
    (dict(qk_norm_gain=True), r"qk_norm_gain=True is the gain of the QK-norm, which needs qk_norm=True"),
    (dict(qkv_bias=1), r"qkv_bias must be True or False"),
    (dict(position="rope", head_dim=5, attn_out_proj=True), r"rope' needs an even head size, but the head size is 5"),
])
def test_bad_llama_fields_name_the_field_and_what_is_allowed(fields, match):
    base = dict(num_tokens=10, d_model=16, n_head=4, max_len=8)
    with pytest.raises(ValueError, match=match):
        dl.ModelConfig(**{**base, **fields})
