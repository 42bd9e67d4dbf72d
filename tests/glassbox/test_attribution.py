"""Attribution that adds up: the logit lens and the decomposition of a logit, for every model variant, exact in
float64 and recomputed apart by the float64 NumPy reference."""

import math

import numpy as np
import pytest
import torch

from decoderlab import glassbox as gb

from .models import VARIANT_CONFIGS, variant_ids, variant_model


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_the_decomposition_sums_to_the_logit_in_float64(variant):
    m = variant_model(variant)
    ids = variant_ids(m)
    logits, cache = gb.run_with_cache(m, ids, names_filter=gb.decompose_names(m))
    worst = 0.0
    for batch in range(ids.size(0)):
        for pos in range(ids.size(1)):
            for token in (0, m.config.num_tokens - 1, int(ids[batch, pos])):
                d = gb.decompose(cache, pos, token, batch=batch)
                assert float(d.logit) == float(logits[batch, pos, token])
                worst = max(worst, abs(float(d.total()) - float(d.logit)))
    assert worst < 1e-9
    d = gb.decompose(cache, -1, 1)
    labels = set(d.labels)
    assert {f"L0H{h}" for h in range(m.config.n_head)} <= labels and "embed" in labels
    assert ("pos_embed" in labels) == (m.config.position in ("learned", "sinusoidal"))
    assert ("L0 mlp" in labels) == (m.config.mlp != "none")
    assert ("unembed bias" in labels) == m.config.lm_head_bias
    assert ("final norm bias" in labels) == (m.config.norm == "layernorm" and m.config.bias)
    assert len(d.labels) == len(d.values) and d.values.dtype == torch.float64


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_the_numpy_reference_recomputes_the_decomposition(variant):
    m = variant_model(variant)
    ids = variant_ids(m)
    cache = gb.run_with_cache(m, ids)[1]
    for batch, pos, token in ((0, 0, 1), (1, ids.size(1) - 1, 3), (1, 2, int(ids[1, 3]))):
        d = gb.decompose(cache, pos, token, batch=batch)
        labels, values, logit = gb.numpy_decompose(m, ids, pos, token, batch=batch)
        assert labels == d.labels
        assert np.abs(values - d.values.numpy()).max() < 1e-9
        assert abs(logit - float(d.logit)) < 1e-9 and abs(values.sum() - logit) < 1e-9


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_the_logit_lens_reads_each_layer_through_the_final_norm(variant):
    m = variant_model(variant)
    ids = variant_ids(m)
    logits, cache = gb.run_with_cache(m, ids, names_filter=gb.lens_names(m))
    lens = gb.logit_lens(cache)
    n = m.config.n_layer
    assert lens.labels == [f"{i}_pre" for i in range(n)] + ["final_post"]
    assert lens.logits.shape == (n + 1, *logits.shape) and lens.positions == list(range(ids.size(1)))
    assert (lens.logits[-1] - logits).abs().max() < 1e-12
    with torch.no_grad():  # layer 0's reading is the embeddings' (+ positions) through norm_f and fc_layer
        assert (lens.logits[0] - m.fc_layer(m.norm_f(cache["blocks.0.hook_resid_pre"]))).abs().max() < 1e-12
    one = gb.logit_lens(cache, positions=-1)
    assert one.positions == [ids.size(1) - 1] and (one.logits[:, :, 0] - lens.logits[:, :, -1]).abs().max() < 1e-12
    top = one.top(k=3)
    assert len(top) == n + 1 and top[-1][0][0] == int(logits[0, -1].argmax())
    assert abs(sum(p for _, p in one.top(k=m.config.num_tokens)[0]) - 1) < 1e-9
    assert one.table().splitlines()[0] == f"logit lens at position {ids.size(1) - 1}:"


def test_a_rmsnorm_lens_does_not_centre():
    """The logit lens of an RMSNorm model is the RMSNorm's (TransformerLens's bug #1077: a centred one)."""
    m = variant_model("rope-rmsnorm-relu2")
    cache = gb.run_with_cache(m, variant_ids(m))[1]
    x = cache["blocks.1.hook_resid_pre"]
    want = m.fc_layer(x / (x.pow(2).mean(-1, keepdim=True) + m.config.norm_eps).sqrt() * m.norm_f.weight)
    assert (gb.logit_lens(cache).logits[1] - want).abs().max() < 1e-12
    centred = x - x.mean(-1, keepdim=True)
    wrong = m.fc_layer(centred / (centred.pow(2).mean(-1, keepdim=True) + m.config.norm_eps).sqrt() * m.norm_f.weight)
    assert (gb.logit_lens(cache).logits[1] - wrong).abs().max() > 1e-3


def test_the_decomposition_of_the_lessons_model_by_hand():
    """The lesson's model: logit = (embedding + position + head output) @ W + b, nothing else."""
    m = variant_model("statquest")
    ids = torch.tensor([[0, 1, 2, 4]])
    cache = gb.run_with_cache(m, ids)[1]
    d = gb.decompose(cache, 3, 3)
    assert d.labels == ["embed", "pos_embed", "L0H0", "unembed bias"]
    w, b = m.fc_layer.weight[3], m.fc_layer.bias[3]
    pe = torch.tensor([math.sin(3), math.cos(3)], dtype=torch.float64)
    want = [m.we.weight[4] @ w, pe @ w, cache["blocks.0.attn.hook_z"][0, 3, 0] @ w, b]
    assert torch.allclose(d.values, torch.stack(want), atol=1e-12, rtol=0)
    table = d.table()
    assert table.splitlines()[0] == "logit of 3 at position 3, by part:" and "sum" in table.splitlines()[-1]


def test_decompose_bad_inputs_name_the_valid_range():
    m = variant_model("learned-layernorm-gelu")
    cache = gb.run_with_cache(m, variant_ids(m))[1]
    with pytest.raises(ValueError, match=r"position 9 is outside the sequence; valid positions are 0 \.\. 8"):
        gb.decompose(cache, 9, 1)
    with pytest.raises(ValueError, match=r"position -10 is outside the sequence"):
        gb.decompose(cache, -10, 1)
    with pytest.raises(ValueError, match=r"token 23 is outside the vocabulary; valid ids are 0 \.\. 22"):
        gb.decompose(cache, 0, 23)
    with pytest.raises(ValueError, match=r"token -1 is outside the vocabulary"):
        gb.decompose(cache, 0, -1)
    with pytest.raises(ValueError, match=r"batch row 2 is out of range; valid rows are 0 \.\. 1"):
        gb.decompose(cache, 0, 1, batch=2)
    with pytest.raises(ValueError, match=r"position 'a' is outside the sequence"):
        gb.logit_lens(cache, positions=["a"])
    small = gb.run_with_cache(m, variant_ids(m), names_filter="hook_embed")[1]
    with pytest.raises(KeyError, match=r"'hook_pos_embed' was not kept in this cache"):
        gb.decompose(small, 0, 1)


def test_a_model_with_lora_adapters_is_told_to_merge_them():
    pytest.importorskip("peft")
    from decoderlab.lora import apply_lora, merge_lora

    m = apply_lora(variant_model("learned-layernorm-gelu", dtype=torch.float32), rank=2, targets="attn", init=False)
    cache = gb.run_with_cache(m, variant_ids(m))[1]
    with pytest.raises(ValueError, match=r"blocks.0.attention.proj is a .*not an nn.Linear \(LoRA adapters\?\): "
                                         r"merge them first \(decoderlab.lora.merge_lora\(model\)\)"):
        gb.decompose(cache, 0, 1)
    with pytest.raises(ValueError, match="merge them first"):
        gb.composition_scores(m)
    merged = merge_lora(m)
    d = gb.decompose(gb.run_with_cache(merged, variant_ids(m))[1], 0, 1)
    assert abs(float(d.total()) - float(d.logit)) < 1e-4


@pytest.mark.parametrize("variant", ["learned-layernorm-gelu", "rope-rmsnorm-relu2", "no-positions-no-norm"])
def test_the_lens_reads_a_token_per_cell_its_rank_and_the_first_entry_on_top(variant):
    """token_probs, ranks and first_on_top against the lens's logits recomputed here in float64 from the
    cached residuals, and against a loop over the entries."""
    m = variant_model(variant)
    ids = variant_ids(m)
    cache = gb.run_with_cache(m, ids, names_filter=gb.lens_names(m))[1]
    positions = [0, 4, 8]
    lens = gb.logit_lens(cache, positions=positions)
    tokens = ids[:, [1, 5, 8]]  # (B, P): one id per row and position, as the next tokens of a text
    with torch.no_grad():
        stack = torch.stack([cache[n][:, positions] for n in gb.lens_names(m)])
        probs = torch.softmax(m.fc_layer(m.norm_f(stack)), -1)  # (L + 1, B, P, V)
    got = lens.token_probs(tokens)
    assert got.shape == (m.config.n_layer + 1, 2, 3)
    ranks = lens.ranks(tokens)
    for e in range(m.config.n_layer + 1):
        for b in range(2):
            for p in range(3):
                t = int(tokens[b, p])
                assert abs(float(got[e, b, p]) - float(probs[e, b, p, t])) < 1e-12
                assert int(ranks[e, b, p]) == int((probs[e, b, p] > probs[e, b, p, t]).sum())
    top_final = cache.logits[:, positions].argmax(-1)  # the model's own choice is on top at the output
    n = m.config.n_layer
    for want in (tokens, top_final):
        first, kept_first = lens.first_on_top(want), lens.first_on_top(want, stay=True)
        for b in range(2):
            for p in range(3):
                on_top = [e for e in range(n + 1) if int(probs[e, b, p].argmax()) == int(want[b, p])]
                assert int(first[b, p]) == (on_top[0] if on_top else -1)
                kept = [e for e in on_top if all(f in on_top for f in range(e, n + 1))]
                assert int(kept_first[b, p]) == (kept[0] if kept else -1)
    assert (lens.ranks(top_final)[-1] == 0).all() and ((lens.first_on_top(top_final) >= 0)).all()
    assert torch.equal(lens.token_probs(3), probs[..., 3])  # one id for every cell


def test_the_lens_token_readers_refuse_bad_tokens():
    m = variant_model("learned-layernorm-gelu")
    cache = gb.run_with_cache(m, variant_ids(m), names_filter=gb.lens_names(m))[1]
    lens = gb.logit_lens(cache, positions=[0, 1])
    with pytest.raises(ValueError, match=r"tokens must be one id or \(B, P\) = \(2, 2\) ids .* got shape \(2, 3\)"):
        lens.token_probs(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must be in 0 \.\. 22 \(num_tokens=23\); got 0 \.\. 23"):
        lens.first_on_top(torch.tensor([[0, 23], [1, 2]]))
