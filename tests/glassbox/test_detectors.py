"""Head detectors (TransformerLens's definitions) on hand-made patterns, and composition scores by hand."""

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb
from decoderlab.glassbox.cache import ActivationCache

from .models import variant_ids, variant_model


def test_detection_patterns_by_hand():
    tokens = torch.tensor([7, 8, 9, 7, 8])
    prev = gb.detection_pattern("previous_token", tokens)
    assert prev.tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0]]
    dup = gb.detection_pattern("duplicate_token", tokens)
    assert dup.nonzero().tolist() == [[3, 0], [4, 1]]  # 7@3 saw 7@0, 8@4 saw 8@1
    ind = gb.detection_pattern("induction", tokens)
    assert ind.nonzero().tolist() == [[3, 1], [4, 2]]  # the token after each earlier copy
    with pytest.raises(ValueError, match="unknown head detector 'copy'; allowed: previous_token, duplicate_token"):
        gb.detection_pattern("copy", tokens)


def _cache_with(model, ids, patterns):
    """An ActivationCache holding the given (B, H, T, T) patterns as every layer's."""
    store = {f"blocks.{i}.attn.hook_pattern": p for i, p in enumerate(patterns)}
    return ActivationCache(model, ids, None, store)


def test_scores_of_perfect_heads():
    """A head that attends to the previous token scores (T - 1) / T ("mul": its query 0 has no previous token
    and looks at itself); a perfect induction head on a sequence repeated twice scores 1/2; "abs" gives 1."""
    m = variant_model("attention-only")
    length = 5
    ids = gb.repeated_tokens(23, length, seed=3)
    assert len(set(ids[0, :length].tolist())) == length  # distinct, so the patterns are exactly these
    t = 2 * length
    prev = torch.diag(torch.ones(t - 1), -1)
    prev[0, 0] = 1
    induction = torch.zeros(t, t)
    induction[:length] = torch.eye(t)[:length]  # the first half looks at itself
    for i in range(length, t):
        induction[i, i - length + 1] = 1
    pats = [torch.stack([prev, induction, prev, induction])[None].double()] * 2
    cache = _cache_with(m, ids, pats)
    scores = gb.all_head_scores(m, cache=cache)
    assert torch.allclose(scores["previous_token"][:, 0], torch.full((2,), (t - 1) / t, dtype=torch.float64))
    assert torch.allclose(scores["induction"][:, 1], torch.full((2,), 0.5, dtype=torch.float64))
    assert scores["induction"][0, 0] == 0 and scores["previous_token"][0, 1] == 0  # neither looks like the other
    exact = gb.head_scores(m, kind="previous_token", cache=_cache_with(m, ids, [torch.stack([
        gb.detection_pattern("previous_token", ids[0])] * 4)[None].double()] * 2), error_measure="abs")
    assert (exact == 1).all()
    # the same scores from the model's own run: shapes, and the pattern rows sum to 1 so "mul" is a share
    got = gb.head_scores(m, ids)
    assert got.shape == (2, 4) and ((got >= 0) & (got <= 1)).all()


def test_detectors_on_a_one_layer_model_and_composition_needs_two():
    m = variant_model("statquest")
    ids = [0, 1, 2, 0, 1, 2]
    assert gb.head_scores(m, ids, "duplicate_token").shape == (1, 1)
    with pytest.raises(ValueError, match=r"composition scores need a model with at least 2 layers .* this model "
                                         r"has n_layer=1"):
        gb.composition_scores(m)
    with pytest.raises(ValueError, match="need at least 2 tokens per row, got 1"):
        gb.head_scores(m, [1])
    with pytest.raises(ValueError, match="unknown error_measure 'max'; allowed: mul, abs"):
        gb.head_scores(m, ids, error_measure="max")
    with pytest.raises(ValueError, match="unknown composition mode 'O'"):
        gb.composition_scores(variant_model("attention-only"), "O")
    with pytest.raises(ValueError, match="repeats must be an integer >= 2"):
        gb.repeated_tokens(10, 4, repeats=1)


def test_composition_scores_by_hand():
    """Without norms the matrices are the weights themselves: ||OV1 W2|| / (||OV1|| ||W2||), in NumPy."""
    m = variant_model("no-positions-no-norm")
    h, dh, d = 4, 4, 16

    def mats(layer):
        qkv = m.blocks[layer].attention.qkv.weight.detach().numpy()
        w_o = m.blocks[layer].attention.proj.weight.detach().numpy()
        out = []
        for j in range(h):
            rows = slice(j * dh, (j + 1) * dh)
            w_q, w_k, w_v = (qkv[k * d:(k + 1) * d][rows].T for k in range(3))  # (d_model, d_head)
            out.append((w_q @ w_k.T, w_v @ w_o[:, rows].T))  # QK, OV as (d_model, d_model) in x @ W form
        return out

    first, second = mats(0), mats(1)
    got = {mode: gb.composition_scores(m, mode) for mode in "QKV"}
    fro = np.linalg.norm
    for h1 in range(h):
        ov1 = first[h1][1]
        for h2 in range(h):
            qk2, ov2 = second[h2]
            for mode, right in (("Q", qk2), ("K", qk2.T), ("V", ov2)):
                want = fro(ov1 @ right) / (fro(ov1) * fro(right))
                assert abs(float(got[mode][0, h1, 1, h2]) - want) < 1e-12
    assert (got["K"][1] == 0).all() and (got["K"][0, :, 0] == 0).all()


def test_induction_probe_shapes():
    ids = gb.repeated_tokens(50, 7, batch=3, seed=1, first=0)
    assert ids.shape == (3, 15) and (ids[:, 0] == 0).all() and torch.equal(ids[:, 1:8], ids[:, 8:])
    assert torch.equal(ids, gb.repeated_tokens(50, 7, batch=3, seed=1, first=0))  # seeded: the same probe
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    gb.repeated_tokens(50, 7)
    assert torch.equal(torch.rand(1), a)  # the global RNG is untouched
    m = dl.DecoderOnlyTransformer("baby-shakespeare", n_layer=2, max_len=16)
    assert gb.head_scores(m, variant_ids(m), "induction").shape == (2, 4)


def test_scores_table_has_a_line_per_head():
    m = variant_model("attention-only", dtype=torch.float32)
    scores = gb.all_head_scores(m, gb.repeated_tokens(23, 5))
    lines = gb.scores_table(scores).splitlines()
    assert lines[0].split() == ["head", "previous-token", "duplicate-token", "induction"]
    assert len(lines) == 1 + 2 * 4 and lines[6].split()[0] == "L1H1"
    assert float(lines[6].split()[3]) == pytest.approx(float(scores["induction"][1, 1]), abs=5e-4)



@pytest.mark.parametrize("variant", ["llama-gqa-swiglu", "qwen-mqa-biases-gains"])
def test_head_matrices_of_grouped_query_attention_are_each_query_heads(variant):
    """W_Q, W_K, W_V of a grouped-query layer (4 query heads; 2 key/value heads, or 1 with heads of 6 beside
    d_model 16): the normalized input times a head's matrix (the norm's gain folded in), plus the head's bias, is
    that head's hook_q, and W_K / W_V of query head j give its key/value head's hook_k / hook_v --
    TransformerLens's repeated W_K, W_V."""
    from decoderlab.glassbox.detectors import head_matrices

    m = variant_model(variant)
    attn = m.blocks[1].attention
    _, cache = gb.run_with_cache(m, variant_ids(m))
    x = cache["blocks.1.ln1.hook_normalized"]  # (B, T, d_model)
    w_q, w_k, w_v, w_o = head_matrices(m, 1)
    h, dh, d = m.config.n_head, m.config.d_head, m.config.d_model
    assert w_q.shape == w_k.shape == w_v.shape == (h, d, dh) and w_o.shape == (h, dh, d)
    bias = attn.qkv.bias if attn.qkv.bias is not None else torch.zeros(attn.qkv.out_features, dtype=x.dtype)
    b_q, b_k, b_v = (b.view(-1, dh) for b in bias.detach().split((attn.q_size, attn.kv_size, attn.kv_size)))
    for j in range(h):
        kv = j * m.config.kv_heads // h
        assert torch.allclose(x @ w_q[j] + b_q[j], cache["blocks.1.attn.hook_q"][:, :, j], atol=1e-12)
        assert torch.allclose(x @ w_k[j] + b_k[kv], cache["blocks.1.attn.hook_k"][:, :, kv], atol=1e-12)
        assert torch.allclose(x @ w_v[j] + b_v[kv], cache["blocks.1.attn.hook_v"][:, :, kv], atol=1e-12)
