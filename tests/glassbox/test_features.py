"""An SAE inside the model (decoderlab.glassbox.features): activations at a hook, SAELens's evaluation (CE loss
recovered 1 for an identity SAE, 0 for one that outputs zeros), a feature ablated and steered with, and the
numbers of a feature's dashboard."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tiny_models import one_thread  # noqa: F401 -- autouse

import decoderlab as dl
from decoderlab.glassbox import run_with_cache, run_with_hooks
from decoderlab.glassbox.dashboards import context_text, dashboard_html, dashboard_text
from decoderlab.glassbox.features import (evaluate_sae, feature_ablation, feature_dashboard, feature_steering,
                                          held_out_windows, hook_activations, logit_effects, splice_sae,
                                          token_features)
from decoderlab.glassbox.sae import SparseAutoencoder

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", n_layer=2, d_model=16, n_head=2, max_len=12, num_tokens=20)
    model = dl.DecoderOnlyTransformer(cfg).double().eval()
    with torch.no_grad():
        model.fc_layer.weight.mul_(8.0)  # confident predictions: the zero-ablated loss differs visibly
    return model


@pytest.fixture(scope="module")
def windows():
    g = np.random.default_rng(0)
    return held_out_windows(g.integers(0, 20, size=12 * 30 + 1), 12)


def _identity_sae(d: int) -> SparseAutoencoder:
    """ReLU(x) - ReLU(-x) = x: an "SAE" of 2 d features that reconstructs exactly."""
    sae = SparseAutoencoder(d, 2 * d, None, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def test_hook_activations_equal_the_cache(model, windows):
    ids = windows[:3, :-1]
    _, cache = run_with_cache(model, ids, [HOOK, "blocks.1.attn.hook_z"])  # no pattern: the same kernel
    assert torch.equal(hook_activations(model, ids, HOOK), cache[HOOK])
    z = hook_activations(model, ids, "blocks.1.attn.hook_z")
    assert torch.equal(z, cache["blocks.1.attn.hook_z"].flatten(2))
    with pytest.raises(ValueError, match="unknown hook name"):
        hook_activations(model, ids, "blocks.9.hook_resid_post")


def test_ce_loss_recovered_is_one_for_an_identity_sae_and_zero_for_zeros(model, windows):
    ident = evaluate_sae(model, _identity_sae(16), HOOK, windows, batch_size=7)
    assert abs(ident.ce_loss_recovered - 1.0) < 1e-9 and abs(ident.ce_sae - ident.ce_clean) < 1e-9
    assert abs(ident.explained_variance - 1.0) < 1e-9 and ident.mse < 1e-20
    assert ident.tokens == windows.size(0) * 12
    assert abs(ident.ce_zero - ident.ce_clean) > 0.05  # removing the residual stream changes the loss
    zeros = _identity_sae(16)
    with torch.no_grad():
        zeros.W_dec.zero_()
    z = evaluate_sae(model, zeros, HOOK, windows)
    assert abs(z.ce_loss_recovered) < 1e-9 and abs(z.ce_sae - z.ce_zero) < 1e-9
    assert z.ce_clean == pytest.approx(ident.ce_clean, abs=1e-12)


def test_evaluation_numbers_match_a_direct_computation(model, windows):
    sae = SparseAutoencoder(16, 64, 4, seed=0, dtype=torch.float64)
    ev = evaluate_sae(model, sae, HOOK, windows, batch_size=9)
    ids, targets = windows[:, :-1], windows[:, 1:]
    x = hook_activations(model, ids, HOOK).flatten(0, 1)
    f = sae.encode(x)
    x_hat = sae.decode(f)
    mse = (x - x_hat).pow(2).sum(-1).mean()
    var = x.pow(2).sum(-1).mean() - x.mean(0).pow(2).sum()
    assert ev.mse == pytest.approx(float(mse), rel=1e-9)
    assert ev.explained_variance == pytest.approx(float(1 - mse / var), rel=1e-9)
    assert ev.l0 == pytest.approx(4.0) and ev.dead_share == float(((f > 0).sum(0) == 0).double().mean())

    def ce(logits):
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))

    spliced = run_with_hooks(model, ids, [splice_sae(sae, HOOK)])
    assert ev.ce_sae == pytest.approx(ce(spliced), rel=1e-9)
    assert ev.ce_clean == pytest.approx(ce(model(ids)), rel=1e-9)
    assert "CE loss recovered" in ev.table()


def test_the_evaluation_names_its_dead_measure(model, windows):
    """Its dead row said "dead features 84%" after training's progress said "dead 0/1152": now the count of d_sae
    and the tokens it fired on none of, the measure training's progress lines count too."""
    sae = SparseAutoencoder(16, 64, 4, seed=0, dtype=torch.float64)
    ev = evaluate_sae(model, sae, HOOK, windows)
    dead = int(((ev.density == 0)).sum())
    assert ev.dead_features == dead == round(ev.dead_share * 64)
    label = f"dead (fired on none of the {windows.size(0) * 12:,} tokens)"
    value = f"{dead}/64 ({100 * ev.dead_share:.2f}%)"
    assert re.search(f"^{re.escape(label)} +{re.escape(value)}$", ev.table(), re.M), ev.table()


def test_the_evaluation_says_how_it_goes(model, windows):
    """The evaluation ran minutes in silence after training's last line: now ``progress`` hears the tokens done
    after each of a batch's three passes, a third of the batch each (``decoderlab sae`` prints lines of them)."""
    heard = []
    evaluate_sae(model, SparseAutoencoder(16, 64, 4, seed=0, dtype=torch.float64), HOOK, windows, batch_size=7,
                 progress=heard.append)
    ends = [min(i + 7, windows.size(0)) * 12 for i in range(0, windows.size(0), 7)]  # 30 windows: 7, 7, 7, 7, 2
    starts = [0, *ends[:-1]]
    assert heard == [a + (b - a) * k // 3 for a, b in zip(starts, ends) for k in (1, 2, 3)]
    assert heard[:3] == [28, 56, 84] and heard[-1] == 360


def test_ablation_and_steering_change_the_activation_as_defined(model, windows):
    sae = SparseAutoencoder(16, 64, 8, seed=2, dtype=torch.float64)
    ids = windows[:2, :-1]
    x = hook_activations(model, ids, HOOK)
    f = sae.encode(x)
    feat = int(f[0, 5].argmax())
    seen = {}

    def grab(a, name):
        seen["x"] = a.clone()

    run_with_hooks(model, ids, [feature_ablation(sae, HOOK, feat), (HOOK, grab)])
    assert torch.allclose(seen["x"], x - f[..., feat:feat + 1] * sae.W_dec[feat], atol=1e-12)
    assert float(sae.encode(seen["x"])[0, 5, feat]) < float(f[0, 5, feat])
    run_with_hooks(model, ids, [feature_steering(sae, HOOK, feat, 3.0, positions=[5]), (HOOK, grab)])
    want = x.clone()
    want[:, 5] += 3.0 * sae.W_dec[feat]
    assert torch.allclose(seen["x"], want, atol=1e-12)
    for bad in (64, -1, 2.0):
        with pytest.raises(ValueError, match=r"valid features are 0 \.\. 63 \(d_sae=64\)"):
            feature_ablation(sae, HOOK, bad)
    with pytest.raises(ValueError, match="position 12 is outside the text of 12 tokens"):
        run_with_hooks(model, ids, [feature_steering(sae, HOOK, feat, 1.0, positions=[12])])


def test_dashboard_numbers(model, windows):
    sae = SparseAutoencoder(16, 64, 8, seed=2, dtype=torch.float64)
    ids = windows[:, :-1]
    acts = sae.encode(hook_activations(model, ids, HOOK))
    feat = int((acts > 0).sum((0, 1)).argmax())
    d = feature_dashboard(model, sae, HOOK, feat, ids, n_contexts=5, before=3, after=1, batch_size=7)
    col = acts[..., feat]
    assert d.density == pytest.approx(float((col > 0).double().mean()))
    assert int(d.histogram[0].sum()) == int((col > 0).sum())
    top = col.flatten().topk(5).values
    assert [c.activation for c in d.contexts] == pytest.approx(top.tolist())
    for c in d.contexts:
        assert c.activations[c.position] == pytest.approx(c.activation)
    # logit effects: the direction centred (layernorm), times the norm's weight, through fc_layer
    w = sae.W_dec[feat] - sae.W_dec[feat].mean()
    want = model.fc_layer.weight @ (w * model.norm_f.weight)
    assert torch.allclose(logit_effects(model, sae, feat).double(), want, atol=1e-6)
    tok = dl.CharTokenizer.from_text("abcdefghijklmnopqrs")
    assert "[[" in context_text(d.contexts[0], tok) and f"feature {feat} at {HOOK}" in dashboard_text(d, tok)
    page = dashboard_html(d, tok)
    assert page.startswith("<!DOCTYPE html>") and "https://" not in page
    with pytest.raises(ValueError, match=r"feature 64 is out of range; valid features are 0 \.\. 63"):
        feature_dashboard(model, sae, HOOK, 64, ids)


def test_token_features_are_the_strongest_active_ones(model, windows):
    sae = SparseAutoencoder(16, 64, 6, seed=4, dtype=torch.float64)
    ids = windows[0, :-1]
    per = token_features(model, sae, HOOK, ids, top=3)
    f = sae.encode(hook_activations(model, ids, HOOK))[0]
    assert len(per) == 12
    for t, rows in enumerate(per):
        assert [i for i, _ in rows] == f[t].topk(3).indices.tolist()[:len(rows)]
        assert all(v > 0 for _, v in rows)
