"""``trace``: every attention number of one forward pass, a view over the pass's activation cache."""

import math

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb

from .models import small_model


def _no_hooks(m):
    """No hook point is left installed on any module of the model."""
    return all(getattr(mod, "hooks", None) is None for mod in m.modules())


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_trace_gives_the_forward_logits_and_leaves_the_model_unchanged(kernel):
    m = small_model("baby-shakespeare", attention=kernel, dropout=0.1).train()
    ids = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(2))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    for layers in (None, [1]):
        tr = dl.trace(m, ids, layers=layers)
        assert m.training  # restored
        m.eval()
        with torch.no_grad():
            ref = m(ids)
        m.train()
        assert (tr.logits - ref).abs().max() <= 1e-6
    assert all(b.hooks is None and b.attention.hooks is None for b in m.blocks) and _no_hooks(m)
    assert all(not mod._forward_hooks for mod in m.modules())
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    # the kept numbers are consistent with each other
    lt = tr.layer(1)
    assert torch.allclose(lt.scaled_sims, lt.sims / math.sqrt(m.config.d_head))
    assert torch.allclose(lt.percents.sum(-1), torch.ones(2, 4, 16), atol=1e-6)
    assert torch.equal(lt.mask, torch.triu(torch.ones(16, 16, dtype=torch.bool), 1))
    assert (lt.percents.masked_select(lt.mask) == 0).all()
    assert torch.allclose(lt.head_out, lt.percents @ lt.v, atol=1e-6)
    assert torch.allclose(lt.resid_1, lt.input + lt.attn_out) and torch.allclose(lt.resid_2, lt.resid_1 + lt.mlp_out)
    assert torch.allclose(tr.top_k_probs, torch.softmax(tr.logits, -1).topk(5).values, atol=1e-6)


def test_trace_clears_its_hooks_when_the_forward_raises():
    m = small_model("baby-shakespeare")
    boom = m.blocks[1].register_forward_pre_hook(lambda mod, args: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            dl.trace(m, torch.arange(8))
    finally:
        boom.remove()
    assert all(b.hooks is None and b.attention.hooks is None for b in m.blocks) and _no_hooks(m)
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
    assert not m.training


def test_layers_and_heads_keep_only_their_slices():
    m = small_model("baby-shakespeare")
    ids = torch.arange(16).unsqueeze(0)
    full = dl.trace(m, ids)
    part = dl.trace(m, ids, layers=[1], heads=[3, 1])
    assert [lt.index for lt in part.layers] == [1] and part.layers[0].heads == [1, 3]
    lt, ft = part.layer(1), full.layer(1)
    for key in ("q", "k", "v", "sims", "scaled_sims", "percents", "head_out"):
        ours = getattr(lt, key)
        assert ours.shape[1] == 2
        assert torch.allclose(ours, getattr(ft, key)[:, [1, 3]], atol=1e-6), key
        assert ours.untyped_storage().nbytes() == ours.numel() * ours.element_size(), key  # a copy, not a view
    assert lt.head_slot(3) == 1
    with pytest.raises(ValueError, match=r"kept: \[1, 3\]"):
        lt.head_slot(0)
    with pytest.raises(ValueError, match=r"kept layers: \[1\]"):
        part.layer(0)
    assert part.nbytes() < full.nbytes()


def test_gpt2_shaped_trace_of_1024_tokens_one_layer_is_well_under_1_gb():
    """GPT-2 small's shapes (d_model 768, 12 heads, 1,024 tokens), one layer kept. To keep the test fast the
    model has one layer and a vocabulary of 512; the full vocabulary of 50,257 only makes the logits bigger,
    and those extra bytes are added. (Measured once with the full vocabulary: 399 MB.)"""
    torch.manual_seed(0)
    m = dl.DecoderOnlyTransformer(dl.preset("gpt2", n_layer=1, num_tokens=512)).eval()
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(0))
    tr = dl.trace(m, ids, layers=[0])
    assert tr.layer(0).percents.shape == (1, 12, 1024, 1024)
    assert tr.logits.shape == (1, 1024, 512)
    full_vocab_bytes = tr.nbytes() + 1024 * (50257 - 512) * 4
    assert 0.35e9 < full_vocab_bytes < 0.5e9  # 3 x 50 MB of (T, T) per-head tensors + 206 MB of logits + small


@pytest.mark.parametrize("kwargs,match", [
    (dict(layers=[2]), r"layer 2 is out of range; valid layers are 0 \.\. 1"),
    (dict(layers=-1), r"layer -1 is out of range; valid layers are 0 \.\. 1"),
    (dict(heads=4), r"head 4 is out of range; valid heads are 0 \.\. 3"),
])
def test_trace_layer_or_head_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dl.trace(small_model("baby-shakespeare"), [1, 2, 3], **kwargs)


def test_trace_accepts_integers_of_any_kind():
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", d_model=16, n_layer=2, n_head=2, max_len=8))
    a = dl.trace(model, [1, 2, 3], layers=np.int64(1), heads=np.int32(0), top_k=np.int64(3))
    b = dl.trace(model, [1, 2, 3], layers=1, heads=0, top_k=3)
    assert [lt.index for lt in a.layers] == [1] and torch.equal(a.top_k_ids, b.top_k_ids)


def test_a_trace_is_a_view_over_the_cache():
    """trace records nothing of its own: the same numbers come from run_with_cache's cache."""
    m = small_model("baby-shakespeare")
    ids = torch.arange(12)[None]
    tr = dl.trace(m, ids, layers=[1])
    _, cache = gb.run_with_cache(m, ids)
    view = gb.trace_from_cache(cache, [1])
    for name, t in tr.tensors().items():
        other = view.tensors()[name]
        # float32 to a few ulps: the trace's pass and the cache's may take other kernels (AVX-512 vs AVX2)
        torch.testing.assert_close(t.float(), other.float(), rtol=1e-6, atol=1e-6, msg=name)
    assert view.layer(1).percents is cache["pattern", 1]  # the cache's own tensors, named as the lessons do
    assert torch.equal(view.layer(1).head_out, cache["z", 1].transpose(1, 2)) and view.logits is cache.logits
    assert _no_hooks(m)


def test_a_grouped_query_trace_gives_each_head_its_groups_keys():
    """With grouped-query attention (4 query heads, 2 key/value heads) a trace's keys and values are each query
    head's -- its group's key/value head -- and a head subset keeps the same slices (copies) as the full trace."""
    from .models import variant_ids, variant_model

    m = variant_model("llama-gqa-swiglu")
    ids = variant_ids(m)
    full = dl.trace(m, ids)
    _, cache = gb.run_with_cache(m, ids)
    k = cache["blocks.1.attn.hook_rot_k"]  # (B, T, n_kv_head, d_head): the heads the model computes and caches
    assert k.shape[2] == m.config.kv_heads == 2
    lt = full.layer(1)
    for head in range(4):
        assert torch.equal(lt.k[:, head], k[:, :, head // 2])
        assert torch.equal(lt.v[:, head], cache["blocks.1.attn.hook_v"][:, :, head // 2])
    assert torch.allclose(lt.head_out, lt.percents @ lt.v, atol=1e-12)
    part = dl.trace(m, ids, heads=[3, 0])
    for key in ("q", "k", "v", "percents", "head_out"):
        assert torch.equal(getattr(part.layer(1), key), getattr(lt, key)[:, [0, 3]]), key
