"""The ops on every path this CPU runs (each instruction set built here, and the portable torch path): each block
product equals float64(gguf.quants' dequantized W) @ float64(the dequantized quantized x) within the float32
bound of ggml_reference.reference; the activation bytes equal ggml's; the 16/32-bit products equal float64's to
their float32 accumulation; 1 and 2 threads give the same bits; widths that are not whole blocks are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoderlab import kernels

from ggml_reference import U, activation_bytes, dequantized, reference, weight

BLOCK_TYPES = kernels.WEIGHT_BLOCK_TYPES
#: activation row counts: every tile width (1-4), their remainders, and the 16 a step takes at most
ROWS = (1, 2, 3, 5, 8, 16)


def paths() -> list[str]:
    return kernels.available_isas()


@pytest.fixture(scope="module", params=paths())
def path(request):
    return request.param


def _x(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    x[0, :256 if k % 256 == 0 else 32] = 0  # an all-zero block (d = 0)
    return x


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_product_equals_float64_of_the_dequantized_factors(name, path):
    rng = np.random.default_rng(sum(map(ord, name)))
    block = kernels.TYPES[name].block
    for out, inp in ((40, 3 * block), (16, 2 * block)):  # 40 rows: two whole groups of 16 and a padded one
        raw = weight(name, out, inp, rng)
        packed = kernels.pack(raw, name, (out, inp))
        x = _x(max(ROWS), inp, out + inp)
        y = torch.cat([kernels.block_linear(x[:n], packed, name, out, isa=path) for n in ROWS])
        want, bound = reference(name, raw, np.concatenate([x[:n].numpy() for n in ROWS]))
        err = np.abs(y.double().numpy() - want)
        assert y.dtype == torch.float32 and y.shape == (sum(ROWS), out)
        assert (err <= bound).all(), f"{name} {path} ({out}, {inp}): worst error / bound {(err / bound).max():.2f}"


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_the_bound_sees_an_unquantized_activation(name):
    """The bound is tight enough to tell the quantized product from float64's of the unquantized x: a product
    that skipped ggml's activation quantization would fail the test above."""
    rng = np.random.default_rng(1)
    block = kernels.TYPES[name].block
    raw = weight(name, 16, 2 * block, rng)
    x = _x(4, 2 * block, 2).numpy()
    want, bound = reference(name, raw, x)
    unquantized = x.astype(np.float64) @ dequantized(name, raw).T
    assert (np.abs(unquantized - want) > bound).mean() > 0.9


@pytest.mark.parametrize("kind", kernels.ACTIVATION_TYPES)
def test_activation_bytes_are_ggmls(kind, path):
    x = _x(5, 512, 3)
    x[1, 40] = -x[1, 32:64].abs().max() * 1.5  # a negative value of largest magnitude
    got = kernels.quantize_activation(x, kind, isa=path)
    assert got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), activation_bytes(x.numpy(), kind))


def test_activation_ties_round_to_even_as_ggmls_x86_backend(path):
    """amax = 127 makes the scale exactly 1: 2.5, -3.5, 0.5 round to 2, -4, 0 (ggml's x86 quantize_row_q8_0 rounds
    half to even; the reference quantize_row_q8_0_ref, gguf.quants' Q8_0, would give 3, -4, 1)."""
    x = torch.zeros(1, 256)
    x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    q8_0 = kernels.quantize_activation(x, "q8_0", isa=path)[0, :6].numpy()
    assert q8_0[2:].view(np.int8).tolist() == [127, 2, -4, 0]
    x[0, 0] = -127.0  # q8_k scales by -127 / (the value of largest magnitude) = 1
    q8_k = kernels.quantize_activation(x, "q8_k", isa=path)[0, 4:8].numpy()
    assert q8_k.view(np.int8).tolist() == [-127, 2, -4, 0]


def _dense_reference(x: torch.Tensor, w: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 of x @ W.T -- x rounded to bfloat16 first for a bfloat16 weight, as ggml does -- and the float32
    accumulation's bound: the C++ lanes hold in / 8 terms each, then the lanes' sum; MKL's order (portable) is not
    ours to know."""
    xs = (x.bfloat16() if w.dtype == torch.bfloat16 else x).double()
    sequential = path == "portable" or path == "amx-bf16" and w.dtype == torch.bfloat16  # (AMX: one sum an output)
    terms = x.shape[-1] + 4 if sequential else x.shape[-1] // 8 + 20
    return xs @ w.double().T, terms * U * (xs.abs() @ w.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_product_equals_float64_to_float32_accumulation(dtype, path):
    g = torch.Generator().manual_seed(5)
    for out, inp in ((37, 100), (64, 576)):  # a width that is no multiple of the vector's (a tail) and one that is
        w = torch.randn(out, inp, generator=g).to(dtype)
        x = _x(max(ROWS), inp, inp)
        y = torch.cat([kernels.dense_linear(x[:n], w, isa=path) for n in ROWS])
        want, bound = _dense_reference(torch.cat([x[:n] for n in ROWS]), w, path)
        assert ((y.double() - want).abs() <= bound).all(), (dtype, path, out, inp)


def test_the_dense_bound_sees_an_unrounded_activation():
    """A bfloat16 weight's product with x not rounded to bfloat16 lies outside the bound above: the test tells
    ggml's arithmetic (x rounded) from float32's."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 576, generator=g).bfloat16()
    x = _x(4, 576, 6)
    want, bound = _dense_reference(x, w, "avx2")
    assert ((x.double() @ w.double().T - want).abs() > bound).float().mean() > 0.9


@pytest.mark.parametrize("name", [*BLOCK_TYPES, "f32", "f16", "bf16"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(name, path):
    """19 rows take every tile of the kernels (8 + 8 + 2 + 1 for a 32-weight block, 4 x 4 + 3 for a dense
    weight), 300 their blocks of a prompt's rows (256 and 64): each row's product is bit for bit that row's alone or
    in another batch -- a batch decodes as its sequences would one by one. (The portable path's dense product is
    torch's F.linear, whose order may follow the batch: not claimed.)"""
    if path == "portable" and name in kernels.FLOAT_TYPES.values():
        pytest.skip("the portable dense product is F.linear's, not batch-invariant")
    rng = np.random.default_rng(11)
    block = kernels.TYPES[name].block
    out, inp = 46, 2 * max(block, 256 if name in kernels.FLOAT_TYPES.values() else block)  # 46: rows 4 and 1 at a time
    x = _x(300, inp, 11)
    if name in kernels.FLOAT_TYPES.values():
        w = torch.from_numpy(rng.standard_normal((out, inp)).astype(np.float32)).to(_DTYPES[name])
        run = lambda rows: kernels.dense_linear(rows, w, isa=path)  # noqa: E731
    else:
        packed = kernels.pack(weight(name, out, inp, rng), name, (out, inp))
        run = lambda rows: kernels.block_linear(rows, packed, name, out, isa=path)  # noqa: E731
    together = run(x)
    apart = torch.cat([run(x[i:i + 1]) for i in range(19)] + [run(x[i:i + 37]) for i in range(19, len(x), 37)])
    assert torch.equal(together, apart)


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _many_weights(rng, kinds, inp):
    """(packed or dense weights, their kinds, their out_features) of several types sharing one input width."""
    outs = [40, 16, 24][:len(kinds)]  # 40 and 24: a group padded to 16 rows
    ws = []
    for kind, out in zip(kinds, outs):
        if kind in _DTYPES:
            ws.append(torch.from_numpy(rng.standard_normal((out, inp)).astype(np.float32)).to(_DTYPES[kind]))
        else:
            ws.append(kernels.pack(weight(kind, out, inp, rng), kind, (out, inp)))
    return ws, outs


@pytest.mark.parametrize("kinds", [("q4_1", "q4_1", "q4_1"), ("q5_0", "q8_0", "q6_k"), ("q4_k", "q8_0"),
                                   ("q6_k", "q5_k")])
def test_block_linear_many_is_each_single_product(kinds, path):
    """q, k and v in one call (a Q4_K_M file mixes q5_0, q8_0 and q6_k among them): each output is the single
    op's bit for bit, the activations quantized once per activation type."""
    rng = np.random.default_rng(12)
    inp = 512
    ws, outs = _many_weights(rng, kinds, inp)
    x = _x(5, inp, 12).reshape(5, 1, inp)
    ys = kernels.block_linear_many(x, ws, kinds, outs, isa=path)
    assert len(ys) == len(kinds)
    for y, w, kind, out in zip(ys, ws, kinds, outs):
        assert y.shape == (5, 1, out) and torch.equal(y, kernels.block_linear(x, w, kind, out, isa=path))


@pytest.mark.parametrize("kinds", [("bf16", "bf16"), ("f32", "f16", "bf16")])
def test_dense_linear_many_is_each_single_product(kinds, path):
    rng = np.random.default_rng(13)
    ws, outs = _many_weights(rng, kinds, 100)
    x = _x(3, 100, 13)
    ys = kernels.dense_linear_many(x, ws, isa=path)
    for y, w in zip(ys, ws):
        assert torch.equal(y, kernels.dense_linear(x, w, isa=path))


def test_many_refuses_unequal_lists_and_names_the_counts(path):
    rng = np.random.default_rng(14)
    ws, outs = _many_weights(rng, ("q8_0", "q8_0"), 64)
    with pytest.raises(ValueError, match="2 weights, 1 types, 2 out_features"):
        kernels.block_linear_many(torch.randn(1, 64), ws, ["q8_0"], outs, isa=path)
    with pytest.raises(ValueError, match="multiple of .*256"):
        kernels.block_linear_many(torch.randn(1, 64), ws, ["q8_0", "q6_k"], outs, isa=path)


def test_bfloat16_rounding_of_the_activations_is_torchs(path):
    """A bfloat16 weight of the identity's rows picks out x rounded to bfloat16: to nearest, ties to even, as
    torch's (and ggml's) conversion; values at a tie and just past it included."""
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, 3e38, -0.0, 1e-40])
    x = torch.cat([ties, torch.randn(64 - len(ties))]).reshape(1, 64)
    y = kernels.dense_linear(x, torch.eye(64).bfloat16(), isa=path)
    assert torch.equal(y, x.bfloat16().float()) or path in kernels.BF16_PAIRS  # both flush 1e-40 to zero
    assert torch.equal(y[0, :6], x[0, :6].bfloat16().float())


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f32", "bf16", "many", "dense many"])
def test_one_and_two_threads_give_the_same_bits(name):
    rng = np.random.default_rng(7)
    out, inp = 256, 512
    x = _x(3, inp, 7)
    if name in _DTYPES:
        w = torch.from_numpy(rng.standard_normal((out, inp)).astype(np.float32)).to(_DTYPES[name])
        run = lambda: kernels.dense_linear(x, w)  # noqa: E731
    elif name == "dense many":
        ws, _ = _many_weights(rng, ("bf16", "f32", "f16"), inp)
        run = lambda: torch.cat(kernels.dense_linear_many(x, ws), -1)  # noqa: E731
    elif name == "many":
        kinds = ("q5_0", "q6_k", "q8_0")
        ws, outs = _many_weights(rng, kinds, inp)
        run = lambda: torch.cat(kernels.block_linear_many(x, ws, kinds, outs), -1)  # noqa: E731
    else:
        packed = kernels.pack(weight(name, out, inp, rng), name, (out, inp))
        run = lambda: kernels.block_linear(x, packed, name, out)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_leading_dimensions_are_kept():
    rng = np.random.default_rng(8)
    packed = kernels.pack(weight("q4_0", 16, 64, rng), "q4_0", (16, 64))
    x = torch.randn(2, 3, 64)
    y = kernels.block_linear(x, packed, "q4_0", 16)
    assert y.shape == (2, 3, 16)
    assert torch.equal(y[1], kernels.block_linear(x[1], packed, "q4_0", 16))


@pytest.mark.parametrize("name", ["q8_0", "q6_k"])
def test_a_width_that_is_not_whole_blocks_is_refused(name, path):
    block = kernels.TYPES[name].block
    with pytest.raises(ValueError, match=rf"blk\.3\.ffn_down\.weight.*{block}.*\(16, {block + 16}\)"):
        kernels.pack(np.zeros(4096, np.uint8), name, (16, block + 16), name="blk.3.ffn_down.weight")
    packed = kernels.pack(weight(name, 16, block, np.random.default_rng(0)), name, (16, block))
    with pytest.raises(ValueError, match=str(block)):
        kernels.block_linear(torch.randn(2, block // 2), packed, name, 16, isa=path)
    with pytest.raises(ValueError, match="bytes|packed"):
        kernels.block_linear(torch.randn(2, 2 * block), packed, name, 16, isa=path)


def test_a_path_the_cpu_lacks_is_refused_naming_those_it_runs():
    with pytest.raises(ValueError, match="portable|runs"):
        kernels.set_isa("sse9")
    assert kernels.isa() in kernels.available_isas()


def test_the_ops_trace_under_the_fake_tensor_checks():
    """torch.library.opcheck: the schemas, and the fake implementations that torch.compile / torch.export use."""
    rng = np.random.default_rng(9)
    packed = kernels.pack(weight("q4_1", 32, 64, rng), "q4_1", (32, 64))
    other = kernels.pack(weight("q8_0", 16, 64, rng), "q8_0", (16, 64))
    x = torch.randn(3, 64)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.decoderlab.block_linear.default, (x, packed, 3, 32), test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.block_linear_many.default, (x, [packed, other], [3, 8], [32, 16]),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.dense_linear.default, (x, torch.randn(5, 64).bfloat16()),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.dense_linear_many.default,
                          (x, [torch.randn(5, 64).bfloat16(), torch.randn(7, 64)]), test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.quantize_activation.default, (x, 9), test_utils=checks)


def test_a_compiled_graph_calls_the_op():
    rng = np.random.default_rng(10)
    packed = kernels.pack(weight("q8_0", 32, 64, rng), "q8_0", (32, 64))
    kernels.load()

    def step(x):
        q, k = torch.ops.decoderlab.block_linear_many(x, [packed, packed], [8, 8], [32, 32])
        return torch.ops.decoderlab.block_linear(torch.relu(x), packed, 8, 32) * 2 + q - k

    x = torch.randn(2, 64)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))
