"""Interventions: patching tables, ablations and steering, checked against what they must give exactly."""

import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb
from decoderlab.hooks import use_hooks

from .models import VARIANT_CONFIGS, variant_ids, variant_model

TABLES = [("resid_pre", "layer"), ("resid_pre", "layer,pos"), ("resid_post", "layer,pos"), ("attn_out", "layer"),
          ("attn_head", "layer,head"), ("attn_head", "layer,pos,head"), ("mlp_out", "layer,pos")]


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_patching_the_clean_run_into_itself_changes_nothing(variant):
    m = variant_model(variant)
    ids = variant_ids(m)
    metric = gb.logit_difference(1, 2)
    with torch.no_grad():
        base = float(metric(m(ids)))
    cfg = m.config
    for over, by in TABLES:
        if over == "mlp_out" and cfg.mlp == "none":
            continue
        table = gb.activation_patching(m, ids, ids, metric, over=over, by=by)
        shape = {"layer": (cfg.n_layer,), "layer,pos": (cfg.n_layer, ids.size(1)),
                 "layer,head": (cfg.n_layer, cfg.n_head), "layer,pos,head": (cfg.n_layer, ids.size(1), cfg.n_head)}
        assert table.shape == shape[by] and table.dtype == torch.float64
        assert (table - base).abs().max() < 1e-12, (over, by)


def test_patching_restores_what_it_patches():
    """Clean into corrupt: the whole input of layer 0 (or the last block's output) gives the clean metric;
    a position the corruption did not reach before layer 0 changes nothing."""
    m = variant_model("learned-layernorm-gelu")
    clean = variant_ids(m)
    corrupt = clean.clone()
    corrupt[:, 3] = (corrupt[:, 3] + 1) % m.config.num_tokens
    metric = gb.logit_difference(4, 5)
    with torch.no_grad():
        want_clean, want_corrupt = float(metric(m(clean))), float(metric(m(corrupt)))
    assert abs(want_clean - want_corrupt) > 1e-3
    by_layer = gb.activation_patching(m, clean, corrupt, metric, over="resid_pre", by="layer")
    assert abs(by_layer[0] - want_clean) < 1e-12
    post = gb.activation_patching(m, clean, corrupt, metric, over="resid_post", by="layer")
    assert abs(post[-1] - want_clean) < 1e-12
    by_pos = gb.activation_patching(m, clean, corrupt, metric, over="resid_pre", by="layer,pos")
    assert (by_pos[0, :3] - want_corrupt).abs().max() < 1e-12  # the same tokens there: nothing to restore
    assert abs(by_pos[0, 3] - want_corrupt) > 1e-6
    heads = gb.activation_patching(m, clean, corrupt, metric, over="attn_head", by="layer,head")
    assert heads.shape == (2, 4) and (heads - want_corrupt).abs().max() > 1e-6


def test_ablations_and_steering_do_what_they_say():
    m = variant_model("rope-rmsnorm-relu2")
    ids = variant_ids(m)
    name = "blocks.1.attn.hook_z"
    seen = {}

    def look(x, n):
        seen[n] = x.clone()
    with use_hooks(m, [gb.zero_ablation(m, name, head=2), (name, look)]):
        gb.run_with_hooks(m, ids, [])
    assert (seen[name][:, :, 2] == 0).all() and (seen[name][:, :, 1] != 0).all()
    other = variant_ids(m, seed=5)
    ref = gb.run_with_cache(m, other)[1]
    with use_hooks(m, [gb.mean_ablation(m, name, ref), (name, look)]):
        gb.run_with_hooks(m, ids, [])
    assert torch.allclose(seen[name], ref[name].mean(0, keepdim=True).expand_as(seen[name]), atol=0, rtol=0)
    with use_hooks(m, [gb.resample_ablation(m, name, ref, head=0), (name, look)]):
        gb.run_with_hooks(m, ids, [])
    assert torch.equal(seen[name][:, :, 0], ref[name][:, :, 0])
    same = gb.run_with_cache(m, ids)[1]
    with torch.no_grad():
        plain = m(ids)
    assert (gb.run_with_hooks(m, ids, [gb.resample_ablation(m, name, same)]) - plain).abs().max() < 1e-12
    # a steering vector at layer 0's input is the same as adding it to the word embeddings
    v = torch.randn(m.config.d_model, dtype=torch.float64)
    steered = gb.run_with_hooks(m, ids, [gb.steering(m, 0, v, scale=3.0)])
    by_hand = gb.run_with_hooks(m, ids, [("hook_embed", lambda x, n: x + 3.0 * v)])
    assert (steered - by_hand).abs().max() < 1e-12 and (steered - plain).abs().max() > 1e-3


def test_generate_with_a_steering_vector_cached_and_uncached():
    torch.manual_seed(0)
    m = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=2, d_model=32, max_len=32)).eval()
    prompt = [5, 6, 7]
    v = 4 * m.we.weight[9].detach()
    steer = [gb.steering(m, 1, v)]
    plain = dl.generate(m, prompt, 12, temperature=0)
    steered = dl.generate(m, prompt, 12, temperature=0, hooks=steer)
    assert steered == dl.generate(m, prompt, 12, temperature=0, hooks=steer, use_cache=False)
    assert steered != plain and steered.count(9) > plain.count(9)
    assert dl.generate(m, prompt, 12, temperature=0) == plain  # nothing left installed
    assert all(mod.hooks is None for mod in m.modules() if hasattr(mod, "hooks"))


def test_patching_and_ablation_bad_inputs():
    m = variant_model("learned-layernorm-gelu")
    ids = variant_ids(m)
    metric = gb.logit_difference(1)
    with pytest.raises(ValueError, match=r"clean and corrupt inputs must have the same shape \(B, T\), got "
                                         r"\(2, 9\) and \(2, 8\)"):
        gb.activation_patching(m, ids, ids[:, :8], metric)
    with pytest.raises(ValueError, match=r"unknown over='heads'; allowed: resid_pre, resid_mid, resid_post"):
        gb.activation_patching(m, ids, ids, metric, over="heads")
    with pytest.raises(ValueError, match=r"by='layer,pos' is not allowed for over='attn_head'; allowed: layer,head"):
        gb.activation_patching(m, ids, ids, metric, over="attn_head", by="layer,pos")
    with pytest.raises(ValueError, match="the metric must return one number"):
        gb.activation_patching(m, ids, ids, lambda logits: logits[:, -1, 0], by="layer")
    with pytest.raises(ValueError, match=r"no hook_mlp_out: it needs an MLP"):
        gb.activation_patching(variant_model("attention-only"), ids, ids, metric, over="mlp_out")
    with pytest.raises(ValueError, match=r"head 4 is out of range; valid heads are 0 \.\. 3 \(n_head=4\)"):
        gb.zero_ablation(m, "blocks.0.attn.hook_z", head=4)
    with pytest.raises(ValueError, match=r"head -1 is out of range"):
        gb.mean_ablation(m, "blocks.0.attn.hook_pattern", torch.zeros(1), head=-1)
    with pytest.raises(ValueError, match=r"head=1 needs a per-head hook point .* blocks.0.hook_resid_pre is "
                                         r"\(B, T, d_model\)"):
        gb.zero_ablation(m, "blocks.0.hook_resid_pre", head=1)
    with pytest.raises(ValueError, match="unknown hook name 'blocks.0.attn.hook_zz'"):
        gb.zero_ablation(m, "blocks.0.attn.hook_zz")
    with pytest.raises(ValueError, match=r"the steering vector must be a tensor of shape \(d_model,\) = \(16,\), "
                                         r"got \(8,\)"):
        gb.steering(m, 0, torch.zeros(8))
    with pytest.raises(ValueError, match=r"layer 2 is out of range; valid layers are 0 \.\. 1"):
        gb.steering(m, 2, torch.zeros(16))
    short = gb.run_with_cache(m, ids[:, :5])[1]
    with pytest.raises(ValueError, match=r"the resampled activation for blocks.0.hook_resid_pre has shape "
                                         r"\(2, 5, 16\), which does not fit the run's \(2, 9, 16\)"):
        gb.run_with_hooks(m, ids, [gb.resample_ablation(m, "blocks.0.hook_resid_pre", short)])


def test_patching_tables_as_text():
    m = variant_model("attention-only", dtype=torch.float32)
    ids = variant_ids(m)
    metric = gb.logit_difference(1, 2)
    by_head = gb.activation_patching(m, ids, ids.flip(1), metric, over="attn_head", by="layer,head")
    lines = gb.patching_table(by_head, "attn_head", "layer,head").splitlines()
    assert lines[0] == "patching attn_head by layer,head:" and lines[1].split() == ["H0", "H1", "H2", "H3"]
    assert lines[3].split()[0] == "L1" and float(lines[3].split()[2]) == pytest.approx(float(by_head[1, 1]), abs=1e-4)
    per_pos = gb.activation_patching(m, ids[:, :3], ids[:, :3].flip(1), metric, over="attn_head", by="layer,pos,head")
    assert len(gb.patching_table(per_pos, "attn_head", "layer,pos,head").splitlines()) == 2 + 2 * 3
    layer = gb.patching_table(gb.activation_patching(m, ids, ids, metric, by="layer"), "resid_pre", "layer")
    assert layer.splitlines()[1].split()[0] == "L0" and len(layer.splitlines()) == 3


def test_a_logit_difference_of_one_token_per_row():
    m = variant_model("rope-rmsnorm-relu2")
    ids = variant_ids(m, batch=3)
    with torch.no_grad():
        logits = m(ids)
    good, bad = [4, 0, 7], torch.tensor([1, 2, 3])
    want = sum(float(logits[b, 5, good[b]] - logits[b, 5, int(bad[b])]) for b in range(3)) / 3
    assert abs(float(gb.logit_difference(good, bad, position=5)(logits)) - want) < 1e-12
    assert float(gb.logit_difference(torch.tensor(4), position=5)(logits)) == float(logits[:, 5, 4].mean())
    assert abs(float(gb.logit_difference(good, position=5)(logits))
               - sum(float(logits[b, 5, good[b]]) for b in range(3)) / 3) < 1e-12
    with pytest.raises(ValueError, match=r"one token per batch row: got 2 tokens for 3 rows"):
        gb.logit_difference([1, 2])(logits)
    with pytest.raises(ValueError, match=r"token must be one id or one id per batch row \(B,\), got shape \(1, 3\)"):
        gb.logit_difference([[1, 2, 3]])


def test_normalized_patching_is_the_fraction_of_the_gap_recovered():
    """normalize=True is (patched - corrupt) / (clean - corrupt) of the unnormalised table and the unpatched
    runs' metrics computed here: layer 0's input at the changed position recovers 1, the positions before it
    0; the same input twice has nothing to recover and says so."""
    m = variant_model("learned-layernorm-gelu")
    clean = variant_ids(m, batch=3)
    corrupt = clean.clone()
    corrupt[:, 4] = (corrupt[:, 4] + 3) % m.config.num_tokens
    metric = gb.logit_difference([1, 2, 3], torch.tensor([5, 6, 7]))
    with torch.no_grad():
        c, x = float(metric(m(clean))), float(metric(m(corrupt)))
    for over, by in (("resid_pre", "layer,pos"), ("attn_head", "layer,head"), ("mlp_out", "layer")):
        raw = gb.activation_patching(m, clean, corrupt, metric, over=over, by=by)
        frac = gb.activation_patching(m, clean, corrupt, metric, over=over, by=by, normalize=True)
        assert frac.shape == raw.shape and (frac - (raw - x) / (c - x)).abs().max() < 1e-12
    resid = gb.activation_patching(m, clean, corrupt, metric, over="resid_pre", by="layer,pos", normalize=True)
    assert abs(float(resid[0, 4]) - 1) < 1e-12 and resid[:, :4].abs().max() < 1e-12
    with pytest.raises(ValueError, match=r"the clean and corrupt runs give the same metric .* no difference"):
        gb.activation_patching(m, clean, clean, metric, by="layer", normalize=True)
    assert torch.equal(gb.recovered_fraction(torch.tensor([1.0, 3.0]), 3.0, 1.0), torch.tensor([0.0, 1.0]))


def test_a_key_value_head_of_grouped_query_attention_is_ablated_by_its_own_index():
    """The key/value points have n_kv_head heads: ablating key head 1 of 2 changes what query heads 2 and 3
    read and nothing of heads 0 and 1; a head past n_kv_head is refused naming n_kv_head."""
    m = variant_model("llama-gqa-swiglu")
    ids = variant_ids(m)
    _, clean = gb.run_with_cache(m, ids, "blocks.0.attn.hook_z")
    with torch.no_grad(), use_hooks(m, [gb.zero_ablation(m, "blocks.0.attn.hook_v", head=1)]):
        _, ablated = gb.run_with_cache(m, ids, "blocks.0.attn.hook_z")
    z, z0 = ablated["blocks.0.attn.hook_z"], clean["blocks.0.attn.hook_z"]
    assert torch.equal(z[:, :, :2], z0[:, :, :2]) and (z[:, :, 2:] == 0).all()  # values of zero: outputs of zero
    with pytest.raises(ValueError, match=r"head 2 is out of range; valid heads are 0 \.\. 1 \(n_kv_head=2\)"):
        gb.zero_ablation(m, "blocks.0.attn.hook_k", head=2)
    gb.zero_ablation(m, "blocks.0.attn.hook_q", head=3)  # the query heads: n_head of them
