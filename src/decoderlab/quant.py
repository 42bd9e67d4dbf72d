"""Block-quantized weights: GGUF's Q8_0, Q4_0 and Q4_1, kept in their bytes and multiplied as they are.

A weight matrix (out, in) is cut along its input dimension into blocks of 32 weights (:data:`BLOCK`); each block
keeps small integers and a float16 scale ``d`` (and for q4_1 a float16 minimum ``m``), the layouts of llama.cpp's
ggml (``ggml-common.h``) and of the GGUF files it reads:

    q8_0  w = d * q,        q an int8 in -127 .. 127           8.5 bits a weight  (34 bytes / 32 weights)
    q4_0  w = d * (q - 8),  q a nibble 0 .. 15                 4.5 bits a weight  (18 bytes / 32 weights)
    q4_1  w = d * q + m,    q a nibble 0 .. 15                 5 bits a weight    (20 bytes / 32 weights)

(a q4 block's byte j holds weight j in its low nibble and weight j + 16 in its high one). At batch 1 decoding
reads every weight once per token and is bound by those bytes: q8_0 reads 0.27x float32's, q4_1 0.16x.

:class:`BlockWeight` holds one matrix as three planes -- the integers (out, in) int8 for q8_0 or (out, in / 2)
uint8 nibble pairs for q4, the scales (out, in / 32) float16, the minimums likewise (q4_1) -- the file's bytes
regrouped, so that a product reads each plane in order. It is made from a GGUF file's blocks
(:meth:`BlockWeight.from_gguf`, the GGUF loader's constructor: no float copy) or by quantizing a float matrix
(:meth:`BlockWeight.quantize`: llama.cpp's reference quantizers, ``quantize_row_q8_0_ref`` & co, whose bytes
``gguf.quants`` reproduces; tested equal byte for byte), and gives the float matrix back exactly as ggml and
``gguf.quants`` dequantize it (:meth:`BlockWeight.dequantize`, float32, bit for bit).

:class:`BlockLinear` and :class:`BlockEmbedding` are the model's ``nn.Linear`` / ``nn.Embedding`` over such a
weight (its planes are their buffers, so that ``state_dict``, ``.to(device)`` and an AOT package's constants see
plain tensors by name). :func:`quantize_model` turns every ``nn.Linear`` of a model -- the output layer included,
and with it the word embedding when the two are tied -- into them; :func:`use_block_weights` puts given
weights (a GGUF file's) in place of named layers.

How they multiply: eagerly (prefill, the eager decode step) a layer dequantizes its weight and calls ``F.linear``;
inside a compiled or exported decode step (``torch.compile`` / AOTInductor) :func:`block_matvec` writes the
product as a reduction over the blocks that Inductor compiles into one pass over the integers and scales
(:mod:`decoderlab.matvec`). Measured in ``bench/generate.py --only-linears`` and ``bench/llamacpp.py``.

Source: ggml's block formats (github.com/ggml-org/llama.cpp, ``ggml/src/ggml-common.h``, ``ggml-quants.c``);
the GGUF specification (github.com/ggml-org/ggml, ``docs/gguf.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config.names import BLOCK_DTYPES

#: weights per block, every block type here (ggml's QK8_0 = QK4_0 = QK4_1 = 32)
BLOCK = 32
#: GGML's type number of each block type (``gguf.GGMLQuantizationType``)
GGML_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3}
#: bytes of one block in a GGUF file: float16 scale (+ float16 minimum) + the integers
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
#: Inductor's C++ options for a step over block weights: the compiler may fuse the multiply by a scale and the add
#: into one FMA instruction (``-ffp-contract=fast``; Inductor's default keeps them apart). The block products are
#: bound by their arithmetic on the CPUs measured, not their bytes: 1.16-1.17x faster products at GPT-2's
#: vocabulary x 384 (q8_0 5.84 -> 4.98 ms, q4_1 8.64 -> 7.44 ms; bfloat16's unchanged), one thread, same run
FAST_CONTRACT = {"cpp.enable_floating_point_contract_flag": "fast"}


def block_kind(kind) -> str:
    """The name in :data:`BLOCK_DTYPES` of ``kind``: a name (any case: ``"Q8_0"``), or GGML's type number /
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


@dataclass(frozen=True)
class BlockWeight:
    """One (out, in) weight matrix in GGUF blocks of 32 along ``in`` (module docstring).

    Attributes:
        kind: ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``.
        qs: the integers: (out, in) int8 for q8_0; (out, in / 2) uint8 for q4 (per block of 32 weights, 16 bytes:
            byte j = weight j in the low nibble, weight j + 16 in the high one).
        d: (out, in / 32) float16 scales.
        m: (out, in / 32) float16 minimums for q4_1, else None.
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in): the logical matrix's shape."""
        return (self.d.shape[0], self.d.shape[1] * BLOCK)

    @property
    def nbytes(self) -> int:
        """Bytes held: the planes' (a GGUF file holds the same bytes for this matrix)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, data, kind, shape) -> BlockWeight:
        """The weight of a GGUF tensor of type Q8_0, Q4_0 or Q4_1, from its blocks as they are in the file.

        The GGUF loader's constructor: no float copy is made -- the file's bytes are regrouped into the three
        planes (one pass; the same number of bytes).

        Args:
            data: the tensor's bytes, a numpy uint8 array as ``gguf.GGUFReader`` gives them (``ReaderTensor.data``:
                (out, bytes per row), or flat), or anything ``np.asarray`` makes one of; out * in / 32 blocks.
            kind: the block type: ``"q8_0"`` / ``"q4_0"`` / ``"q4_1"`` (any case) or GGML's type number
                (``ReaderTensor.tensor_type``, a ``gguf.GGMLQuantizationType``).
            shape: the logical (out, in) of the matrix -- our ``nn.Linear`` layout; GGUF lists ggml's
                (in, out), so a loader passes ``tuple(reversed(tensor.shape))``.

        Raises:
            ValueError: a block type not kept (named, with the allowed ones), an ``in`` that is not a multiple of
                32, or a byte count that is not out * in / 32 blocks of the type (both counts named).
        """
        kind = block_kind(kind)
        out, inp = (int(s) for s in shape)
        if inp % BLOCK or out < 1 or inp < 1:
            raise ValueError(f"a {kind} matrix of shape ({out}, {inp}) is not whole blocks: its second dimension "
                             f"(inputs) must be a positive multiple of {BLOCK}")
        raw = np.asarray(data)
        if raw.dtype != np.uint8:
            raw = raw.view(np.uint8)
        n = out * (inp // BLOCK)
        if raw.size != n * BLOCK_BYTES[kind]:
            raise ValueError(f"a {kind} matrix of shape ({out}, {inp}) is {n} blocks of {BLOCK_BYTES[kind]} bytes = "
                             f"{n * BLOCK_BYTES[kind]} bytes; got {raw.size}")
        blocks = raw.reshape(n, BLOCK_BYTES[kind])
        head = 4 if kind == "q4_1" else 2

        def plane(lo, hi, dtype):  # one field of every block, copied out contiguous
            return torch.from_numpy(np.ascontiguousarray(blocks[:, lo:hi]).view(dtype))

        qs = plane(head, BLOCK_BYTES[kind], np.int8 if kind == "q8_0" else np.uint8).reshape(out, -1)
        d = plane(0, 2, np.float16).reshape(out, -1)
        m = plane(2, 4, np.float16).reshape(out, -1) if kind == "q4_1" else None
        return cls(kind, qs, d, m)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind) -> BlockWeight:
        """``weight`` (out, in), any float dtype, quantized to ``kind`` with llama.cpp's reference quantizers
        (``quantize_row_q8_0_ref``, ``_q4_0_ref``, ``_q4_1_ref``; rounding in float32 as they do). The bytes equal
        ``gguf.quants.quantize``'s for the same float32 matrix.

        Raises:
            ValueError: an unknown ``kind``, a matrix that is not 2-D, or ``in`` not a multiple of 32.
        """
        kind = block_kind(kind)
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise ValueError(f"{kind} quantizes (out, in) matrices whose in is a multiple of {BLOCK}; got shape "
                             f"{tuple(weight.shape)}")
        out = weight.shape[0]
        with torch.no_grad():
            x = weight.detach().to(torch.float32).reshape(-1, BLOCK)  # (blocks, 32)
            if kind == "q8_0":
                d = x.abs().amax(-1, keepdim=True) / 127
                qs = _roundf(x * _inverse(d)).to(torch.int8)
                return cls(kind, qs.reshape(out, -1), d.half().reshape(out, -1))
            if kind == "q4_0":
                peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude
                d = peak / -8
                q = (x * _inverse(d) + 8.5).trunc()
                m = None
            else:
                lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
                d = (hi - lo) / 15
                q = ((x - lo) * _inverse(d) + 0.5).trunc()
                m = lo.half().reshape(out, -1)
            q = q.to(torch.uint8).clamp_(0, 15).reshape(-1, 2, BLOCK // 2)
            qs = q[:, 0] | (q[:, 1] << 4)
            return cls(kind, qs.reshape(out, -1), d.half().reshape(out, -1), m)

    # -- reading it back ---------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix (out, in), computed in float32 as ggml and ``gguf.quants`` do (bit for bit), then cast
        to ``dtype``."""
        return dequantize_rows(self.kind, self.qs, self.d, self.m).to(dtype)

    def to_gguf(self) -> np.ndarray:
        """The GGUF bytes of this matrix: a uint8 array (out, in / 32 * block bytes), as a GGUF writer takes a
        quantized tensor (``gguf.GGUFWriter.add_tensor(..., raw_dtype=...)``). The inverse of :meth:`from_gguf`."""
        out, inp = self.shape
        n = out * (inp // BLOCK)
        parts = [self.d.reshape(n, 1).cpu().contiguous().numpy().view(np.uint8)]
        if self.m is not None:
            parts.append(self.m.reshape(n, 1).cpu().contiguous().numpy().view(np.uint8))
        parts.append(self.qs.reshape(n, -1).cpu().contiguous().numpy().view(np.uint8))
        return np.concatenate(parts, axis=1).reshape(out, -1)

    # -- rows: a fused projection's parts, a permutation of heads ------------------------------------------
    def rows(self, index) -> BlockWeight:
        """The matrix's rows ``index`` (a slice, or a tensor / list of row numbers: a selection or a
        permutation), as a weight of the same kind (blocks run along a row, so rows move whole and exactly)."""
        return BlockWeight(self.kind, self.qs[index], self.d[index], None if self.m is None else self.m[index])

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
        m = None if weights[0].m is None else torch.cat([w.m for w in weights])
        return cls(weights[0].kind, torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]), m)


def dequantize_rows(kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Float32 weights (..., in) of block planes (..., in) int8 or (..., in / 2) uint8 and (..., in / 32) scales
    (and minimums): ggml's dequantization, product and sum rounded apart as ``gguf.quants`` computes them."""
    lead = d.shape[:-1]
    scale = d.float().unsqueeze(-1)  # (..., blocks, 1)
    if kind == "q8_0":
        return (qs.reshape(*lead, -1, BLOCK).float() * scale).reshape(*lead, -1)
    q = qs.reshape(*lead, -1, BLOCK // 2)
    low = None if m is None else m.float().unsqueeze(-1)
    if torch.compiler.is_compiling():  # (a compiler fuses the stack; it takes no out= into a strided half)
        q = torch.stack([q & 15, q >> 4], dim=-2).reshape(*lead, -1, BLOCK).float()
        w = (q - 8) * scale if kind == "q4_0" else q * scale + low
        return w.reshape(*lead, -1)
    out = torch.empty(*q.shape[:-1], 2, BLOCK // 2, device=qs.device)
    # low nibbles are weights 0..15 of a block, high ones 16..31, each written into its half (eagerly a cat or a
    # broadcast shift of the two measured 2-15x slower than the rest of the dequantization)
    for half, nibbles in enumerate((q & 15, q >> 4)):
        w = out[..., half, :]
        if kind == "q4_0":
            torch.mul(nibbles.float() - 8, scale, out=w)
        else:
            torch.mul(nibbles.float(), scale, out=w)
            w.add_(low)
    return out.reshape(*lead, -1)


# ---------------------------------------------------------------------------------------------------------
# the product inside a compiled step
# ---------------------------------------------------------------------------------------------------------


def block_matvec(x: torch.Tensor, layer: "BlockLinear") -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a block weight as a reduction over its blocks, for a compiled or exported graph:
    (..., in) -> (..., out), accumulated in float32 (float64 for float64 ``x``), the result in ``x``'s dtype.

    Written as multiplies and one sum over every (block, weight-in-block) pair of a row, with the output index
    outermost, so that Inductor compiles it into a loop that reads each row's integers and scales once for all of
    ``x``'s rows and converts them to float in registers (:mod:`decoderlab.matvec`). Eagerly this would build a
    (out, rows, in) tensor: call it only where ``torch.compile`` or ``torch.export`` traces."""
    rows = x.shape[:-1].numel()
    acc = torch.promote_types(x.dtype, torch.float32)
    flat = x.reshape(rows, x.shape[-1]).to(acc)
    # a view onto itself: the op that made x runs once into a buffer instead of being inlined into the reduction
    # and redone for every output row (matvec.linear says why)
    flat = torch.as_strided(flat, flat.shape, flat.stride())
    scale = layer.d.to(acc)[:, None, :, None]  # (out, 1, blocks, 1)
    if layer.kind == "q8_0":
        xb = flat.reshape(1, rows, -1, BLOCK)  # (1, rows, blocks, 32)
        w = layer.qs.reshape(layer.out_features, 1, -1, BLOCK).to(acc) * scale
        y = (xb * w).sum((-1, -2))
    else:
        xb = flat.reshape(1, rows, -1, 2, BLOCK // 2)  # weights 0..15 and 16..31 of each block apart
        q = layer.qs.reshape(layer.out_features, 1, -1, BLOCK // 2)
        lo, hi = (q & 15).to(acc), (q >> 4).to(acc)
        if layer.kind == "q4_0":
            lo, hi = (lo - 8) * scale, (hi - 8) * scale
        else:
            low = layer.m.to(acc)[:, None, :, None]
            lo, hi = lo * scale + low, hi * scale + low
        y = (xb[..., 0, :] * lo + xb[..., 1, :] * hi).sum((-1, -2))  # (out, rows)
    y = y.t()
    if layer.bias is not None:
        y = y + layer.bias.to(acc)
    return y.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# the modules
# ---------------------------------------------------------------------------------------------------------


class _Blocks(nn.Module):
    """What a block layer shares: its planes as buffers ``qs``, ``d`` (and ``m``), the kind, and conversions
    that move the planes but never recast them (``model.to(torch.bfloat16)`` would otherwise turn the float16
    scales into bfloat16: a different weight)."""

    def _set_blocks(self, weight: BlockWeight) -> None:
        self.kind = weight.kind
        self.out_dtype = torch.float32  # what the float parts of the model are (follows .to(dtype), .double() ...)
        self.register_buffer("qs", weight.qs)
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)

    @property
    def blocks(self) -> BlockWeight:
        """The layer's weight (its own buffers, not a copy)."""
        return BlockWeight(self.kind, self.qs, self.d, self.m)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (out, in) (:meth:`BlockWeight.dequantize`)."""
        return dequantize_rows(self.kind, self.qs, self.d, self.m).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a float32 (out, in) tensor, dequantized afresh at each read (a copy: writing to it
        changes nothing). For code that reads a layer's weight (the glass box, exports); the layer itself never
        makes it in a compiled step."""
        return self.dequantize()

    def _apply(self, fn, recurse=True):
        # the float16 planes pass through as int16 views: Module.to / half / float cast floating tensors only
        planes = [k for k in ("d", "m") if self._buffers.get(k) is not None]
        for k in planes:
            self._buffers[k] = self._buffers[k].view(torch.int16)
        probe = fn(torch.empty(0, dtype=self.out_dtype))
        if probe.dtype.is_floating_point:
            self.out_dtype = probe.dtype
        try:
            return super()._apply(fn, recurse)
        finally:
            for k in planes:
                self._buffers[k] = self._buffers[k].view(torch.float16)

    def extra_repr(self) -> str:
        out, inp = self.d.shape[0], self.d.shape[1] * BLOCK
        return f"{inp}, {out}, {self.kind}"


class BlockLinear(_Blocks):
    """``nn.Linear`` over a :class:`BlockWeight`: (..., in_features) -> (..., out_features), ``x W^T + b``.

    Eagerly the weight is dequantized (float32, then ``x``'s dtype) a slice of rows at a time and ``F.linear``
    runs on each slice; inside a compiled decode step :func:`decoderlab.matvec.linear` takes :func:`block_matvec`
    instead. ``bias`` is an ordinary float parameter (state-dict key ``bias``, as ``nn.Linear``'s)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self._set_blocks(weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dequantized a slice of rows at a time, each slice small enough to stay in cache while F.linear reads it:
        # the whole float weight at once measured 7x slower than float32's F.linear at one row (written to memory
        # and read back), slices of ~128k weights 1.5x (bench/llamacpp.py: eager block dtypes)
        rows = max(16, (1 << 17) // self.in_features)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for s in range(0, self.out_features, rows):
            e = min(s + rows, self.out_features)
            w = dequantize_rows(self.kind, self.qs[s:e], self.d[s:e], None if self.m is None else self.m[s:e])
            out[..., s:e] = F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias[s:e].to(x.dtype))
        return out


class BlockEmbedding(_Blocks):
    """``nn.Embedding`` over a :class:`BlockWeight` (num_embeddings, embedding_dim): ids (...) -> rows
    (..., embedding_dim), each row dequantized from its blocks (a tied output layer's weight, read both ways), in
    float32 -- or the dtype the model was cast to (``model.double()``), as an ``nn.Embedding``'s rows follow it."""

    def __init__(self, weight: BlockWeight):
        super().__init__()
        self._set_blocks(weight)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.kind, self.qs[ids], self.d[ids], None if self.m is None else self.m[ids])
        return rows.to(self.out_dtype)


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
        for k in ("qs", "d", "m"):
            head._buffers[k] = we._buffers[k]
        head.kind = we.kind


def _check_width(name: str, module: nn.Module, kind: str) -> None:
    width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
    if width % BLOCK:
        raise ValueError(f"--dtype {kind}: layer {name} has {width} inputs, not a multiple of {BLOCK} (the block "
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
    attention.qkv": w, ..., "we": w_embed}`` -- an ``nn.Linear`` becomes a :class:`BlockLinear` (keeping its bias
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
        if isinstance(mod, (nn.Linear, BlockLinear)):
            want = (mod.out_features, mod.in_features)
            new = BlockLinear(w, None)
            new.bias = mod.bias
        elif isinstance(mod, (nn.Embedding, BlockEmbedding)):
            want = (mod.num_embeddings, mod.embedding_dim)
            new = BlockEmbedding(w)
        else:
            raise ValueError(f"layer {name} is a {type(mod).__name__}; block weights go in nn.Linear or nn.Embedding "
                             f"layers")
        if tuple(w.shape) != tuple(want):
            raise ValueError(f"block weight for {name} has shape {tuple(w.shape)}, the layer {tuple(want)}")
        model.set_submodule(name, new)
    if getattr(getattr(model, "config", None), "tie_weights", False) and hasattr(model, "fc_layer"):
        tie_block_weights(model)
    return model


def block_dtype(model: nn.Module) -> str | None:
    """The block type of ``model``'s quantized layers (the first found), None when it has none."""
    return next((m.kind for m in model.modules() if isinstance(m, _Blocks)), None)


def block_weights(model: nn.Module) -> int:
    """The weights ``model``'s block layers hold, out x in each (their buffers hold them as integers and scales,
    not parameters); planes shared by a tied embedding and output layer counted once."""
    held = {m.qs.data_ptr() or id(m.qs): m.d.shape[0] * m.d.shape[1] * BLOCK for m in model.modules()
            if isinstance(m, _Blocks)}
    return sum(held.values())


def dequantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every block layer's planes replaced by its dequantized float32 ``weight``
    (the keys an ``nn.Linear`` / ``nn.Embedding`` has): the float model these weights are, for a float64 reference
    (``verify``) or an export."""
    state = {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        if isinstance(owner, _Blocks) and leaf in ("qs", "d", "m"):
            if leaf == "qs":
                state[f"{prefix}.weight"] = owner.dequantize()
            continue
        state[key] = value
    return state
