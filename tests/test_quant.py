"""decoderlab.quant: GGUF's blocks (q8_0, q4_0, q4_1, q5_0, q5_1 quantized here; those and the K-quants read) --
quantized and dequantized exactly as ggml (gguf.quants, its reference in Python), read from a GGUF file as they are
(the kernels' packed bytes, no float copy), multiplied by the kernels' op at a few rows (eagerly and traced by
dynamo alike) and by dequantized slices at more, with a gradient for x, and put in place of a model's layers (the
output layer and a tied embedding sharing one weight)."""

import numpy as np
import pytest
import torch
from torch import nn
from tiny_models import one_thread  # noqa: F401 -- autouse

import decoderlab as dl
from decoderlab import kernels
from decoderlab.quant import (BLOCK_BYTES, BlockEmbedding, BlockLinear, BlockWeight, block_dtype, block_dtypes,
                              dequantized_state_dict, quantize_model, use_block_weights)

gguf = pytest.importorskip("gguf")
#: the types quantized here (gguf.quants quantizes them); the K-quants are only read
KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
K_KINDS = ("q4_k", "q5_k", "q6_k")
GGML = {k: gguf.GGMLQuantizationType[k.upper()] for k in (*KINDS, *K_KINDS)}


def _matrix(out=40, inp=128, seed=0) -> torch.Tensor:
    """Rows of very different scales, with the cases a quantizer must get right: a block of zeros, a block whose
    largest magnitude is negative, values exactly halfway between two steps, one tiny value."""
    torch.manual_seed(seed)
    w = torch.randn(out, inp) * torch.logspace(-3, 1, out)[:, None]
    w[0, :32] = 0.0
    w[1, :32] = torch.linspace(-2.0, 1.0, 32)
    w[2, :32] = torch.arange(32) * 0.5 - 8.0
    w[3, 5] = 1e-30
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_and_dequantize_are_ggmls_bit_for_bit(kind):
    """Our quantizer writes the bytes gguf.quants.quantize writes (llama.cpp's reference quantizers), and our
    dequantization gives gguf.quants.dequantize's float32 values exactly, from our bytes and from theirs."""
    w = _matrix()
    theirs = gguf.quants.quantize(w.numpy(), GGML[kind])
    ours = BlockWeight.quantize(w, kind)
    assert np.array_equal(ours.to_gguf(), theirs)
    assert theirs.nbytes == w.numel() // 32 * BLOCK_BYTES[kind]
    assert ours.nbytes == 48 * 128 // 32 * BLOCK_BYTES[kind]  # 40 rows and 8 zero rows: groups of 16
    want = gguf.quants.dequantize(theirs, GGML[kind])
    assert np.array_equal(ours.dequantize().numpy(), want)
    read = BlockWeight.from_gguf(theirs, GGML[kind], w.shape)
    assert np.array_equal(read.dequantize().numpy(), want)
    assert np.array_equal(read.to_gguf(), theirs)  # from_gguf and to_gguf are inverses
    # the error is what the format allows: half a step (q8_0, q4_1), a step at q4_0's far edge; plus the float16
    # rounding of the scale (2^-11 of up to 127 steps; float16's subnormal spacing 2^-24 for a tiny one) and of
    # q4_1's minimum
    err = (ours.dequantize() - w).abs().reshape(-1, 32).amax(-1)
    blocks = torch.from_numpy(theirs.reshape(-1, BLOCK_BYTES[kind]))
    step = blocks[:, 0:2].contiguous().view(torch.float16).float().abs().reshape(-1)  # (q4_0's d has a sign)
    m = kind in ("q4_1", "q5_1")
    low = blocks[:, 2:4].contiguous().view(torch.float16).float().abs().reshape(-1) * 2**-10 if m else 0
    assert bool((err <= step * (1.0 if kind in ("q4_0", "q5_0") else 0.5) * 1.13 + low + 127 * 2**-24).all())


@pytest.mark.parametrize("kind", K_KINDS)
def test_k_quants_are_read_and_dequantized_as_ggml_does_and_not_quantized(kind):
    """A K-quant's blocks (random valid ones: gguf.quants has no quantizer for them) are held as they are -- the
    file's bytes back, as many -- and dequantize to gguf.quants.dequantize's float32 values exactly; quantizing a
    float matrix to a K-quant is refused by name."""
    from support.gguf_files import k_quant

    raw = k_quant(gguf, 21, 512, GGML[kind])
    w = BlockWeight.from_gguf(raw, GGML[kind], (21, 512))
    assert w.kind == kind and w.shape == (21, 512) and np.array_equal(w.to_gguf(), raw)
    assert w.nbytes == 32 * 2 * BLOCK_BYTES[kind]  # 21 rows padded to 2 groups of 16 with zero rows
    assert np.array_equal(w.dequantize().numpy(), gguf.quants.dequantize(raw, GGML[kind]))
    assert torch.equal(w.rows(slice(3, 9)).dequantize(), w.dequantize()[3:9])
    with pytest.raises(ValueError, match=f"{kind} cannot be quantized to here .* allowed: q8_0, q4_0, q4_1, q5_0, "
                                         f"q5_1"):
        BlockWeight.quantize(torch.zeros(4, 256), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_files_tensor_becomes_a_weight_without_a_float_copy(kind, tmp_path):
    """A tensor written to a GGUF file and read back with gguf.GGUFReader: from_gguf takes its bytes (a memmap) and
    its (in, out) shape reversed, and holds exactly the file's bytes for it, in integer and float16 planes."""
    w = _matrix(48, 96)
    raw = gguf.quants.quantize(w.numpy(), GGML[kind])
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gpt2")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=GGML[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (t,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
    bw = BlockWeight.from_gguf(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())))
    assert bw.kind == kind and bw.shape == (48, 96) and bw.nbytes == t.data.nbytes
    assert bw.packed.dtype == torch.uint8 and bw.packed.dim() == 1
    assert np.array_equal(bw.dequantize().numpy(), gguf.quants.dequantize(raw, GGML[kind]))


def test_bad_blocks_are_refused_naming_what_was_given():
    raw = gguf.quants.quantize(_matrix(4, 64).numpy(), GGML["q8_0"])
    with pytest.raises(ValueError, match=r"block type 'Q2_K' is not one decoderlab keeps quantized; allowed: q8_0, "
                                         r"q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k"):
        BlockWeight.from_gguf(raw, gguf.GGMLQuantizationType.Q2_K, (4, 64))
    with pytest.raises(ValueError, match=r"a q8_0 matrix of shape \(4, 64\) is 272 bytes; got 136"):
        BlockWeight.from_gguf(raw[:2], "q8_0", (4, 64))
    with pytest.raises(ValueError, match=r"width \(inputs\) to be a positive multiple of 32, the type's block size; "
                                         r"got shape \(4, 48\)"):
        BlockWeight.from_gguf(raw, "q8_0", (4, 48))
    with pytest.raises(ValueError, match=r"in is a multiple of 32; got shape \(4, 40\)"):
        BlockWeight.quantize(torch.zeros(4, 40), "q4_1")
    with pytest.raises(ValueError, match="one block type and one width"):
        BlockWeight.cat([BlockWeight.quantize(torch.zeros(2, 32), "q8_0"),
                         BlockWeight.quantize(torch.zeros(2, 32), "q4_0")])


def test_rows_move_whole_and_exactly():
    """A fused projection's parts and a permutation of its rows (a GGUF loader's q, k, v into one qkv, a rope layout)
    select the same rows of the dequantized matrix."""
    w = BlockWeight.quantize(_matrix(12, 64), "q4_1")
    full = w.dequantize()
    perm = torch.randperm(12)
    assert torch.equal(w.rows(perm).dequantize(), full[perm])
    parts = [w.rows(slice(0, 4)), w.rows(slice(4, 12))]
    assert torch.equal(BlockWeight.cat(parts).dequantize(), full)


def _layer(kind: str, bias: bool, out: int = 24, inp: int = 256) -> BlockLinear:
    if kind in K_KINDS:
        from support.gguf_files import k_quant

        weight = BlockWeight.from_gguf(k_quant(gguf, out, inp, GGML[kind]), kind, (out, inp))
    else:
        weight = BlockWeight.quantize(_matrix(out, inp), kind)
    return BlockLinear(weight, torch.randn(out) if bias else None)


@pytest.mark.parametrize("kind", (*KINDS, *K_KINDS))
@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (2, 4), (), (3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_block_product_is_the_kernels_op_and_in_float64_the_dequantized_weights(kind, rows, bias):
    """Float32 rows on the CPU are the kernels' op (activations quantized to 8-bit blocks: tests/kernels hold it to
    float64 exactly), the same bits eagerly and traced by dynamo (what Inductor compiles), within the activations'
    8-bit rounding of the float product; float64 rows (a reference) are x W^T + b of the dequantized weight."""
    torch.manual_seed(1)
    layer = _layer(kind, bias)
    x = torch.randn(*rows, 256)
    want = torch.nn.functional.linear(x.double(), layer.dequantize().double(),
                                      None if layer.bias is None else layer.bias.double())
    got = layer(x)
    assert got.shape == (*rows, 24) and got.dtype == torch.float32
    scale = float(want.abs().max())
    op = kernels.block_linear(x, layer.packed[0], kind, 24)
    assert torch.equal(got, op if layer.bias is None else op + layer.bias)
    torch._dynamo.reset()
    traced = torch.compile(layer, backend="eager", fullgraph=True)(x)
    assert torch.equal(traced, got)
    assert torch.allclose(got.double(), want, rtol=0, atol=0.05 * scale)
    layer.double()
    assert torch.allclose(layer(x.double()), want, rtol=1e-12, atol=1e-12 * scale)


@pytest.mark.parametrize("rows", [(2,), (3, 7)])
def test_gradients_reach_x_through_a_frozen_block_layer(rows):
    """LoRA trains over a frozen block layer: grad_x = grad_y @ W with W dequantized (the kernels' op inside an
    autograd.Function); the weight takes no gradient."""
    layer = _layer("q4_k", bias=True)
    x = torch.randn(*rows, 256, requires_grad=True)
    grad = torch.randn(*rows, 24)
    layer(x).backward(grad)
    assert torch.allclose(x.grad, grad @ layer.dequantize(), atol=1e-5)
    assert not any(p.requires_grad for p in layer.parameters())



def test_the_gradient_through_stacked_weights_of_many_slices_is_the_dequantized_products():
    """The backward dequantizes ~128k weights at a time (512 rows of 256 here): q8_0 (1040 rows: three slices, the
    last short) stacked on q4_1 (16 rows) gives x the float64 product with the whole dequantized weight."""
    torch.manual_seed(0)
    layer = BlockLinear([BlockWeight.quantize(torch.randn(1040, 256), "q8_0"),
                         BlockWeight.quantize(torch.randn(16, 256), "q4_1")])
    x = torch.randn(3, 5, 256, requires_grad=True)
    grad = torch.randn(3, 5, 1056)
    layer(x).backward(grad)
    want = (grad.double() @ layer.dequantize().double()).float()
    torch.testing.assert_close(x.grad, want, atol=1e-4, rtol=1e-5)


def test_a_layer_of_stacked_weights_of_different_types_is_one_product():
    """q | k | v of a K-quant file (q5_0, q5_0, q8_0): one layer, one call of block_linear_many at a few rows, each
    part's output the single op's, and in float64 the product of the stacked dequantized weights."""
    parts = [BlockWeight.quantize(_matrix(16, 64, seed=s), k) for s, k in enumerate(("q5_0", "q5_0", "q8_0"))]
    layer = BlockLinear(parts)
    assert layer.kinds == ("q5_0", "q5_0", "q8_0") and layer.out_features == 48
    x = torch.randn(2, 64)
    want = torch.cat([kernels.block_linear(x, p.packed, p.kind, 16) for p in parts], dim=-1)
    assert torch.equal(layer(x), want)
    many = torch.randn(20, 64, dtype=torch.float64)
    assert torch.allclose(layer.double()(many), many @ layer.dequantize(torch.float64).T, atol=1e-12)
    with pytest.raises(ValueError, match="one block type and one width"):
        layer.blocks


def _model(tie: bool = True, d_model: int = 32) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=50, d_model=d_model, n_layer=2, n_head=2, max_len=16,
                                               tie_weights=tie)).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_every_linear_layer_and_the_output_layer_are_quantized_a_tied_embedding_with_them(tie):
    """quantize_model walks the nn.Linear layers (not names): every one becomes a BlockLinear, the output layer
    included; a tied word embedding reads the output layer's blocks (one set of planes, after .to() too); an untied
    one stays float. The model's logits are those of the float model holding the dequantized weights."""
    model = _model(tie)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    quantize_model(model, "q8_0")
    assert sum(type(m) is BlockLinear for m in model.modules()) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules()) and block_dtype(model) == "q8_0"
    assert isinstance(model.we, BlockEmbedding) is tie
    if tie:
        assert model.we.packed_0 is model.fc_layer.packed_0
    model = model.to("cpu").double().float()  # conversions move the packed bytes and never recast them
    assert model.fc_layer.packed_0.dtype == torch.uint8 and model.blocks[0].mlp.fc.packed_0.dtype == torch.uint8
    if tie:
        assert model.we.packed_0 is model.fc_layer.packed_0
    state = dequantized_state_dict(model)
    assert not any(".packed_" in k for k in state)
    plain = _model(tie)
    plain.load_state_dict(state)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.allclose(model(ids), plain(ids), atol=0.05)  # the kernels' 8-bit activations
    assert torch.allclose(model.double()(ids), plain.double()(ids), atol=1e-9)  # the dequantized weights


def test_a_width_that_is_not_whole_blocks_is_refused_naming_the_layer():
    model = _model(d_model=24)
    with pytest.raises(ValueError, match=r"--dtype q4_0: layer blocks\.0\.attention\.qkv has 24 inputs, not a "
                                         r"multiple of 32"):
        quantize_model(model, "q4_0")
    assert not any(isinstance(m, BlockLinear) for m in model.modules())  # nothing was changed


@pytest.mark.parametrize("kind", KINDS)
def test_a_q4_1_gguf_model_loaded_at_its_type_holds_at_most_1_3x_the_files_bytes(kind, tmp_path):
    """A model whose linear layers and (tied) embedding come from a GGUF file's blocks (use_block_weights, the GGUF
    loader's path): its tensors hold at most 1.3x the bytes of the file (no float copy is made on the way),
    and its logits are the float model's with the dequantized weights."""
    model = _model()
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    names = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "fc_layer"} | {"we": model.we}
    for name, mod in names.items():
        raw = gguf.quants.quantize(mod.weight.detach().numpy(), GGML[kind])
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGML[kind])
    for name, p in model.state_dict().items():  # norms, biases, positions: float32 as llama.cpp keeps them
        if name not in {f"{n}.weight" for n in names} | {"fc_layer.weight"}:
            writer.add_tensor(name, p.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    blocks = {t.name: BlockWeight.from_gguf(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())))
              for t in reader.tensors if t.name in names}
    floats = {t.name: torch.from_numpy(np.array(t.data)).reshape(tuple(reversed(t.shape.tolist())))
              for t in reader.tensors if t.name not in names}
    with torch.device("meta"):
        loaded = dl.DecoderOnlyTransformer(model.config)
    use_block_weights(loaded, blocks)
    loaded.load_state_dict(floats, strict=False, assign=True)
    assert not [n for n, t in loaded.state_dict().items() if t.is_meta]
    held = {t.data_ptr(): t.numel() * t.element_size() for t in loaded.state_dict().values()}
    assert sum(held.values()) <= 1.3 * path.stat().st_size
    assert loaded.fc_layer.packed_0 is loaded.we.packed_0
    plain = _model()
    plain.load_state_dict(dequantized_state_dict(loaded))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.allclose(loaded.eval()(ids), plain(ids), atol=0.05)  # the kernels' 8-bit activations
    assert torch.allclose(loaded.double()(ids), plain.double()(ids), atol=1e-9)  # the dequantized weights
    with pytest.raises(ValueError, match=r"block weight for blocks\.0\.mlp\.fc has shape \(50, 32\), the layer "
                                         r"\(128, 32\)"):
        use_block_weights(loaded, {"blocks.0.mlp.fc": blocks["we"]})
    with pytest.raises(ValueError, match=r"the model has no layer 'nope' for a block weight"):
        use_block_weights(loaded, {"nope": blocks["we"]})


@pytest.mark.slow
def test_the_inductor_step_decodes_eagers_tokens_at_each_block_dtype():
    """The real compiled step (Inductor, its C++ wrapper: compile_decode() on a CPU) over block weights of every
    type at once -- each layer its own, as a GGUF file mixes them (Q4_K_M) -- : greedy and seeded sampled tokens
    equal the eager ones (dequantize, F.linear), over a window that slides, batch 1 and a left-padded batch of 3
    (each block read once for all rows). Two graphs compile (one model for the five types: a model per type
    compiled ten graphs, ~3 minutes of a loaded 2-core machine)."""
    from decoderlab.generation import generate, generate_batch

    torch.manual_seed(3)
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=61, d_model=32, n_layer=2, n_head=2, max_len=12))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # logits far from uniform: greedy paths that vary
    model.eval()
    parts = (model.blocks[0].attention, model.blocks[0].mlp, model.blocks[1].attention, model.blocks[1].mlp, model)
    for part, kind in zip(parts, KINDS):  # the last: the tied output layer and word embedding
        quantize_model(part, kind)
    assert sorted(block_dtypes(model)) == sorted(KINDS)
    sampled = dict(temperature=0.8, top_k=5, seed=1)

    def run():
        return [generate(model, [1], 30, temperature=0), generate(model, [1, 2], 30, **sampled),
                generate_batch(model, [[1], [1, 2, 3], [2, 2]], 30, temperature=0)]

    want = run()
    torch._dynamo.reset()
    try:
        model.compile_decode()
        assert run() == want
    finally:
        model.compiled_decode = None
        torch._dynamo.reset()
