"""decoderlab.matvec.linear: the decode step's weight products as reductions inside a compiled graph, ``layer(x)``
everywhere else. Compiled with the "eager" backend, which traces exactly what Inductor would compile (so the
reduction runs) without a C++ compiler; Inductor itself is exercised by the compiled and AOT decode tests."""

import pytest
import torch
from torch import nn

from decoderlab.matvec import MAX_ROWS, linear


def _layer(d_in, d_out, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out, bias=bias).to(dtype)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


@pytest.mark.parametrize("shape", [(1, 1, 24), (3, 1, 24), (2, 8, 24), (24,)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_reduction_equals_f_linear_in_float64(shape, bias):
    """Rows from 1 to MAX_ROWS (and an unbatched vector): the traced reduction gives F.linear's product, checked
    against float64."""
    layer = _layer(24, 40, bias)
    x = torch.randn(shape)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                     None if layer.bias is None else layer.bias.double())
    got = _compiled(lambda t: linear(layer, t))(x)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_reduction_is_taken_in_a_traced_graph_and_only_there(monkeypatch):
    """Eagerly linear is the module's own call; traced, a plain nn.Linear on few rows takes the reduction (seen as
    no call to the module's forward), many rows and other modules keep the module's call."""
    calls = []
    orig = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: (calls.append(x.shape[:-1].numel()), orig(self, x))[1])
    layer = _layer(8, 8)
    linear(layer, torch.randn(1, 1, 8))
    assert calls == [1]  # eager: the module
    calls.clear()
    _compiled(lambda t: linear(layer, t))(torch.randn(1, 1, 8))
    assert calls == []  # traced, one row: the reduction
    _compiled(lambda t: linear(layer, t))(torch.randn(MAX_ROWS + 1, 1, 8))
    assert calls == [MAX_ROWS + 1]  # traced, many rows: the module (a GEMM)


def test_a_module_that_is_not_a_plain_linear_keeps_its_own_call():
    """A subclass (as PEFT's and other wrappers are) is called, not taken apart: its forward may differ."""

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer = Doubled(8, 4)
    x = torch.randn(1, 1, 8)
    assert torch.allclose(_compiled(lambda t: linear(layer, t))(x), layer(x))


def test_half_precision_weights_take_the_reduction_up_to_their_own_row_limit(monkeypatch):
    """bfloat16 weights: the reduction up to MAX_ROWS_HALF rows, F.linear above (its half-precision GEMM wins
    sooner than float32's)."""
    from decoderlab.matvec import MAX_ROWS_HALF

    calls = []
    orig = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: (calls.append(x.shape[:-1].numel()), orig(self, x))[1])
    layer = _layer(8, 8, dtype=torch.bfloat16)
    for rows in (MAX_ROWS_HALF, MAX_ROWS_HALF + 1):
        _compiled(lambda t: linear(layer, t))(torch.randn(rows, 1, 8, dtype=torch.bfloat16))
    assert MAX_ROWS_HALF < MAX_ROWS and calls == [MAX_ROWS_HALF + 1]


def test_bfloat16_weights_accumulate_to_f_linears_precision():
    """Half-precision weights: the result is bfloat16, within bfloat16 rounding of the float64 product."""
    layer = _layer(64, 32, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    got = _compiled(lambda t: linear(layer, t))(x)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), ref, atol=2e-2, rtol=2e-2)


def test_a_wrong_width_raises_as_the_module_does():
    layer = _layer(8, 4)
    with pytest.raises(RuntimeError):
        linear(layer, torch.randn(1, 1, 7))


def test_a_symbolic_row_count_keeps_the_gemm_and_adds_no_guard():
    """Compiled for dynamic batch sizes (the server's compiled step), the row count is symbolic: it is not
    compared with MAX_ROWS (a comparison would guard on it and recompile for every batch size across the line),
    so batch sizes from 2 to 4 x MAX_ROWS share one graph -- the exact batch of one, specialised by torch, another."""
    import torch._dynamo

    layer = _layer(8, 4)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(lambda t: linear(layer, t), backend="eager", fullgraph=True, dynamic=True)
    for b in (1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 4 * MAX_ROWS, 5):
        x = torch.randn(b, 1, 8)
        assert torch.allclose(f(x), layer(x), atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    torch._dynamo.reset()


def test_a_tensor_subclass_weight_keeps_its_own_product_when_compiled(monkeypatch):
    """A weight that is a tensor subclass (torchao's quantized tensors are; here torch's own TwoTensor test
    subclass) is never taken apart into the reduction: traced, the layer's own forward runs and gives its product."""
    from torch.testing._internal.two_tensor import TwoTensor

    calls = []
    orig = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: (calls.append(1), orig(self, x))[1])
    layer = _layer(8, 4)
    w = layer.weight.detach()
    layer.weight = nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)
    x = torch.randn(1, 1, 8)
    want = torch.nn.functional.linear(x, w, layer.bias)
    got = _compiled(lambda t: linear(layer, t))(x)
    assert calls == [1] and torch.allclose(got.a if isinstance(got, TwoTensor) else got, want, atol=1e-6)
    torch._dynamo.reset()
