"""ModelConfig, presets, and the two attention kernels computing the same function (issue: model)."""

import math

import pytest
import torch

import decoderlab as dl
from decoderlab.attention import MultiHeadAttention
from decoderlab.model import ModelConfig


@pytest.mark.parametrize("name,total", [("statquest", 37), ("gpt2", 124_439_808)])
def test_preset_parameter_counts(name, total):
    with torch.device("meta") if name == "gpt2" else torch.device("cpu"):
        m = dl.DecoderOnlyTransformer(name)
    assert m.num_parameters() == total


def test_gpt2_non_embedding_count():
    with torch.device("meta"):
        m = dl.DecoderOnlyTransformer("gpt2")
    assert m.num_parameters(non_embedding=True) == 124_439_808 - 50257 * 768 - 1024 * 768


@pytest.mark.parametrize("tie", [True, False])
def test_a_block_quantized_model_counts_the_weights_its_blocks_hold(tie):
    """Block layers keep their weights in buffers (integers and scales): num_parameters counts them as the float
    model's weights, a tied embedding and output layer once."""
    from decoderlab.quant import block_weights, quantize_model

    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", n_layer=2, d_model=64, n_head=2, num_tokens=96,
                                                max_len=32, tie_weights=tie))
    n, body = model.num_parameters(), model.num_parameters(non_embedding=True)
    quantize_model(model, "q4_0")
    assert sum(p.numel() for p in model.parameters()) < n / 2  # (the blocks are not parameters)
    assert (model.num_parameters(), model.num_parameters(non_embedding=True)) == (n, body)
    linears = [m for m in dl.DecoderOnlyTransformer(model.config).modules() if isinstance(m, torch.nn.Linear)]
    assert block_weights(model) == sum(m.in_features * m.out_features for m in linears)  # (tied: the output once)


def test_presets_are_what_they_say():
    b = dl.preset("baby-shakespeare")
    assert (b.n_layer, b.n_head, b.d_model, b.max_len, b.position, b.norm, b.mlp, b.tie_weights, b.ff_size) == (
        4, 4, 128, 64, "learned", "layernorm", "gelu", True, 512)
    s = dl.preset("shakespeare-char")
    assert (s.n_layer, s.n_head, s.d_model, s.max_len, s.dropout) == (6, 6, 384, 256, 0.2)
    q = dl.preset("statquest")
    assert (q.n_layer, q.n_head, q.norm, q.mlp, q.position, q.dropout) == (1, 1, "none", "none", "sinusoidal", 0.0)


def test_config_round_trips_through_json():
    c = dl.preset("baby-shakespeare", position="rope", norm="rmsnorm")
    assert ModelConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=10, n_head=3), "divisible by n_head"),
    (dict(d_model=12, n_head=4, position="rope"), "rope.*even head size"),
    (dict(d_model=-2), "d_model must be a positive integer"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(d_ff=-1), "d_ff"),
    (dict(norm="batchnorm"), "allowed: none, layernorm, rmsnorm"),
    (dict(position="alibi"), "allowed: sinusoidal, learned, rope, none"),
    (dict(mlp="reglu"), "allowed: none, gelu, relu2, swiglu, geglu"),
    (dict(attention="flash"), "allowed: sdpa, explicit"),
    (dict(dropout=1.5), "dropout"),
])
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{"num_tokens": 10, "d_model": 8, "n_head": 2, **kwargs})


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="known presets: statquest, baby-shakespeare"):
        dl.preset("gpt5")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({"num_tokens": 3, "d_modle": 4})


def _pair(d_model, n_head, bias, seed=0):
    torch.manual_seed(seed)
    a = MultiHeadAttention(d_model, n_head, bias=bias, kernel="sdpa")
    b = MultiHeadAttention(d_model, n_head, bias=bias, kernel="explicit")
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("seed", range(6))
def test_kernels_agree_on_random_configs(seed):
    g = torch.Generator().manual_seed(seed)
    n_head = int(torch.randint(1, 5, (1,), generator=g))
    d_head = int(torch.randint(1, 9, (1,), generator=g))  # odd head sizes included
    d_model = n_head * d_head
    max_len = 16
    a, b = _pair(d_model, n_head, bias=bool(seed % 2), seed=seed)
    for t in (1, 7, max_len):
        for bsz in (1, 3):
            x = torch.randn(bsz, t, d_model, generator=g)
            assert (a(x) - b(x)).abs().max() <= 1e-5
            # an additional key-padding mask (never masking a row entirely here)
            pm = torch.rand(bsz, t, generator=g) < 0.3
            pm[:, 0] = False
            assert (a(x, padding_mask=pm) - b(x, padding_mask=pm)).abs().max() <= 1e-5
            # cross-attention with a different key length, no causal mask
            kv = torch.randn(bsz, t + 5, d_model, generator=g)
            assert (a(x, kv, causal=False) - b(x, kv, causal=False)).abs().max() <= 1e-5
            # the explicit kernel can return the attention percents; rows sum to 1, future keys get 0
            y, w = b(x, return_weights=True)
            assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
            assert w.triu(1).abs().max() == 0


def test_kernels_agree_in_the_model():
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", n_layer=2, d_model=48, n_head=4, max_len=32, num_tokens=50)
    a = dl.DecoderOnlyTransformer(cfg)
    b = dl.DecoderOnlyTransformer(cfg.replace(attention="explicit"))
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 50, (2, 32))
    assert (a(ids) - b(ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_fully_masked_rows_are_zero_not_nan(kernel):
    torch.manual_seed(0)
    att = MultiHeadAttention(8, 2, kernel=kernel, out_proj=False)
    x = torch.randn(2, 4, 8)
    pm = torch.zeros(2, 4, dtype=torch.bool)
    pm[1, :] = True  # every key of the second sequence is padding
    y = att(x, padding_mask=pm)
    assert not torch.isnan(y).any()
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert y[0].abs().sum() > 0
    # with causal masking plus padding of the first keys, early queries see nothing
    pm2 = torch.zeros(2, 4, dtype=torch.bool)
    pm2[:, :2] = True
    y2 = att(x, padding_mask=pm2)
    assert torch.equal(y2[:, :2], torch.zeros_like(y2[:, :2])) and not torch.isnan(y2).any()


def test_gpt2_initialisation():
    torch.manual_seed(0)
    cfg = dl.preset("shakespeare-char", n_layer=8, dropout=0.0)
    m = dl.DecoderOnlyTransformer(cfg)
    assert abs(m.blocks[0].attention.qkv.weight.std().item() - 0.02) < 1e-3
    assert abs(m.we.weight.std().item() - 0.02) < 1e-3
    want = 0.02 / math.sqrt(2 * 8)
    assert abs(m.blocks[0].mlp.proj.weight.std().item() - want) < 5e-4
    assert abs(m.blocks[3].attention.proj.weight.std().item() - want) < 5e-4


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "none"])
@pytest.mark.parametrize("norm", ["none", "layernorm", "rmsnorm"])
def test_every_combination_builds_and_is_causal(position, norm):
    torch.manual_seed(0)
    cfg = ModelConfig(num_tokens=11, d_model=12, n_layer=2, n_head=3, max_len=10, position=position, norm=norm,
                      mlp="gelu", bias=True, tie_weights=True, attention="sdpa", attn_out_proj=True)
    m = dl.DecoderOnlyTransformer(cfg).eval()
    ids = torch.randint(0, 11, (2, 10))
    out = m(ids)
    assert out.shape == (2, 10, 11)
    ids2 = ids.clone()
    ids2[:, 6:] = (ids2[:, 6:] + 1) % 11  # changing the future does not change the past
    assert torch.allclose(m(ids2)[:, :6], out[:, :6], atol=1e-6)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_multihead_and_block_accept_unbatched_input(kernel):
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", d_model=16, n_head=2, n_layer=1, max_len=8, num_tokens=10, attention=kernel)
    block = dl.DecoderBlock(cfg)
    x = torch.randn(3, 5, 16)
    yb = block(x)
    for i in range(3):
        assert torch.allclose(block(x[i]), yb[i], atol=1e-6)
        assert torch.allclose(block.attention(x[i]), block.attention(x)[i], atol=1e-6)


def test_lesson_keywords_override_a_preset():
    m = dl.DecoderOnlyTransformer("baby-shakespeare", d_model=64, num_tokens=10, max_len=8)
    assert (m.config.d_model, m.config.num_tokens, m.config.max_len, m.config.n_layer) == (64, 10, 8, 4)
    m2 = dl.DecoderOnlyTransformer(dl.preset("gpt2", n_layer=1, d_model=64, n_head=4), num_tokens=20)
    assert (m2.config.num_tokens, m2.config.d_model) == (20, 64)


def test_half_precision_attention_is_finite_where_float32_is():
    """Scaled scores near -2e4 (Q Kᵀ near -8e4, past float16's 65504): the explicit kernel was all NaN."""
    from decoderlab.attention import build_ignore_mask, explicit_attention, sdpa_attention

    t, d = 5, 16
    q = torch.full((1, 2, t, d), 100.0)
    k = -50.0 - torch.arange(t, dtype=torch.float32).view(1, 1, t, 1).expand(1, 2, t, d) / 4  # exact in bf16
    v = torch.randn(1, 2, t, d, generator=torch.Generator().manual_seed(0))
    mask = build_ignore_mask(t, t, causal=True)
    want, want_p = explicit_attention(q, k, v, mask)
    assert -2.1e4 < float((q @ k.transpose(-2, -1))[0, 0, 1, 1]) / math.sqrt(d) < -2.0e4
    for dtype, tol in ((torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        out, p = explicit_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert out.dtype == p.dtype == dtype
        assert torch.isfinite(out).all() and torch.isfinite(p).all()
        assert (p.float() - want_p).abs().max() < tol and (out.float() - want).abs().max() < 5 * tol
        assert (p.float()[..., 0, 1:] == 0).all()  # causal
        s = sdpa_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert (s.float() - want).abs().max() < 5 * tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_trace_and_return_weights_of_a_half_model_are_finite_and_causal(dtype):
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", d_model=16, n_layer=2, n_head=2, max_len=12))
    with torch.no_grad():
        model.blocks[0].attention.qkv.weight.mul_(1200.0)  # Q Kᵀ far past float16's range
    ids = torch.randint(0, 65, (1, 10), generator=torch.Generator().manual_seed(1))
    ref = dl.trace(model, ids)
    assert ref.layers[0].sims.abs().max() > 7e4  # Q Kᵀ does not fit in float16, the scaled scores do
    model = model.to(dtype)
    tr = dl.trace(model, ids)
    for lt in tr.layers:
        p = lt.percents
        assert torch.isfinite(p).all() and (p.triu(1) == 0).all()
        assert torch.allclose(p.sum(-1), torch.ones(()), atol=1e-3)
    assert torch.isfinite(tr.logits).all()
    x = model.drop(model.pe(model.we(ids)))
    _, w = model.blocks[0].attention(model.blocks[0].norm_1(x), return_weights=True)
    assert w.dtype == dtype and torch.isfinite(w).all() and (w.float().triu(1) == 0).all()


def _tied(m) -> bool:
    return m.fc_layer.weight is m.we.weight


def test_weight_tying_survives_every_way_of_loading(tmp_path):
    """baby-shakespeare: 804,096 parameters with the head tied to the embedding (812,416 when untied)."""
    from decoderlab.checkpoint import load_checkpoint, save_checkpoint
    from decoderlab.hf import from_hf
    from decoderlab.hf.directory import hf_state
    from decoderlab.tokenizers import CharTokenizer

    torch.manual_seed(0)
    src = dl.DecoderOnlyTransformer("baby-shakespeare")
    state = src.state_dict()
    ids = torch.randint(0, 65, (1, 12))
    want = src(ids)

    a = dl.DecoderOnlyTransformer("baby-shakespeare")
    a.load_state_dict(state, assign=True)  # the meta-device loading pattern's call
    with torch.device("meta"):
        b = dl.DecoderOnlyTransformer("baby-shakespeare")
    b.load_state_dict(state, assign=True)
    with torch.device("meta"):
        c = dl.DecoderOnlyTransformer("baby-shakespeare")
    c.to_empty(device="cpu")
    c.load_state_dict(state)
    tok = CharTokenizer([chr(ord("a") + i) for i in range(63)])
    save_checkpoint(tmp_path / "ckpt", src, tok)
    d, _ = load_checkpoint(tmp_path / "ckpt")
    e = from_hf(hf_state(dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", bias=True)))[3], n_head=4)
    f = dl.DecoderOnlyTransformer("baby-shakespeare").half().float()
    for name, m in dict(assign=a, meta_assign=b, meta_to_empty=c, load_checkpoint=d, from_hf=e, half=f).items():
        assert _tied(m), name
        assert m.num_parameters() == (804_096 if name != "from_hf" else e.num_parameters()), name
        if name != "from_hf" and name != "half":
            assert torch.equal(m(ids), want), name
    assert e.num_parameters() == dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", bias=True)).num_parameters()
    # one optimizer step later the head is still the embedding
    before = a.we.weight.detach().clone()
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    a.compute_loss((ids, ids)).backward()
    opt.step()
    assert _tied(a) and len(opt.param_groups[0]["params"]) == len({id(p) for p in a.parameters()})
    assert not torch.equal(a.we.weight, before) and torch.equal(a.fc_layer.weight, a.we.weight)


def test_rope_tables_survive_the_meta_device():
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", d_model=16, n_layer=1, n_head=2, max_len=8, position="rope")
    src = dl.DecoderOnlyTransformer(cfg)
    ids = torch.randint(0, 65, (1, 8))
    for assign in (False, True):
        with torch.device("meta"):
            m = dl.DecoderOnlyTransformer(cfg)
        if not assign:
            m.to_empty(device="cpu")
        m.load_state_dict(src.state_dict(), assign=assign)
        assert torch.equal(m(ids), src(ids))


def test_a_shared_rope_table_is_made_once_per_conversion_that_changes_it(monkeypatch):
    """The layers share one RotaryEmbedding, which nn.Module._apply visits once per layer: a conversion that
    leaves the table as it is (``.to("cpu")``) recomputes nothing (Gemma 3's 18 layers recomputed a 32768-position
    table 18 times, ~1 s of its load); a dtype change makes it once, ``to_empty`` again, right."""
    from decoderlab.positions import RotaryEmbedding

    cfg = dl.preset("baby-shakespeare", d_model=16, n_layer=4, n_head=2, max_len=8, position="rope")
    model = dl.DecoderOnlyTransformer(cfg)
    made = []
    real = RotaryEmbedding._table
    monkeypatch.setattr(RotaryEmbedding, "_table", lambda self, *a: made.append(1) or real(self, *a))
    model.to("cpu")
    assert made == []
    rope = model.blocks[0].attention.rope
    assert all(b.attention.rope is rope for b in model.blocks)
    model.double()
    assert len(made) == 1 and rope.cos.dtype == torch.float64
    torch.testing.assert_close(rope.cos, real(rope, torch.float64)[0], rtol=0, atol=0)
    model.float()
    assert len(made) == 2
    model.to_empty(device="cpu")  # (new memory at every visit: made again each time)
    assert len(made) > 2 and torch.equal(rope.cos, real(rope)[0]) and torch.equal(rope.sin, real(rope)[1])


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "none"])
def test_left_padding_gives_the_unpadded_logits(position):
    """model(ids, padding_mask=pm) with left padding: the real tokens get the logits of the unpadded run (the
    pads were counted in the positions: 0.024 and 0.73 max difference for learned and sinusoidal)."""
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", d_model=32, n_layer=2, n_head=2, max_len=16,
                                                position=position)).double().eval()
    with torch.no_grad():
        if position == "learned":
            model.pe.weight.mul_(50.0)  # positions that matter
        rows = [torch.randint(0, 65, (n,)) for n in (9, 5, 7)]
        t = max(len(r) for r in rows)
        ids = torch.stack([torch.cat([torch.zeros(t - len(r), dtype=torch.long), r]) for r in rows])
        pm = torch.stack([torch.arange(t) < t - len(r) for r in rows])  # True = padded (on the left)
        out = model(ids, padding_mask=pm)
        for i, r in enumerate(rows):
            torch.testing.assert_close(out[i, t - len(r):], model(r), atol=1e-10, rtol=0)
        # the same positions given explicitly; a KV cache continuing the padded prefill
        pos = dl.DecoderOnlyTransformer.positions_from_mask(pm, t)
        assert pos[1].tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]
        torch.testing.assert_close(model(ids, padding_mask=pm, positions=pos), out, atol=0, rtol=0)
        from decoderlab.attention import KVCache

        cache = KVCache.for_model(model)
        model(ids[:, :-1], padding_mask=pm[:, :-1], cache=cache)
        last = model(ids[:, -1:], padding_mask=pm, cache=cache)
        torch.testing.assert_close(last[:, 0], out[:, -1], atol=1e-10, rtol=0)


def test_negative_positions_are_refused():
    torch.manual_seed(0)
    for position in ("learned", "sinusoidal", "rope", "none"):
        model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", d_model=16, n_layer=1, n_head=2, max_len=8,
                                                    position=position))
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(ValueError, match=r"positions must be >= 0 \(the first token is at position 0\), "
                                             r"got -1; allowed: 0 \.\. 7"):
            model(ids, positions=torch.tensor([-1, 0, 1]))
        with pytest.raises(ValueError, match="longer than max_len=8"):
            model(ids, positions=torch.tensor([6, 7, 8]))
        with pytest.raises(TypeError, match="positions must be a tensor of integer positions"):
            model(ids, positions=torch.tensor([0.0, 1.0, 2.0]))
    for pe in (dl.PositionEncoding(d_model=4, max_len=6), dl.LearnedPositionEncoding(4, 6)):
        with pytest.raises(ValueError, match="positions must be >= 0"):
            pe(torch.zeros(2, 4), positions=torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        dl.RotaryEmbedding(4, 6)(torch.zeros(1, 1, 2, 4), positions=torch.tensor([0, -1]))


@pytest.mark.parametrize("position,norm", [("learned", "layernorm"), ("rope", "rmsnorm"), ("sinusoidal", "none")])
def test_last_only_equals_the_last_row_of_the_full_forward(position, norm):
    """``last_only=True`` (the engine's prefill) runs the output layer on the last position only: its logits
    are the full forward's last row (float64: equal to 1e-12; float32 matmuls of other shapes round
    differently, so not bit for bit), with padding, per-row positions and a KV cache too."""
    from decoderlab.attention import KVCache

    torch.manual_seed(0)
    cfg = ModelConfig(num_tokens=11, d_model=12, n_layer=2, n_head=3, max_len=10, position=position, norm=norm,
                      mlp="gelu", tie_weights=True, attention="sdpa", attn_out_proj=True, lm_head_bias=False)
    m = dl.DecoderOnlyTransformer(cfg).double().eval()
    ids = torch.randint(0, 11, (3, 7))
    pads = torch.tensor([[0], [2], [4]])
    mask = torch.arange(7)[None] < pads
    positions = (torch.arange(7)[None] - pads).clamp_min(0)
    with torch.no_grad():
        for kw in ({}, {"padding_mask": mask, "positions": positions}):
            full = m(ids, **kw)
            last = m(ids, last_only=True, **kw)
            assert last.shape == (3, 1, 11)
            assert torch.allclose(last[:, 0], full[:, -1], rtol=1e-12, atol=1e-12)
            cached = m(ids, cache=KVCache.for_model(m), last_only=True, **kw)
            assert torch.allclose(cached, last, rtol=1e-12, atol=1e-12)
        assert m(ids[0], last_only=True).shape == (1, 11)  # unbatched (T,) -> (1, num_tokens)
        assert torch.allclose(m(ids[0], last_only=True)[0], m(ids[0])[-1], rtol=1e-12, atol=1e-12)


def test_resize_token_embeddings_keeps_the_tying_and_the_old_logits():
    """The model grows its own vocabulary (Hugging Face's name): new rows at the mean of the old ones, the head
    still the embedding's one Parameter, config.num_tokens in step, and the old tokens' logits unchanged."""
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=11, d_model=16, n_layer=1, n_head=2,
                                                max_len=16))
    assert model.config.tie_weights
    x = torch.tensor([[1, 2, 3, 10]])
    before, old_rows = model(x).detach(), model.we.weight.detach().clone()
    we = model.resize_token_embeddings(14)
    assert we is model.we and we.weight.shape == (14, 16) and model.config.num_tokens == 14 == model.num_tokens
    assert model.fc_layer.weight is model.we.weight and model.fc_layer.out_features == 14
    torch.testing.assert_close(model.we.weight[:11], old_rows, rtol=0, atol=0)
    torch.testing.assert_close(model.we.weight[11:], old_rows.mean(0).expand(3, -1))
    after = model(x)
    assert after.shape == (1, 4, 14)
    # the tied head's new rows shift the softmax's normaliser only: the old logits are the same numbers
    torch.testing.assert_close(after[..., :11], before)
    assert model.resize_token_embeddings(14) is model.we  # the same size: nothing changes
    with pytest.raises(ValueError, match="cannot shrink the vocabulary from 14 to 12 tokens"):
        model.resize_token_embeddings(12)


def test_a_vocabulary_held_in_blocks_grows_in_its_blocks_and_the_rest_stays_in_blocks():
    """A GGUF model's tied embedding and output layer in q8_0 blocks (a LoRA run over the blocks adding chat
    tokens): they stay one q8_0 weight, the old rows byte for byte, the new rows the mean row quantized to q8_0 --
    no float copy of the vocabulary (Gemma 3's would be 671 MB); the old tokens' logits are the same numbers. A
    K-quant embedding (no quantizer here) becomes one float Parameter of the dequantized rows plus the mean."""
    from decoderlab.quant import BlockWeight, dequantized_state_dict, is_block_layer, quantize_model

    torch.manual_seed(0)
    model = quantize_model(dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=32, d_model=32,
                                                               n_layer=1, n_head=2, max_len=16, dropout=0.0)), "q8_0")
    x = torch.tensor([[1, 2, 31]])
    rows, bytes_before, before = dequantized_state_dict(model)["we.weight"], model.we.blocks.to_gguf(), model(x)
    we = model.resize_token_embeddings(34)
    assert we is model.we and is_block_layer(model.we) and is_block_layer(model.fc_layer)
    assert model.we.blocks.shape == (34, 32) and model.fc_layer.out_features == 34 == model.config.num_tokens
    assert model.fc_layer.packed[0] is model.we.packed[0]  # (still one set of bytes, read both ways)
    assert (model.we.blocks.to_gguf()[:32] == bytes_before).all()
    mean = BlockWeight.quantize(rows.mean(0, keepdim=True), "q8_0").dequantize()
    torch.testing.assert_close(model.we.dequantize(), torch.cat([rows, mean.expand(2, -1)]), rtol=0, atol=0)
    torch.testing.assert_close(model(x)[..., :32], before, rtol=0, atol=0)
    assert is_block_layer(model.blocks[0].attention.qkv)

    kquant = BlockWeight.from_gguf(torch.zeros(256, 144, dtype=torch.uint8), "q4_k", (256, 256))
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=256, d_model=256, n_layer=1,
                                                n_head=2, max_len=16))
    from decoderlab.quant import use_block_weights

    use_block_weights(model, {"we": kquant})
    model.resize_token_embeddings(258)
    assert not is_block_layer(model.we) and model.fc_layer.weight is model.we.weight
    assert model.we.weight.shape == (258, 256) and not model.we.weight.any()
