"""run_with_cache / run_with_hooks: every activation by name, the model's own numbers, and a filter that keeps
only what is asked."""

import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb
from decoderlab.hooks import hook_names

from .models import VARIANT_CONFIGS, small_model, variant_ids, variant_model


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_the_cache_holds_every_point_and_the_models_own_logits(variant):
    m = variant_model(variant)
    ids = variant_ids(m)
    logits, cache = gb.run_with_cache(m, ids)
    with torch.no_grad():
        plain = m(ids)
    assert (logits - plain).abs().max() < 1e-12 and logits is cache.logits
    assert list(cache) == hook_names(m) and len(cache) == len(hook_names(m))
    assert torch.equal(cache.token_ids, ids)
    n = m.config.n_layer
    # the residual stream adds up point by point
    for i in range(n):
        mid = cache[f"blocks.{i}.hook_resid_pre"] + cache[f"blocks.{i}.hook_attn_out"]
        if m.config.mlp != "none":
            assert torch.equal(cache[f"blocks.{i}.hook_resid_mid"], mid)
            mid = mid + cache[f"blocks.{i}.hook_mlp_out"]
        assert torch.equal(cache[f"blocks.{i}.hook_resid_post"], mid)
        # the heads' outputs add up to the attention output (plus the projection's bias)
        heads = cache.head_results(i).sum(2)
        bias = m.blocks[i].attention.proj.bias if m.blocks[i].attention.proj is not None else None
        want = cache[f"blocks.{i}.hook_attn_out"] - (0 if bias is None else bias)
        assert (heads - want).abs().max() < 1e-12
        pattern = cache["pattern", i]
        t = ids.size(1)
        assert (pattern.sum(-1) - 1).abs().max() < 1e-12 and pattern.shape == (2, m.config.n_head, t, t)
    assert (cache[f"blocks.{n - 1}.hook_resid_post"] - (cache["blocks.0.hook_resid_pre"] + sum(
        cache[f"blocks.{i}.hook_attn_out"] + (cache[f"blocks.{i}.hook_mlp_out"] if m.config.mlp != "none" else 0)
        for i in range(n)))).abs().max() < 1e-12


def test_names_filter_keeps_only_what_is_asked():
    m = variant_model("learned-layernorm-gelu")
    ids = variant_ids(m)
    full = gb.run_with_cache(m, ids)[1]
    one = gb.run_with_cache(m, ids, names_filter="blocks.1.attn.hook_pattern")[1]
    assert list(one) == ["blocks.1.attn.hook_pattern"]  # (layer 0 ran sdpa there, the explicit kernel here)
    assert (one["pattern", 1] - full["pattern", 1]).abs().max() < 1e-12
    layer = gb.run_with_cache(m, ids, names_filter=lambda n: n.startswith("blocks.1."))[1]
    assert list(layer) == [n for n in hook_names(m) if n.startswith("blocks.1.")]
    listed = gb.run_with_cache(m, ids, names_filter=["blocks.0.hook_resid_post", "hook_embed"])[1]
    assert list(listed) == ["hook_embed", "blocks.0.hook_resid_post"]  # forward order
    assert layer.nbytes() < full.nbytes() and one.nbytes() < layer.nbytes()
    with pytest.raises(KeyError, match=r"'hook_embed' was not kept in this cache \(1 activations\)"):
        one["hook_embed"]
    with pytest.raises(KeyError, match="close names: blocks.1.attn.hook_pattern"):
        one["blocks.1.attn.hook_patern"]
    assert gb.act_name("z", 1) == "blocks.1.attn.hook_z" and gb.act_name("scale") == "ln_final.hook_scale"
    assert gb.act_name("scale", 0, "ln2") == "blocks.0.ln2.hook_scale" and gb.act_name("embed") == "hook_embed"
    with pytest.raises(ValueError, match="needs a layer index"):
        gb.act_name("resid_pre")
    with pytest.raises(ValueError, match="unknown short activation name 'resid'"):
        full["resid", 0]


def test_run_with_cache_leaves_the_model_as_it_was():
    m = small_model("baby-shakespeare", dropout=0.1).train()
    ids = torch.arange(10)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    logits, cache = gb.run_with_cache(m, ids)
    assert m.training and all(mod.hooks is None for mod in m.modules() if hasattr(mod, "hooks"))
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert not logits.requires_grad and not cache["blocks.0.hook_resid_post"].requires_grad
    m.eval()
    with torch.no_grad():
        assert (logits - m(ids[None])).abs().max() < 1e-5  # float32: the explicit kernel vs sdpa
    with pytest.raises(ValueError, match=r"sequence length T=17 is longer than max_len=16"):
        gb.run_with_cache(m, torch.arange(17))
    with pytest.raises(TypeError, match="must be a decoderlab DecoderOnlyTransformer"):
        gb.run_with_cache(torch.nn.Linear(2, 2), [1])


def test_run_with_hooks_changes_the_pass_and_nothing_after_it():
    m = variant_model("rope-qknorm-rmsnorm")
    ids = variant_ids(m)
    with torch.no_grad():
        plain = m(ids)
    zeroed = gb.run_with_hooks(m, ids, [("blocks.1.hook_attn_out", lambda x, name: torch.zeros_like(x))])
    _, cache = gb.run_with_cache(m, ids)
    with torch.no_grad():  # by hand: layer 1 without its attention
        r = cache["blocks.1.hook_resid_pre"]
        r = r + m.blocks[1].mlp(m.blocks[1].norm_2(r))
        assert (zeroed - m.fc_layer(m.norm_f(r))).abs().max() < 1e-12
    assert (zeroed - plain).abs().max() > 1e-3
    assert torch.equal(gb.run_with_hooks(m, ids, []), plain)
    assert dl.run_with_hooks is gb.run_with_hooks and dl.run_with_cache is gb.run_with_cache


def test_a_text_reads_the_start_token_first_as_transformer_lens_prepends_it(llama_directory):
    """TransformerLens's ``prepend_bos``: the text of a model whose tokenizer puts <s> first (Llama 2,
    TinyLlama) starts with it in every glass-box function -- the ids transformers' ``tokenizer(text)`` gives, so
    the logits are transformers' --; ids are taken as given."""
    path, hf, auto = llama_directory
    m = dl.load(path)
    tok, text = m.tokenizer, "To be, or not to be"
    ids = auto(text)["input_ids"]
    assert ids[0] == tok.bos_id and gb.cache.as_ids(m.model, text, tok)[0].tolist() == ids
    logits, cache = gb.run_with_cache(m.model, text, tokenizer=tok)
    with torch.no_grad():
        assert cache.token_ids[0].tolist() == ids and (logits - hf(torch.tensor([ids])).logits).abs().max() < 1e-4
    tr = gb.trace(m.model, text, tok)
    assert tr.token_ids[0].tolist() == ids and tr.tokens[0][0] == "<s>"
    report = gb.verify(m.model, text, tokenizer=tok)
    assert report.ok and gb.trace(m.model, ids[1:], tok).token_ids[0].tolist() == ids[1:]
    metric = lambda out: out[0, -1, ids[-1]]  # noqa: E731
    table = gb.activation_patching(m.model, text, "To be, and not to be", metric, tokenizer=tok)
    assert table.shape == (m.model.config.n_layer, len(ids))  # both texts with their <s>
