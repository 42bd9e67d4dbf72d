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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_product_equals_float64_to_float32_accumulation(dtype, path):
    g = torch.Generator().manual_seed(5)
    for out, inp in ((37, 100), (64, 576)):  # a width that is no multiple of the vector's (a tail) and one that is
        w = torch.randn(out, inp, generator=g).to(dtype)
        x = _x(max(ROWS), inp, inp)
        y = torch.cat([kernels.dense_linear(x[:n], w, isa=path) for n in ROWS])
        xs = torch.cat([x[:n] for n in ROWS]).double()
        want = xs @ w.double().T
        # the C++ lanes: in / 8 terms each, then the lanes' sum; MKL's order (portable) is not ours to know
        terms = inp + 4 if path == "portable" else inp // 8 + 20
        bound = terms * U * (xs.abs() @ w.double().abs().T)
        assert ((y.double() - want).abs() <= bound).all(), (dtype, path, out, inp)


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f32"])
def test_one_and_two_threads_give_the_same_bits(name):
    rng = np.random.default_rng(7)
    out, inp = 256, 512
    x = _x(3, inp, 7)
    if name == "f32":
        w = torch.from_numpy(rng.standard_normal((out, inp)).astype(np.float32))
        run = lambda: kernels.dense_linear(x, w)  # noqa: E731
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
    x = torch.randn(3, 64)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.decoderlab.block_linear.default, (x, packed, 3, 32), test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.dense_linear.default, (x, torch.randn(5, 64).bfloat16()),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.decoderlab.quantize_activation.default, (x, 9), test_utils=checks)


def test_a_compiled_graph_calls_the_op():
    rng = np.random.default_rng(10)
    packed = kernels.pack(weight("q8_0", 32, 64, rng), "q8_0", (32, 64))
    kernels.load()

    def step(x):
        return torch.ops.decoderlab.block_linear(torch.relu(x), packed, 8, 32) * 2

    x = torch.randn(2, 64)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))
