"""The model's named hook points (decoderlab.hooks): the names, the order they fire in, replacements, nesting,
restoring, and the errors for a wrong name or a wrong replacement."""

import pytest
import torch

import decoderlab as dl
from decoderlab.attention import KVCache
from decoderlab.hooks import HookDispatch, hook_names, resolve_names, use_hooks

from glassbox.models import VARIANT_CONFIGS, variant_ids, variant_model


def _all_hooks(m):
    return [mod for mod in m.modules() if hasattr(mod, "hooks")]


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_every_point_fires_once_in_the_order_hook_names_gives(variant):
    m = variant_model(variant)
    seen = []
    with use_hooks(m, [(lambda name: True, lambda x, name: seen.append((name, tuple(x.shape))))]):
        m(variant_ids(m))
    names = hook_names(m)
    assert [n for n, _ in seen] == names and len(set(names)) == len(names)
    shapes = dict(seen)
    cfg = m.config
    b, t = variant_ids(m).shape
    assert shapes["blocks.0.attn.hook_q"] == shapes["blocks.0.attn.hook_z"] == (b, t, cfg.n_head, cfg.d_head)
    assert shapes[f"blocks.{cfg.n_layer - 1}.attn.hook_pattern"] == (b, cfg.n_head, t, t)
    # TransformerLens's shapes for grouped-query attention: the key/value points have the n_kv_head heads
    kv_points = [p for p in ("k", "v", "k_normed", "rot_k") if f"blocks.0.attn.hook_{p}" in names]
    assert all(shapes[f"blocks.0.attn.hook_{p}"] == (b, t, cfg.kv_heads, cfg.d_head) for p in kv_points)
    assert ("blocks.0.mlp.hook_pre_linear" in names) == (cfg.mlp in ("swiglu", "geglu"))
    assert ("blocks.0.ln1_post.hook_scale" in names) == ("blocks.0.ln2_post.hook_normalized" in names) == cfg.sandwich_norm
    if cfg.mlp == "swiglu":
        assert shapes["blocks.0.mlp.hook_pre"] == shapes["blocks.0.mlp.hook_pre_linear"] == (b, t, cfg.ff_size)
    assert shapes[f"blocks.{cfg.n_layer - 1}.hook_resid_post"] == (b, t, cfg.d_model)
    assert ("ln_final.hook_scale" in names) == (cfg.norm != "none")
    assert ("hook_pos_embed" in names) == (cfg.position in ("learned", "sinusoidal"))
    assert ("blocks.0.attn.hook_rot_q" in names) == (cfg.position == "rope")
    assert ("blocks.0.attn.hook_q_normed" in names) == cfg.qk_norm
    assert ("blocks.0.hook_mlp_out" in names) == ("blocks.0.hook_resid_mid" in names) == (cfg.mlp != "none")
    assert all(mod.hooks is None for mod in _all_hooks(m))


def test_hook_names_of_gpt2_are_transformer_lens_names():
    m = dl.DecoderOnlyTransformer("gpt2", n_layer=1, num_tokens=50, d_model=16, n_head=2, max_len=8)
    assert hook_names(m) == [
        "hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "blocks.0.ln1.hook_scale",
        "blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v",
        "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z",
        "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", "blocks.0.ln2.hook_scale",
        "blocks.0.ln2.hook_normalized", "blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post", "blocks.0.hook_mlp_out",
        "blocks.0.hook_resid_post", "ln_final.hook_scale", "ln_final.hook_normalized"]


def test_a_replacement_is_what_the_rest_of_the_pass_uses():
    m = variant_model("learned-layernorm-gelu")
    ids = variant_ids(m)
    x = torch.randn(*ids.shape, m.config.d_model, dtype=torch.float64)
    with use_hooks(m, [("blocks.1.hook_resid_post", lambda a, name: x)]), torch.no_grad():
        got = m(ids)
    with torch.no_grad():
        assert torch.equal(got, m.fc_layer(m.norm_f(x)))
        # a hook that returns its input changes no number (with the pattern hooked, the layer runs the explicit
        # kernel: the same function as sdpa, to rounding)
        plain = m(ids)
        with use_hooks(m, [(lambda n: "attn_scores" not in n and "pattern" not in n, lambda a, name: a)]):
            assert torch.equal(m(ids), plain)
        with use_hooks(m, [(lambda n: True, lambda a, name: a)]):
            assert (m(ids) - plain).abs().max() < 1e-12


@pytest.mark.parametrize("variant", ["learned-layernorm-gelu", "rope-rmsnorm-relu2"])
def test_a_frozen_norm_scale_gives_the_norm_written_out(variant):
    """Replacing ln_final.hook_scale (and hook_normalized) by the clean run's own values writes the norm out
    by hand from them: the same logits (float64, 1e-12) -- and another scale changes them."""
    m = variant_model(variant)
    ids = variant_ids(m)
    seen = {}
    with torch.no_grad():
        with use_hooks(m, [("ln_final.hook_scale", lambda a, name: seen.update(s=a.clone()))]):
            plain = m(ids)
        with use_hooks(m, [("ln_final.hook_scale", lambda a, name: seen["s"].clone())]):
            frozen = m(ids)
        with use_hooks(m, [("blocks.0.ln1.hook_normalized", lambda a, name: a.clone())]):
            copied = m(ids)
        with use_hooks(m, [("ln_final.hook_scale", lambda a, name: 2 * seen["s"])]):
            doubled = m(ids)
    assert (frozen - plain).abs().max() < 1e-12 and (copied - plain).abs().max() < 1e-12
    assert (doubled - plain).abs().max() > 1e-3


def test_nested_hooks_run_outer_first_and_are_restored_even_after_an_error():
    m = variant_model("learned-layernorm-gelu")
    calls = []
    outer = ("blocks.0.hook_resid_pre", lambda a, name: calls.append("outer"))
    inner = ("blocks.0.hook_resid_pre", lambda a, name: calls.append("inner"))
    with use_hooks(m, [outer]):
        before = m.blocks[0].hooks
        with pytest.raises(RuntimeError, match="boom"):
            with use_hooks(m, [inner, ("hook_embed", lambda a, n: (_ for _ in ()).throw(RuntimeError("boom")))]):
                assert isinstance(m.blocks[0].hooks, HookDispatch) and m.hooks is not None
                m(variant_ids(m))
        assert m.blocks[0].hooks is before and m.hooks is None
        m(variant_ids(m))
    assert calls == ["outer"]  # the failing pass stopped at hook_embed, before either block hook
    assert all(mod.hooks is None for mod in _all_hooks(m))
    with use_hooks(m, [outer]), use_hooks(m, [inner]):
        m(variant_ids(m))
    assert calls == ["outer", "outer", "inner"]


def test_hooks_see_every_kv_cache_decode_step():
    m = variant_model("rope-rmsnorm-relu2")
    ids = variant_ids(m, batch=1)
    seen = []
    with torch.no_grad(), use_hooks(m, [("blocks.1.attn.hook_pattern", lambda a, name: seen.append(a.shape))]):
        cache = KVCache.for_model(m)
        m(ids[:, :4], cache=cache)
        step = m.decode(ids[:, 4:5], 4, None, cache)
    assert seen == [(1, 4, 4, 4), (1, 4, 1, 5)]
    with torch.no_grad():
        assert (step - m(ids[:, :5])[:, -1]).abs().max() < 1e-12


def test_an_unknown_hook_name_lists_the_close_names():
    m = variant_model("learned-layernorm-gelu")
    with pytest.raises(ValueError, match=r"unknown hook name 'blocks\.0\.hook_resid_pr': close names: "
                                         r"blocks\.0\.hook_resid_pre"):
        resolve_names(m, "blocks.0.hook_resid_pr")
    with pytest.raises(ValueError, match=r"layer 7 is out of range; valid layers are 0 \.\. 1"):
        dl.run_with_hooks(m, [1, 2], [("blocks.7.hook_resid_pre", lambda a, n: None)])
    with pytest.raises(ValueError, match=r"no attn\.hook_rot_q: it needs rope positions"):
        dl.run_with_cache(m, [1, 2], names_filter=["blocks.0.attn.hook_rot_q"])
    with pytest.raises(ValueError, match=r"no hook_pos_embed: it needs learned or sinusoidal positions"):
        resolve_names(variant_model("rope-rmsnorm-relu2"), "hook_pos_embed")
    with pytest.raises(ValueError, match="lists all 38 of this model's"):
        resolve_names(m, "resid")
    with pytest.raises(TypeError, match="names_filter must be None"):
        resolve_names(m, 3)
    assert all(mod.hooks is None for mod in _all_hooks(m))


def test_a_replacement_of_the_wrong_shape_or_dtype_is_named():
    m = variant_model("learned-layernorm-gelu")

    def halve(a, name):
        return a[..., :2]

    with pytest.raises(ValueError, match=r"hook .*halve at blocks\.1\.attn\.hook_z returned shape \(2, 9, 4, 2\), "
                                         r"dtype torch\.float64 on cpu; expected shape \(2, 9, 4, 4\) "
                                         r"\(B, T, H, d_head\), dtype torch\.float64"):
        dl.run_with_hooks(m, variant_ids(m), [("blocks.1.attn.hook_z", halve)])
    with pytest.raises(ValueError, match=r"returned shape \(2, 9, 16\), dtype torch\.float32 .*expected shape "
                                         r"\(2, 9, 16\) \(B, T, d_model\), dtype torch\.float64"):
        dl.run_with_hooks(m, variant_ids(m), [("hook_embed", lambda a, n: a.float())])
    with pytest.raises(TypeError, match=r"at hook_embed returned a list; return None or a tensor of shape"):
        dl.run_with_hooks(m, variant_ids(m), [("hook_embed", lambda a, n: [1])])
    with pytest.raises(TypeError, match="must be a .name, fn. pair"):
        dl.run_with_hooks(m, variant_ids(m), ["hook_embed"])
    with pytest.raises(TypeError, match="not callable"):
        dl.run_with_hooks(m, variant_ids(m), [("hook_embed", 3)])
    assert all(mod.hooks is None for mod in _all_hooks(m))
