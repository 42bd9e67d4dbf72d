"""A linear layer on a few rows -- the decode step's matrix-vector products -- written so that a compiler
streams the weight once.

At batch 1 a decode step is its weight products: every ``nn.Linear`` multiplies one row by a matrix it must read
whole from memory, so the step can go no faster than the weights stream. PyTorch's CPU ``F.linear`` on one row
(MKL's GEMM) streams float32 weights at ~13 GB/s on the AVX-512 VMs of docs/benchmarks.md, where a plain read of
the same bytes runs at ~35 GB/s, and gains little from bfloat16. Written as a multiply and a sum over each
weight row, ``(x * W[o]).sum()``, the product is a reduction that Inductor compiles into one vectorised pass over
the weight at the read's rate, for float32 and half-precision weights alike (accumulating in float32). With the
output index outermost, ``(x[None] * W[:, None]).sum(-1)``, each weight row is read once for all of a step's rows
while it sits in L1, so a batched step costs little more than one row's.

Eagerly that product would build a (d_out, rows, d_in) tensor, so :func:`linear` takes this form only while
``torch.compile`` or ``torch.export`` traces the call (the compiled and ahead-of-time decode steps,
:meth:`decoderlab.model.DecoderOnlyTransformer.compile_decode`) and only for a fixed number of rows, at most
:data:`MAX_ROWS` (:data:`MAX_ROWS_HALF` for half-precision weights), of a plain ``nn.Linear``; everywhere else it
is ``layer(x)`` -- but for an eager decode product (no gradient, at most :data:`KERNEL_ROWS` rows on the CPU) of a
plain ``nn.Linear`` without hooks, which takes the kernels' ``dense_linear`` (:mod:`decoderlab.kernels`, measured
faster than F.linear: :data:`KERNEL_ROWS`). Block-quantized layers (:mod:`decoderlab.quant`) are ``layer(x)`` too:
their products are the kernels' op (:mod:`decoderlab.kernels`), which Inductor calls as it is. Measured in
``bench/generate.py --only-linears``.

Source: the memory-bound GEMV argument of "Roofline: an insightful visual performance model" (Williams,
Waterman and Patterson, 2009); Inductor's own ``decompose_mem_bound_mm`` pass rewrites small products the same
way, with the reduction over a transposed weight.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .kernels import dense_linear


#: the most rows (batch x tokens) taken as a reduction with float32 weights; above it the product is
#: compute-bound and a GEMM's blocking wins (``bench/generate.py --only-linears``: the 24 products of the
#: shakespeare-char shape, each after a layer norm, took 0.48-0.59x of ``F.linear``'s time at 1-2 rows, 0.70x at
#: 4, 0.83x at 8, 1.00x at 16)
MAX_ROWS = 8
#: the same for bfloat16 / float16 weights, whose GEMM (oneDNN, with the CPU's bfloat16 dot products) catches up
#: sooner: the reduction took 0.41x of its time at 1 row, 0.66x at 2, 1.20x at 4
MAX_ROWS_HALF = 2
#: the most rows an eager decode product of a plain ``nn.Linear`` takes through the kernels' ``dense_linear``
#: (:mod:`decoderlab.kernels`: rows split 1-16 a pass, x rounded to bfloat16 for a bfloat16 weight, as that
#: weight's F.linear does); more rows take F.linear (a GEMM's blocking). Measured on SmolLM2-135M's 121 products of
#: a token, 1 thread, AMD EPYC AVX2 only, 2026-12-06 (``F.linear`` time / ``dense_linear`` time): float32 0.99x at
#: 1 row, 1.87x at 4, 1.27x at 16; bfloat16 1.07x at 1 row, 2.65x at 4, 3.48x at 16 (ggml's own products on an
#: AVX-512 Xeon: bench/cpu_kernels.py). One row of float32 is a tie here, taken for the CPUs where MKL's GEMV
#: streams below the read rate (module docstring)
KERNEL_ROWS = 16
_DENSE = (torch.float32, torch.bfloat16, torch.float16)


def _plain(w: torch.Tensor) -> bool:
    """Whether ``w`` is an ordinary tensor (not a tensor subclass, e.g. torchao's quantized ones): seen as its own
    type by dynamo (a subclass is not a wrapper subclass there), as a fake tensor by torch.export."""
    if type(w) in (nn.Parameter, torch.Tensor):
        return True
    return torch.compiler.is_exporting() and not is_traceable_wrapper_subclass(w)


def _kernel_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether an eager product of ``x`` and a plain float weight goes through the kernels' ``dense_linear``: on
    the CPU, no gradient asked, at most :data:`KERNEL_ROWS` rows, a float32 / bfloat16 / float16 weight of a plain
    tensor, ``x`` float32 or the weight's dtype."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled() and w.dtype in _DENSE and type(w) in
            (nn.Parameter, torch.Tensor) and x.dtype in (torch.float32, w.dtype) and x.dim() >= 1
            and x.shape[:-1].numel() <= KERNEL_ROWS)


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``: (..., d_in) -> (..., d_out); inside a compiled graph, for a plain ``nn.Linear`` on at most
    :data:`MAX_ROWS` rows (:data:`MAX_ROWS_HALF` in half precision), computed as the reduction of the module
    docstring (the same sums, in another order: float32 results agree with ``F.linear`` to rounding).

    Anything else -- eager calls (a few rows of a plain ``nn.Linear``: the kernels' ``dense_linear``), a
    :class:`decoderlab.quant.BlockLinear` (GGUF's blocks: its kernels' op),
    PEFT's LoRA layers, quantized (tensor-subclass) weights, many rows -- is ``layer(x)`` unchanged. Raises what
    ``layer(x)`` raises."""
    if not torch.compiler.is_compiling():
        if type(layer) is nn.Linear and _kernel_rows(x, layer.weight) and not (layer._forward_hooks or
                                                                              layer._forward_pre_hooks):
            y = dense_linear(x.float(), layer.weight).to(x.dtype)
            return y if layer.bias is None else y + layer.bias
        return layer(x)
    if type(layer) is not nn.Linear:
        return layer(x)
    w = layer.weight
    rows = x.shape[:-1].numel()
    # a symbolic row count (a graph compiled for dynamic batch sizes, as the server's) keeps the GEMM, and is
    # not compared with MAX_ROWS: a comparison would guard on it, and every batch size on the other side of it
    # would compile again (the server hit dynamo's recompile limit so)
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # (imports sympy: compiling only)

    few = statically_known_true(rows <= (MAX_ROWS if w.element_size() >= 4 else MAX_ROWS_HALF))
    if not few or not _plain(w) or not w.dtype.is_floating_point:
        return layer(x)
    flat = x.reshape(rows, x.shape[-1])
    # a view onto itself, for Inductor: as_strided's lowering stores its input, so the op that made x (a layer norm,
    # say) runs once into a buffer rather than inlined into the reduction and redone for every output row
    # (measured 1.7x slower at one row, 7x at 8 rows)
    flat = torch.as_strided(flat, flat.shape, flat.stride())
    y = (flat.unsqueeze(0) * w.unsqueeze(1)).sum(-1).t()  # (d_out, rows, d_in) -> (d_out, rows) -> (rows, d_out)
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], w.shape[0])
