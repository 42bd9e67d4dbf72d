"""16-bit matrices with float32 activations (decoderlab.half): each product path against its reference -- the
kernels' dense_linear for a decode step's rows, F.linear of the widened weight for a prompt's and for gradients,
plain F.linear in the weight's own dtype --; the embedding's rows widened; a model's layers swapped in place
(tied weights kept tied); and a 16-bit GGUF file decoding through the fused step with the same greedy tokens as
its float32 reading (F16: the same logits; BF16: its activations rounded as ggml's)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import decoderlab as dl
from decoderlab import fastdecode, half, kernels
from decoderlab.attention import KVCache
from decoderlab.export import to_gguf
from decoderlab.generation import generate
from decoderlab.gguf import load_gguf
from decoderlab.half import HalfEmbedding, HalfLinear, half_dtype, use_half_weights

from tiny_models import FAMILIES

HALVES = (torch.float16, torch.bfloat16)


def _layer(dtype, bias=True, out=40, inp=64) -> HalfLinear:
    torch.manual_seed(0)
    layer = nn.Linear(inp, out, bias=bias)
    layer.weight.data = layer.weight.data.to(dtype)
    model = nn.Sequential(layer)
    use_half_weights(model)
    return model[0]


@pytest.mark.parametrize("dtype", HALVES)
def test_few_rows_take_the_kernels_product_and_many_rows_the_widened_weight(dtype):
    """(Many rows of a bfloat16 weight take the kernels' product too where they multiply bfloat16 pairs.)"""
    layer = _layer(dtype)
    assert type(layer) is HalfLinear and layer.weight.dtype == dtype and layer.bias.dtype == torch.float32
    w = layer.weight.float()
    with torch.no_grad():
        few = torch.randn(3, 64)
        assert torch.equal(layer(few), kernels.dense_linear(few, layer.weight) + layer.bias)
        many = torch.randn(2, 20, 64)  # 40 rows: over KERNEL_ROWS
        if dtype == torch.bfloat16 and kernels.isa() in kernels.BF16_PAIRS:  # bfloat16 pairs, in a row's own order
            assert torch.equal(layer(many), kernels.dense_linear(many, layer.weight) + layer.bias)
            assert torch.equal(layer(many)[1, 3], layer(many[1, 3:4])[0])  # a row's result is its own, alone
        else:
            torch.testing.assert_close(layer(many), F.linear(many, w, layer.bias), rtol=0, atol=1e-5)


def test_the_widened_slices_cover_a_matrix_larger_than_one_slice_and_carry_the_gradient(monkeypatch):
    monkeypatch.setattr(half, "_SLICE", 1 << 17)  # (a small matrix in slices: 128K weights at a time)
    layer = _layer(torch.bfloat16, bias=False, out=300, inp=512)  # 300 x 512: three slices of 256 rows
    x = torch.randn(5, 512, requires_grad=True)
    y = layer(x)  # a gradient asked: the widened slices, not the kernels
    want = F.linear(x.detach(), layer.weight.float())
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ layer.weight.float(), rtol=0, atol=1e-5)


def test_an_input_of_the_weight_s_own_dtype_is_plain_f_linear():
    layer = _layer(torch.float16).double()
    assert layer.weight.dtype == torch.float64
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_the_embedding_widens_its_rows_to_the_model_s_dtype_and_a_tied_output_shares_them():
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", **{**FAMILIES["llama-gqa"], "d_model": 64,
                                                                     "head_dim": 16, "d_ff": 128, "max_len": 24,
                                                                     "num_tokens": 67, "tie_weights": True}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.data = p.data.to(torch.bfloat16)
            else:
                p.data = p.data.to(torch.bfloat16)  # norms too: use_half_weights makes them float32 again
    made = use_half_weights(model)
    assert type(model.we) is HalfEmbedding and type(model.fc_layer) is HalfLinear and made > 3
    assert model.fc_layer.weight is model.we.weight and half_dtype(model) == torch.bfloat16
    assert model.norm_f.weight.dtype == torch.float32
    ids = torch.tensor([[1, 5, 7]])
    rows = model.we(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, model.we.weight[ids].float())
    assert model.double().we(ids).dtype == torch.float64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Qwen2-shaped model (grouped-query heads, q/k/v biases, a tied output layer) written as F16 and as
    BF16 GGUF files."""
    from support.gguf_files import byte_level_bpe

    from decoderlab.tokenizers import BPETokenizer

    root = tmp_path_factory.mktemp("half")
    torch.manual_seed(0)
    shape = {**FAMILIES["llama-gqa"], "d_model": 64, "head_dim": 16, "d_ff": 128, "max_len": 40, "num_tokens": 300,
             "qk_norm": False, "qk_norm_gain": False, "tie_weights": True}  # (Qwen2's shape: GGUF writes it)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    bpe = BPETokenizer(byte_level_bpe(300))
    out = {}
    for kind, dtype in (("f16", "float16"), ("bf16", "bfloat16")):
        out[kind] = root / f"{kind}.gguf"
        to_gguf(model, bpe, out[kind], dtype=dtype, modelfile=False)
    return out


def _greedy(model, fused: bool, monkeypatch) -> tuple[list[int], int]:
    """20 greedy tokens after a 5-token prompt, and how many steps took the fused path (none when not ``fused``)."""
    calls = {"n": 0}
    real = fastdecode.step

    def counted(*args):
        out = real(*args) if fused else None
        calls["n"] += out is not None
        return out

    monkeypatch.setattr(fastdecode, "step", counted)
    return generate(model, [3, 9, 4, 1, 7], 20, temperature=0), calls["n"]


@pytest.mark.skipif(kernels.load() == "portable", reason="the fused step needs the C++ kernels")
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_a_16_bit_file_decodes_through_the_fused_step_as_its_own_blocks_do(files, kind, monkeypatch):
    model, _, info = load_gguf(files[kind])
    assert half_dtype(model) == (torch.float16 if kind == "f16" else torch.bfloat16)
    assert fastdecode.why_not(model) is None
    fused, n = _greedy(model, True, monkeypatch)
    blocks, none = _greedy(model, False, monkeypatch)
    assert n >= 19 and none == 0 and fused == blocks
    if kind == "f16":  # float32 activations times exactly widened weights: the float32 reading's very logits
        floats, _, _ = load_gguf(files[kind], dtype="float32")
        assert _greedy(floats, True, monkeypatch)[0] == fused
        cache_a, cache_b = KVCache.for_model(model), KVCache.for_model(floats)
        with torch.no_grad():
            ids = torch.tensor([[3, 9, 4, 1, 7]])
            assert torch.equal(model(ids, cache=cache_a), floats(ids, cache=cache_b))
            step = torch.tensor([[11]])
            a = model.decode(step, cache_a.length, None, cache_a)
            b = floats.decode(step, cache_b.length, None, cache_b)
        assert torch.equal(a, b)


def test_lora_over_16_bit_matrices_trains_float32_adapters_and_merges_into_float32(files):
    """QLoRA's shape over a 16-bit base: the adapters float32 (PEFT would give them the base's dtype), the
    gradient through the widened slices, the merge a float32 model computing what the adapted one does."""
    from decoderlab.lora import apply_lora, merge_lora

    model, _, _ = load_gguf(files["bf16"])
    apply_lora(model, rank=4, init=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    model(ids).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    merged = merge_lora(model)
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    # the merge checked on float32 products: a bfloat16-pair kernel would round the adapted model's activations
    before = kernels.set_isa("avx512-vnni") if kernels.isa() in kernels.BF16_PAIRS else None
    try:
        with torch.no_grad():
            many = torch.randint(0, 300, (1, 24))  # 24 rows: the widened slices in both models
            torch.testing.assert_close(merged(many), model(many), rtol=0, atol=1e-4)
    finally:
        if before is not None:
            kernels.set_isa(before)
