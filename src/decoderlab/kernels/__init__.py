"""Our own CPU kernels for the decode step's products: ``y = x @ W.T`` for a few rows of float32 ``x`` and a weight
held as GGUF holds it -- the block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K in their bytes (no float
copy), or BF16, F16 and F32 -- with ggml's arithmetic: the activations quantized to 8-bit blocks (Q8_0 / Q8_1 /
Q8_K) and multiplied in integers (AVX-512 VNNI, AVX-VNNI, else AVX2); a BF16 weight's activations rounded to
bfloat16 and multiplied exactly into float32 (vdpbf16ps where the CPU has AVX512-BF16), F16 and F32 weights widened
exactly to float32 and multiplied by float32 activations (ggml rounds them to float16 for an F16 weight).
Several weights that share an input (q, k, v; gate, up) multiply in one call, the input quantized once
(``block_linear_many``, ``dense_linear_many``). A row's product is the same bits whatever rows are beside it and
whatever the threads.

One difference from ggml, on purpose: a q4_1 / q5_1 block's minimum multiplies d * sum(q) of the activation block
in float32 (exact: an 11-bit d times a 12-bit sum), where ggml reads q8_1's float16 s = float16(d * sum(q)); the
products are then float64's of the dequantized factors to float32 rounding, which ggml's are not (the float16 s is
off by up to 2^-11 of that term).

    types.py     the one table: each GGML type's block, bytes and activation type
    pack.py      a GGUF tensor's blocks regrouped once at load into the kernels' layout (same bytes), and back
    ops.py       torch.ops.decoderlab.* (C++, else the portable path) and the functions that call them
    pages.py     where a model's weights live: one mapping of 2 MiB transparent huge pages (the step's stream)
    portable.py  the same products in plain torch (Apple silicon, no compiler): exact integer sums, then scales
    build.py     csrc/ compiled once per source hash, torch and compiler into the cache, under a file lock
    csrc/        the C++: ops.cpp (quantizers, dispatch, threads), one file per instruction set, decode.cpp
                 (``decode_step``: a whole one-token step in one call, decoderlab.fastdecode's) and dequant.cpp
                 (``dequantize``: a packed weight's rows as float32, gguf.quants' bits -- LoRA's backward over blocks)

Use::

    from decoderlab import kernels
    packed = kernels.pack(reader_tensor.data, "q4_k", (out, in), name=reader_tensor.name)
    y = kernels.block_linear(x, packed, "q4_k", out)          # (..., in) float32 -> (..., out)
    q, k, v = kernels.block_linear_many(x, [pq, pk, pv], ["q5_0", "q5_0", "q8_0"], [576, 192, 192])
    y = kernels.dense_linear(x, weight_bf16)
    w = kernels.dequantize(packed, "q4_k", (out, in), 0, 64)  # rows 0..63 as float32 (64, in)

Measured in ``bench/cpu_kernels.py``; exactness in ``tests/kernels`` (each path against float64 of ``gguf.quants``'
dequantized weights times the dequantized quantized activations).
"""

from .pack import ROWS, check_shape, unpack
# (after .pack: the name ``pack`` is the function that moves the bytes in C++ where it can, not the module)
from .ops import (BF16_PAIRS, ENV, ISAS, PATHS, available_isas, block_linear, block_linear_many, dense_linear,
                  dense_linear_many, dequantize, isa, load, pack, quantize_activation, set_isa)
from .pages import huge_pages
from .types import ACTIVATION_TYPES, FLOAT_TYPES, TYPES, WEIGHT_BLOCK_TYPES, GGMLType, ggml_type

__all__ = ["ACTIVATION_TYPES", "BF16_PAIRS", "ENV", "FLOAT_TYPES", "GGMLType", "ISAS", "PATHS", "ROWS", "TYPES",
           "WEIGHT_BLOCK_TYPES", "available_isas", "block_linear", "block_linear_many", "check_shape", "dense_linear",
           "dense_linear_many", "dequantize", "ggml_type", "huge_pages", "isa", "load", "pack", "quantize_activation", "set_isa",
           "unpack"]
