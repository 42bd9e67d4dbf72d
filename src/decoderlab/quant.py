"""Block-quantized weights: GGUF's blocks -- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K -- kept in their bytes
and multiplied as they are, by decoderlab's CPU kernels (:mod:`decoderlab.kernels`).

A weight matrix (out, in) is cut along its input dimension into blocks of 32 weights (256 for the K-quants), each
block small integers and float16 scales (and minimums), the layouts of llama.cpp's ggml (``ggml-common.h``) and of
the GGUF files it reads (:mod:`decoderlab.kernels.types` lists them: 4.5 to 8.5 bits a weight). At batch 1
decoding reads every weight once per token and is bound by those bytes and the arithmetic on them.

:class:`BlockWeight` holds one matrix as the kernels' packed bytes (:func:`decoderlab.kernels.pack`: the file's
bytes regrouped 16 rows at a time, as many bytes as the file holds; no float copy). It is made from a GGUF file's
blocks (:meth:`BlockWeight.from_gguf`, the GGUF loader's constructor) or by quantizing a float matrix
(:meth:`BlockWeight.quantize`: llama.cpp's reference quantizers, whose bytes ``gguf.quants`` reproduces -- q8_0,
q4_0, q4_1 in torch here, q5_0 / q5_1 by ``gguf.quants``; the K-quants have no quantizer there and are refused), and
gives the float matrix back exactly as ``gguf.quants`` dequantizes it (:meth:`BlockWeight.dequantize`, float32,
bit for bit).

:class:`BlockLinear` and :class:`BlockEmbedding` are the model's ``nn.Linear`` / ``nn.Embedding`` over such weights
(their packed bytes are uint8 buffers ``packed_0``, ``packed_1``...: ``state_dict``, ``.to(device)`` and an AOT
package's constants see plain tensors, and a cast to another float dtype leaves them be). A linear layer may stack
several weights of different types along its rows (q | k | v of a K-quant file: q5_0, q5_0, q8_0), multiplied in one
call. :func:`quantize_model` turns every ``nn.Linear`` of a model -- the output layer included, and with it the word
embedding when the two are tied -- into them; :func:`use_block_weights` puts given weights (a GGUF file's) in place
of named layers.

How they multiply, on the CPU with float32 activations: through the kernels' op
``torch.ops.decoderlab.block_linear(_many)`` -- the activations quantized to 8-bit blocks and multiplied in
integers, as ggml does --, eagerly and inside a compiled or AOT-compiled step alike (the op has a fake
implementation, so Inductor traces it as any op), a decode step's rows and a prompt's alike (measured faster than
dequantizing at every row count: :data:`KERNEL_ROWS`). Another device or dtype (a CUDA GPU, a float64 reference)
dequantizes the weight a slice of rows at a time and calls ``F.linear``. Gradients flow to ``x`` (LoRA trains over a frozen block layer:
``grad_x = grad_y @ W``, ``W`` dequantized a cache-sized slice at a time by the kernels' C++
``decoderlab::dequantize``); the weight itself takes none. Measured in ``bench/llamacpp.py``.

Source: ggml's block formats (github.com/ggml-org/llama.cpp, ``ggml/src/ggml-common.h``, ``ggml-quants.c``);
the GGUF specification (github.com/ggml-org/ggml, ``docs/gguf.md``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config.names import BLOCK_DTYPES, QUANTIZABLE_BLOCK_DTYPES

#: weights per block of the 32-weight types (ggml's QK8_0 = QK4_0 = ... = 32; the K-quants' QK_K is 256)
BLOCK = 32
#: GGML's type number of each block type (``gguf.GGMLQuantizationType``)
GGML_TYPES = {k: kernels.TYPES[k].number for k in BLOCK_DTYPES}
#: bytes of one block in a GGUF file
BLOCK_BYTES = {k: kernels.TYPES[k].bytes for k in BLOCK_DTYPES}
#: the most rows of ``x`` (batch x tokens) a block layer multiplies through the kernels (None: any); more would
#: take dequantized slices and ``F.linear``. Measured, a 1536 x 576 q4_1 weight, 1 thread, AMD EPYC AVX2 only
#: (2026-12-06): the kernels' op 0.55 / 1.11 / 2.74 ms at 17 / 32 / 128 rows, F.linear of the float32 weight
#: itself 1.29 / 1.93 / 5.48 ms; again with the C++ dequantizer (2026-12-07, load ~6, 17 / 128 / 220 rows):
#: kernels 0.29 / 2.22 / 3.55 ms, dequantized slices + F.linear 1.23 / 6.83 / 9.83, F.linear 0.83 / 5.02 / 8.83
#: -- the kernels win at every row count (ggml's own GEMM-like products are 1.2-7x faster still at 128 rows:
#: bench/cpu_kernels.py)
KERNEL_ROWS = None
# (an MLP's gate and up projections in one block_linear_many call, the input quantized once, measured no faster:
# SmolLM2-135M's Q4_1 file, eager decode, 5 alternating rounds, 1 thread, AVX2 EPYC: 22.4 vs 22.8 tok/s; float32
# by dense_linear_many 9.4 vs 9.4 -- so each projection is its own call)
#: Inductor's C++ options for a step over block weights: the compiler may fuse a multiply and an add into one FMA
#: (``-ffp-contract=fast``); it measured 1.16x faster in the earlier reduction form of the block products, and
#: changes nothing for the kernels' op (compiled apart)
FAST_CONTRACT = {"cpp.enable_floating_point_contract_flag": "fast"}


def block_kind(kind) -> str:
    """The name in :data:`BLOCK_DTYPES` of ``kind``: a name (any case: ``"Q4_K"``), or GGML's type number /
    ``gguf.GGMLQuantizationType`` member. Raises ``ValueError`` naming it and the block types kept."""
    if isinstance(kind, str) and kind.lower() in BLOCK_DTYPES:
        return kind.lower()
    if isinstance(kind, int) and not isinstance(kind, bool):
        for name, number in GGML_TYPES.items():
            if int(kind) == number:
                return name
    shown = getattr(kind, "name", kind)
    raise ValueError(f"block type {shown!r} is not one decoderlab keeps quantized; allowed: {', '.join(BLOCK_DTYPES)}")


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's ``roundf`` and ``gguf.quants.np_roundf`` (written their way, so that
    float32 rounding gives the same integers: floor(a) + floor(2 (a - floor a)), not floor(a + 0.5))."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.half().contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _quantize_bytes(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF bytes (out, row bytes) of ``weight`` (out, in) quantized to q8_0 / q4_0 / q4_1 by llama.cpp's reference
    quantizers (``quantize_row_q8_0_ref`` & co; rounding in float32 as they do), or q5_0 / q5_1 by
    ``gguf.quants`` (the same quantizers in numpy)."""
    out = weight.shape[0]
    x = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, BLOCK)  # (blocks, 32)
    if kind in ("q5_0", "q5_1"):
        import gguf

        raw = gguf.quants.quantize(x.reshape(out, -1).numpy(), gguf.GGMLQuantizationType[kind.upper()])
        return torch.from_numpy(np.ascontiguousarray(raw))
    if kind == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        qs = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_f16_bytes(d), qs], dim=1).reshape(out, -1)
    if kind == "q4_0":
        peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude
        d = peak / -8
        q = (x * _inverse(d) + 8.5).trunc()
        head = [_f16_bytes(d)]
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((x - lo) * _inverse(d) + 0.5).trunc()
        head = [_f16_bytes(d), _f16_bytes(lo)]
    q = q.to(torch.uint8).clamp_(0, 15).reshape(-1, 2, BLOCK // 2)
    return torch.cat([*head, q[:, 0] | (q[:, 1] << 4)], dim=1).reshape(out, -1)


@dataclass(frozen=True)
class BlockWeight:
    """One (out, in) weight matrix in GGUF blocks along ``in``, held as the kernels' packed bytes (module
    docstring).

    Attributes:
        kind: a name of :data:`BLOCK_DTYPES` (``"q4_k"``).
        packed: 1-D uint8, :func:`decoderlab.kernels.pack`'s layout of the file's blocks.
        shape: (out, in), the logical matrix's.
    """

    kind: str
    packed: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes held: the file's bytes for this matrix (and zero rows up to a multiple of 16 rows, if any)."""
        return self.packed.numel()

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, data, kind, shape) -> BlockWeight:
        """The weight of a GGUF block tensor, from its bytes as they are in the file -- the GGUF loader's
        constructor: no float copy is made (the bytes regrouped once, :func:`decoderlab.kernels.pack`).

        Args:
            data: the tensor's bytes, a numpy uint8 array as ``gguf.GGUFReader`` gives them (``ReaderTensor.data``:
                (out, bytes per row), or flat), or a torch uint8 tensor.
            kind: the block type, a name of :data:`BLOCK_DTYPES` (any case) or GGML's type number
                (``ReaderTensor.tensor_type``).
            shape: the logical (out, in) of the matrix -- our ``nn.Linear`` layout; GGUF lists ggml's
                (in, out), so a loader passes ``tuple(reversed(tensor.shape))``.

        Raises:
            ValueError: a block type not kept (named, with the allowed ones), an ``in`` that is not whole blocks of
                the type, or a byte count that is not the shape's (both counts named).
        """
        kind = block_kind(kind)
        out, inp = (int(s) for s in shape)
        if isinstance(data, np.ndarray) and data.dtype != np.uint8:
            data = data.view(np.uint8)
        return cls(kind, kernels.pack(data, kind, (out, inp)), (out, inp))

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind) -> BlockWeight:
        """``weight`` (out, in), any float dtype, quantized to ``kind`` with llama.cpp's reference quantizers; the
        bytes equal ``gguf.quants.quantize``'s for the same float32 matrix.

        Raises:
            ValueError: an unknown ``kind``, a K-quant (no reference quantizer here or in ``gguf.quants``: named,
                with the types that quantize), a matrix that is not 2-D, or ``in`` not a multiple of 32.
        """
        kind = block_kind(kind)
        if kind not in QUANTIZABLE_BLOCK_DTYPES:
            raise ValueError(f"{kind} cannot be quantized to here (gguf.quants has no quantizer for it: llama.cpp's "
                             f"llama-quantize writes it); allowed: {', '.join(QUANTIZABLE_BLOCK_DTYPES)}")
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise ValueError(f"{kind} quantizes (out, in) matrices whose in is a multiple of {BLOCK}; got shape "
                             f"{tuple(weight.shape)}")
        with torch.no_grad():
            raw = _quantize_bytes(weight, kind)
        return cls.from_gguf(raw, kind, tuple(weight.shape))

    # -- reading it back ---------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix (out, in), computed in float32 as ``gguf.quants`` does (bit for bit), then cast to
        ``dtype``."""
        return kernels.dequantize(self.packed, self.kind, self.shape).to(dtype)

    def to_gguf(self) -> np.ndarray:
        """The GGUF bytes of this matrix: a uint8 array (out, bytes per row), as a GGUF writer takes a quantized
        tensor (``gguf.GGUFWriter.add_tensor(..., raw_dtype=...)``). The inverse of :meth:`from_gguf`."""
        return kernels.unpack(self.packed.cpu(), self.kind, self.shape).numpy()

    # -- rows: a fused projection's parts, a permutation of heads ------------------------------------------
    def rows(self, index) -> BlockWeight:
        """The matrix's rows ``index`` (a slice, or a tensor / list of row numbers: a selection or a
        permutation), as a weight of the same kind (blocks run along a row, so rows move whole and exactly)."""
        raw = kernels.unpack(self.packed.cpu(), self.kind, self.shape)[index]
        return BlockWeight.from_gguf(raw, self.kind, (raw.shape[0], self.shape[1]))

    @classmethod
    def cat(cls, weights) -> BlockWeight:
        """Matrices of one kind and one ``in`` stacked along their rows (q, k and v into one fused projection).

        Raises:
            ValueError: no weights, or weights of different kinds or widths (named).
        """
        weights = list(weights)
        if not weights:
            raise ValueError("BlockWeight.cat takes at least one weight")
        kinds = {w.kind for w in weights}
        widths = {w.shape[1] for w in weights}
        if len(kinds) > 1 or len(widths) > 1:
            raise ValueError(f"BlockWeight.cat stacks weights of one block type and one width; got types "
                             f"{sorted(kinds)} and widths {sorted(widths)}")
        raw = torch.cat([kernels.unpack(w.packed.cpu(), w.kind, w.shape) for w in weights])
        return cls.from_gguf(raw, weights[0].kind, (raw.shape[0], weights[0].shape[1]))


def grown_rows(weight: BlockWeight, count: int) -> BlockWeight | None:
    """``weight`` (out, in) with ``count`` rows appended, each the mean of its rows quantized to its own kind (the
    rows a chat template's new tokens get in a vocabulary held in blocks: the old rows stay exactly as they are);
    None for a kind with no quantizer here (the K-quants: the caller grows a float copy instead).

    The mean is summed in float64 over the rows dequantized a cache-sized slice at a time, so no float32 copy of
    the matrix is made (Gemma 3's 262,144 x 640 embedding: 671 MB)."""
    if weight.kind not in QUANTIZABLE_BLOCK_DTYPES:
        return None
    out, inp = weight.shape
    total, rows = torch.zeros(inp, dtype=torch.float64), _slice_rows(inp)
    for s in range(0, out, rows):
        part = _dequantized_rows(weight.packed.cpu(), weight.kind, weight.shape, s, min(s + rows, out))
        total += part.sum(0, dtype=torch.float64)
    new = BlockWeight.quantize((total / out).float().expand(count, inp), weight.kind)
    if out % kernels.ROWS == 0:  # the packed bytes are whole groups of 16 rows, one after another: appended as is
        packed = torch.cat([weight.packed, new.packed.to(weight.packed.device)])
        return BlockWeight(weight.kind, packed, (out + count, inp))
    grown = BlockWeight.cat([weight, new])
    return BlockWeight(grown.kind, grown.packed.to(weight.packed.device), grown.shape)


# ---------------------------------------------------------------------------------------------------------
# the products
# ---------------------------------------------------------------------------------------------------------


def _dequantized_rows(packed: torch.Tensor, kind: str, shape: tuple[int, int], start: int, stop: int):
    """Rows [start, stop) of a packed weight as float32 (``start`` a multiple of 16), read from their groups' bytes by
    the kernels' ``decoderlab::dequantize`` (the torch path off the CPU)."""
    return kernels.dequantize(packed, kind, shape, start, stop)


def _dequantized_linear(x: torch.Tensor, packed: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """``x @ W.T`` by ``F.linear`` on the weight dequantized a slice of rows at a time, each slice small enough to
    stay in cache while F.linear reads it (the whole float weight at once measured 7x slower than float32's
    F.linear at one row: written to memory and read back; slices of ~128k weights 1.5x, by the torch dequantizer;
    by the C++ one 1.5x at 17 rows, 1.1x at 220: :data:`KERNEL_ROWS`)."""
    out, inp = shape
    rows = _slice_rows(inp)
    y = x.new_empty(*x.shape[:-1], out)
    for s in range(0, out, rows):
        e = min(s + rows, out)
        y[..., s:e] = F.linear(x, _dequantized_rows(packed, kind, shape, s, e).to(device=x.device, dtype=x.dtype))
    return y


def _slice_rows(inp: int) -> int:
    """Rows of an (out, in) weight dequantized at a time: ~128k weights, a multiple of 16 (cache-sized slices)."""
    return max(1, (1 << 17) // inp // kernels.ROWS) * kernels.ROWS


class _KernelProduct(torch.autograd.Function):
    """The kernels' products with a gradient for ``x``: ``grad_x = grad_y @ W`` with ``W`` dequantized a slice of
    rows at a time (the forward's activation quantization is treated as the identity, as a straight-through
    estimator; a frozen weight takes no gradient). Slices, not the whole weight: a LoRA step over a 49152-row
    output layer holds no 113 MB float32 copy, and the slices, dequantized in cache, measured 1.5-2x faster. Each
    slice is read from the packed bytes by ``decoderlab::dequantize`` (C++, ~0.3-0.5 ns a weight), which put the
    backward at float32's own product: 1 thread, AMD EPYC AVX2 only, 220 rows, alternating medians, load ~6
    (2026-12-07): 1536 x 576 q4_1 18.9 ms by the torch dequantizer -> 9.5 (float32's grad @ W 9.2), 49152 x 576
    467 -> 255 ms (float32 228)."""

    @staticmethod
    def forward(ctx, x, kinds, outs, inp, *packed):
        ctx.parts = (kinds, outs, inp)
        ctx.save_for_backward(*packed)
        return _kernel_products(x, packed, kinds, outs)

    @staticmethod
    def backward(ctx, grad):
        kinds, outs, inp = ctx.parts
        saved = ctx.saved_tensors  # (read once: a second read fails inside torch.utils.checkpoint)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x, at, rows = flat.new_zeros(flat.shape[0], inp), 0, _slice_rows(inp)
        for p, kind, out in zip(saved, kinds, outs):
            for s in range(0, out, rows):
                e = min(s + rows, out)
                grad_x.addmm_(flat[:, at + s:at + e], _dequantized_rows(p, kind, (out, inp), s, e))
            at += out
        return (grad_x.reshape(*grad.shape[:-1], inp), None, None, None, *[None] * len(saved))


def _kernel_products(x: torch.Tensor, packed, kinds, outs) -> torch.Tensor:
    if len(packed) == 1:
        return kernels.block_linear(x, packed[0], kinds[0], outs[0])
    if torch.compiler.is_compiling():
        # one op per weight in a compiled graph: an AOT package over block_linear_many (a list-returning op)
        # decoded other greedy tokens than eager on SmolLM2's Q4_K_M file (14% equal, 2026-12-06; the cause not
        # found), the single op the same tokens
        return torch.cat([kernels.block_linear(x, p, k, o) for p, k, o in zip(packed, kinds, outs)], dim=-1)
    return torch.cat(kernels.block_linear_many(x, list(packed), list(kinds), list(outs)), dim=-1)


_DEQUANTIZED = {"depth": 0}
#: inside weights_read_once: "layer" -> (the block layer whose weight was read last, that weight)
_LAST_WEIGHT: dict = {}


@contextmanager
def weights_read_once():
    """Within it, a block layer's ``weight`` read again and again (PEFT's adapter injection reads each targeted
    layer's ``weight`` for its device and dtype ~19 times: 2,850 dequantizations of SmolLM2-135M's 150 layers,
    2.5 CPU-s of a 75 s LoRA run) is dequantized once: the last layer read keeps its weight until another is
    read. Not re-entrant; the weights it returns are shared between those reads (read, never write them)."""
    _LAST_WEIGHT["layer"] = None
    try:
        yield
    finally:
        _LAST_WEIGHT.clear()


@contextmanager
def dequantized_products():
    """Within it, every block layer multiplies its dequantized weight by ``F.linear`` (no activation quantization):
    the arithmetic ``decoderlab verify`` holds to its float64 recomputation from the dequantized weights."""
    _DEQUANTIZED["depth"] += 1
    try:
        yield
    finally:
        _DEQUANTIZED["depth"] -= 1


def activation_types(model: nn.Module) -> list[str]:
    """The 8-bit block types the kernels quantize ``model``'s block products' activations to (``"q8_1"`` for a
    q4_1 weight, ...), each once, in the order met; empty for a model without block layers."""
    kinds = [kernels.TYPES[k].activation for m in model.modules() if isinstance(m, _Blocks) for k in m.kinds]
    return list(dict.fromkeys(kinds))


def _few_rows(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows go through the kernels: float32 on the CPU, at most :data:`KERNEL_ROWS` rows (None:
    any) -- or a symbolic row count inside a compiled graph (a server's dynamic batch: a comparison would guard on
    it and recompile for every batch size on its other side)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or _DEQUANTIZED["depth"]:
        return False
    if KERNEL_ROWS is None:
        return True
    rows = x.shape[:-1].numel()
    if isinstance(rows, int):
        return rows <= KERNEL_ROWS
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # (sympy: only a compile's rows)

    return not statically_known_true(rows > KERNEL_ROWS)


# ---------------------------------------------------------------------------------------------------------
# the modules
# ---------------------------------------------------------------------------------------------------------


class _Blocks(nn.Module):
    """What a block layer shares: its weights' packed bytes as uint8 buffers ``packed_0``, ``packed_1``... (rows
    stacked in that order), each one's kind and out; conversions move them and never recast them (uint8: a cast
    to another float dtype passes them by)."""

    def _set_blocks(self, weights) -> None:
        weights = [weights] if isinstance(weights, BlockWeight) else list(weights)
        if not weights or len({w.shape[1] for w in weights}) != 1:
            raise ValueError(f"a block layer stacks one or more weights of one width; got shapes "
                             f"{[tuple(w.shape) for w in weights]}")
        self.kinds = tuple(w.kind for w in weights)
        self.outs = tuple(w.shape[0] for w in weights)
        self.in_width = weights[0].shape[1]
        self.out_dtype = torch.float32  # what the float parts of the model are (follows .to(dtype), .double() ...)
        for i, w in enumerate(weights):
            self.register_buffer(f"packed_{i}", w.packed)

    @property
    def kind(self) -> str:
        """The block type of the layer's first weight (``"mixed"`` readers look at :attr:`kinds`)."""
        return self.kinds[0]

    @property
    def packed(self) -> list[torch.Tensor]:
        """The layer's packed weights, in row order (its own buffers)."""
        return [self._buffers[f"packed_{i}"] for i in range(len(self.kinds))]

    @property
    def parts(self) -> list[BlockWeight]:
        """The layer's weights, in row order (over its own buffers, not copies)."""
        return [BlockWeight(k, p, (o, self.in_width)) for k, p, o in zip(self.kinds, self.packed, self.outs)]

    @property
    def blocks(self) -> BlockWeight:
        """The layer's weight as one :class:`BlockWeight` (its own buffers when it holds one; a stack of weights of
        one type re-packed together).

        Raises:
            ValueError: weights of different types (a K-quant file's q | k | v), named."""
        parts = self.parts
        return parts[0] if len(parts) == 1 else BlockWeight.cat(parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (out, in) (:meth:`BlockWeight.dequantize`)."""
        parts = [w.dequantize(dtype) for w in self.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # (one part: no copy by cat)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a float32 (out, in) tensor, dequantized afresh at each read (a copy: writing to it
        changes nothing) -- inside :func:`weights_read_once`, the last layer's read again. For code that reads a
        layer's weight (the glass box, exports); the layer itself never makes it in a compiled step."""
        last = _LAST_WEIGHT.get("layer")
        if last is not None and last[0] is self:
            return last[1]
        w = self.dequantize()
        if "layer" in _LAST_WEIGHT:
            _LAST_WEIGHT["layer"] = (self, w)
        return w

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=self.out_dtype))
        if probe.dtype.is_floating_point:
            self.out_dtype = probe.dtype
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.in_width}, {sum(self.outs)}, {' | '.join(self.kinds)}"


class BlockLinear(_Blocks):
    """``nn.Linear`` over :class:`BlockWeight` s stacked along the rows: (..., in_features) -> (...,
    out_features), ``x W^T + b``. Float32 rows on the CPU go through the kernels' op (one call for all the
    weights); another dtype or device through ``F.linear`` on dequantized slices (module docstring).
    ``bias`` is an ordinary float parameter (state-dict key ``bias``, as ``nn.Linear``'s)."""

    def __init__(self, weight, bias: torch.Tensor | None = None):
        super().__init__()
        self._set_blocks(weight)
        self.out_features, self.in_features = sum(self.outs), self.in_width
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if _few_rows(x):
            if torch.is_grad_enabled() and x.requires_grad:
                y = _KernelProduct.apply(x, self.kinds, self.outs, self.in_width, *packed)
            else:
                y = _kernel_products(x, packed, self.kinds, self.outs)
        else:
            y = torch.cat([_dequantized_linear(x, p, k, (o, self.in_width))
                           for p, k, o in zip(packed, self.kinds, self.outs)], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class BlockEmbedding(_Blocks):
    """``nn.Embedding`` over a :class:`BlockWeight` (num_embeddings, embedding_dim): ids (...) -> rows
    (..., embedding_dim), each row dequantized from its blocks (a tied output layer's weight, read both ways), in
    float32 -- or the dtype the model was cast to (``model.double()``), as an ``nn.Embedding``'s rows follow it."""

    def __init__(self, weight: BlockWeight):
        super().__init__()
        self._set_blocks(weight)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the packed bytes keep 16 rows together: each id's group of 16 is dequantized and its row picked (no
        # unique(): its data-dependent size would not compile; a prompt's groups are few MB at most)
        (packed,), kind, width = self.packed, self.kinds[0], self.in_width
        groups = packed.view(-(-self.num_embeddings // kernels.ROWS), -1)
        flat = ids.reshape(-1)
        chosen = groups[flat // kernels.ROWS].reshape(-1)
        rows = kernels.dequantize(chosen, kind, (flat.numel() * kernels.ROWS, width))
        picked = rows.view(flat.numel(), kernels.ROWS, width)[torch.arange(flat.numel(), device=ids.device),
                                                                flat % kernels.ROWS]
        return picked.reshape(*ids.shape, width).to(self.out_dtype)


def is_block_layer(module) -> bool:
    return isinstance(module, _Blocks)


# ---------------------------------------------------------------------------------------------------------
# a model's layers
# ---------------------------------------------------------------------------------------------------------


def tie_block_weights(model) -> None:
    """Make a tied model's word embedding and output layer read one set of planes again (the model's
    ``tie_weights`` calls it when either holds blocks: after ``.to(device)`` each module got its own copy)."""
    we, head = model.we, model.fc_layer
    if isinstance(head, BlockLinear) and not isinstance(we, BlockEmbedding):
        model.we = BlockEmbedding(head.blocks)
    elif isinstance(we, BlockEmbedding) and not isinstance(head, BlockLinear):
        model.fc_layer = BlockLinear(we.blocks, None if head.bias is None else head.bias)
    elif isinstance(head, BlockLinear):
        head._buffers["packed_0"] = we._buffers["packed_0"]
        head.kinds = we.kinds


def _check_width(name: str, module: nn.Module, kind: str) -> None:
    width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
    block = kernels.TYPES[kind].block
    if width % block:
        raise ValueError(f"--dtype {kind}: layer {name} has {width} inputs, not a multiple of {block} (the block "
                         f"size); block types need every linear layer's width to be one (use float32, bfloat16 or "
                         f"float16 for this model)")


def quantize_model(model: nn.Module, kind) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` (found by walking its modules, whatever their names) as a
    :class:`BlockLinear` of ``kind``, in place; returns the model. A ``DecoderOnlyTransformer`` whose output layer
    is tied to its word embedding gets one quantized matrix read by both (a :class:`BlockEmbedding` and the
    output layer), as a GGUF file keeps it; an untied embedding stays float (a row lookup, no read per token).

    Raises:
        ValueError: an unknown kind; a linear layer whose input width is not a multiple of 32 (named; nothing
            is changed then).
    """
    kind = block_kind(kind)
    if kind not in QUANTIZABLE_BLOCK_DTYPES:
        BlockWeight.quantize(torch.zeros(1, BLOCK), kind)  # the one error naming the types that quantize
    linears = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in linears:
        _check_width(name, mod, kind)
    tied = getattr(getattr(model, "config", None), "tie_weights", False) and hasattr(model, "we")
    done: dict[int, BlockWeight] = {}
    for name, mod in linears:
        w = done.get(id(mod.weight))
        if w is None:
            w = done[id(mod.weight)] = BlockWeight.quantize(mod.weight, kind)
        model.set_submodule(name, BlockLinear(w, mod.bias))
    if tied and isinstance(getattr(model, "fc_layer", None), BlockLinear):
        model.we = BlockEmbedding(model.fc_layer.blocks)
        tie_block_weights(model)
    return model


def use_block_weights(model: nn.Module, weights: dict[str, BlockWeight]) -> nn.Module:
    """Put block weights in place of named layers of ``model``, in place; returns the model: ``{"blocks.0.
    attention.qkv": w, ..., "we": w_embed}``, each value a :class:`BlockWeight` or, for a linear layer, a list of
    them stacked along the rows (q | k | v of different types) -- an ``nn.Linear`` becomes a :class:`BlockLinear`
    (keeping its bias
    parameter, which may still be on the meta device for ``load_state_dict(..., assign=True)`` to fill), an
    ``nn.Embedding`` a :class:`BlockEmbedding`. A tied ``DecoderOnlyTransformer`` given either its word embedding
    or its output layer gets both over the one weight.

    Raises:
        ValueError: a name that is no layer of the model, a layer that is neither, or a weight whose shape is not
            the layer's (named).
    """
    for name, w in weights.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the model has no layer {name!r} for a block weight") from None
        parts = [w] if isinstance(w, BlockWeight) else list(w)
        if isinstance(mod, (nn.Linear, BlockLinear)):
            want = (mod.out_features, mod.in_features)
            new = BlockLinear(parts, None)
            new.bias = mod.bias
        elif isinstance(mod, (nn.Embedding, BlockEmbedding)) and len(parts) == 1:
            want = (mod.num_embeddings, mod.embedding_dim)
            new = BlockEmbedding(w)
        else:
            raise ValueError(f"layer {name} is a {type(mod).__name__}; block weights go in nn.Linear or nn.Embedding "
                             f"layers")
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if shape != tuple(want):
            raise ValueError(f"block weight for {name} has shape {shape}, the layer {tuple(want)}")
        model.set_submodule(name, new)
    if getattr(getattr(model, "config", None), "tie_weights", False) and hasattr(model, "fc_layer"):
        tie_block_weights(model)
    return model


def block_dtypes(model: nn.Module) -> list[str]:
    """The block types of ``model``'s block weights, the type holding most weights first (Gemma 3's Q4_K_M file:
    q8_0 (its embedding), q4_k, q6_k, q5_0); empty when it has none."""
    held: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, _Blocks):
            for kind, out in zip(m.kinds, m.outs):
                held[kind] = held.get(kind, 0) + out * m.in_width
    return sorted(held, key=held.get, reverse=True)


def block_dtype(model: nn.Module) -> str | None:
    """The block type most of ``model``'s block weights are in (a GGUF file's Q4_1 matrices beside its Q8_0
    embedding: q4_1), None when it has none."""
    kinds = block_dtypes(model)
    return kinds[0] if kinds else None


def block_weights(model: nn.Module) -> int:
    """The weights ``model``'s block layers hold, out x in each (their buffers hold them as integers and scales,
    not parameters); planes shared by a tied embedding and output layer counted once."""
    held = {p.data_ptr() or id(p): o * m.in_width for m in model.modules() if isinstance(m, _Blocks)
            for p, o in zip(m.packed, m.outs)}
    return sum(held.values())


def dequantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every block layer's planes replaced by its dequantized float32 ``weight``
    (the keys an ``nn.Linear`` / ``nn.Embedding`` has): the float model these weights are, for a float64 reference
    (``verify``) or an export."""
    state = {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        if isinstance(owner, _Blocks) and leaf.startswith("packed_"):
            if leaf == "packed_0":
                state[f"{prefix}.weight"] = owner.dequantize()
            continue
        state[key] = value
    return state
