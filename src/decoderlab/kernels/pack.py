"""A block weight's bytes, from GGUF's row-major blocks into the kernels' layout, once at load, and back.

GGUF keeps a matrix (out, in) as ``out`` rows of ``in / block`` blocks, each block its scales then its integers
(ggml's structs, :mod:`decoderlab.kernels.types`). The kernels compute 16 output rows at once, one row per 32-bit
lane of a 512-bit register: so :func:`pack` regroups the rows in groups of 16 and, block by block, puts each field
of the 16 blocks side by side -- the 16 float16 scales in a row, then the integers in chunks of 4 bytes (the bytes
one ``vpdpbusd`` lane multiplies), chunk ``c`` of row 0, chunk ``c`` of row 1, ... chunk ``c`` of row 15:

    group g, block b:  d[16 rows] | (m or dmin[16]) | (scale bytes: byte k of the 16 rows, k = 0..11) |
                       chunk 0 of the 16 rows | chunk 1 of the 16 rows | ...

q6_k's chunks go half by half (128 weights), the low bits of weights l and l + 32 and their high bits together:
``ql[4c..]``, ``ql[32 + 4c..]``, ``qh[4c..]`` for c = 0..7; its 16 int8 sub-block scales as 16 planes of 16 rows.
q5_0 / q5_1's 32 fifth bits (qh, bit j = weight j's) are transposed within their 4 bytes so that bit c of byte i is
weight 4c + i's: the bits of chunk c are then bit c of each byte, one shift from where they add to the nibbles.
q8_0's int8 quants are stored with their sign bit flipped (q + 128, an unsigned byte: ``vpdpbusd`` multiplies
unsigned by signed bytes). The bytes are the file's, moved: the packed weight is exactly as large as the file's
tensor, plus zero rows up to a multiple of 16 rows when ``out`` is not one (no model's matrix here).

Pure NumPy (byte reshapes and transposes, on one thread), the same for every kernel path; :func:`unpack` gives the
file's bytes back.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .types import GGMLType, ggml_type

#: output rows per packed group (the 16 lanes of a 512-bit register of 32-bit sums)
ROWS = 16

#: each block type's fields in the packed order: (first byte in ggml's block, length, bytes side by side)
_FIELDS = {
    "q8_0": ((0, 2, 2), (2, 32, 4)),
    "q4_0": ((0, 2, 2), (2, 16, 4)),
    "q4_1": ((0, 2, 2), (2, 2, 2), (4, 16, 4)),
    "q5_0": ((0, 2, 2), (2, 4, 4), (6, 16, 4)),
    "q5_1": ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)),
    "q4_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),
    "q5_k": ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 4), (48, 128, 4)),
    # q6_k's block is ql (128) | qh (64) | scales (16) | d (2); its quants are interleaved apart (_q6_k_quants)
    "q6_k": ((208, 2, 2), (192, 16, 1)),
}


def check_shape(kind, shape, name: str = "weight") -> tuple[GGMLType, int, int]:
    """``(type, out, in)`` of a block weight ``name`` of ``shape`` (out, in).

    Raises:
        ValueError: a type that is not a weight block type, or an ``in`` that is not a positive multiple of the
            type's block size (naming the tensor, its width and the block size).
    """
    t = ggml_type(kind)
    if not t.quantized or t.activation is None:
        raise ValueError(f"{name}: {t.name} is not a block type the kernels multiply; allowed: q8_0, q4_0, q4_1, "
                         f"q4_k, q5_k, q6_k")
    out, inp = (int(s) for s in shape)
    if out < 1 or inp < 1 or inp % t.block:
        raise ValueError(f"{name}: a {t.name} matrix needs its width (inputs) to be a positive multiple of "
                         f"{t.block}, the type's block size; got shape ({out}, {inp})")
    return t, out, inp


def _as_bytes(raw, t: GGMLType, out: int, inp: int, name: str) -> torch.Tensor:
    """``raw`` (numpy or torch, any shape) as a (out, blocks, bytes) uint8 tensor sharing its memory."""
    if isinstance(raw, torch.Tensor):
        data = raw.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    else:
        with warnings.catch_warnings():  # a read-only memmap of a GGUF file: read here, never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    want = out * (inp // t.block) * t.bytes
    if data.numel() != want:
        raise ValueError(f"{name}: a {t.name} matrix of shape ({out}, {inp}) is {want} bytes; got {data.numel()}")
    return data.reshape(out, inp // t.block, t.bytes)


#: where q5_0 / q5_1 keep qh in a block
_QH = {"q5_0": 2, "q5_1": 4}


def _transposed_qh(qh: np.ndarray, inverse: bool = False) -> np.ndarray:
    """``qh`` (..., 4) uint8 with bit j = 4c + i of its 32 bits (little-endian: byte i's bit b is bit 8i + b)
    moved to bit c of byte i, or back: a new array. A nibble at a time on 32-bit words, in NumPy: one thread
    whatever torch's intra-op threads (expanding each bit to a byte in torch took 3.3 of Gemma 3's 5.4 s load,
    and torch's two threads beside a busy core ran these small steps 5-8x slower than one)."""
    word = np.ascontiguousarray(qh).view("<u4")
    out = np.zeros_like(word)
    for c in range(8):
        if inverse:  # bit c of each byte (bits c, 8 + c, 16 + c, 24 + c) -> the nibble at 4c
            z = (word >> c) & 0x01010101
            out |= ((z | (z >> 7) | (z >> 14) | (z >> 21)) & 0xF) << (4 * c)
        else:  # the nibble at 4c (bit i = weight 4c + i) -> bit c of byte i
            y = (word >> (4 * c)) & 0xF
            out |= ((y & 1) | ((y & 2) << 7) | ((y & 4) << 14) | ((y & 8) << 21)) << c
    return out.view(np.uint8)


def _in_place(array: np.ndarray, shape: tuple) -> np.ndarray:
    """``array`` seen in ``shape`` without a copy (NumPy's reshape copies where it must: a write would be lost;
    setting ``.shape`` raises instead)."""
    view = array.view()
    view.shape = shape
    return view


def _side_by_side(field: np.ndarray, width: int) -> np.ndarray:
    """(groups, 16 rows, blocks, length) -> (groups, blocks, length / width chunks, 16 rows, width)."""
    g, r, nb, n = field.shape
    return field.reshape(g, r, nb, n // width, width).transpose(0, 2, 3, 1, 4)


def _q6_k_quants(blocks: np.ndarray, out: np.ndarray) -> None:
    """q6_k's ql / qh chunks of (groups, 16, blocks, 210) written into ``out`` (groups, blocks, 2 halves, 8, 3, 16,
    4): the half's low and high 32 ql bytes, then its qh."""
    g, r, nb, _ = blocks.shape
    ql = blocks[..., :128].reshape(g, r, nb, 2, 2, 8, 4)  # (half, low or high 32 of the half's 64 bytes, c, byte)
    qh = blocks[..., 128:192].reshape(g, r, nb, 2, 1, 8, 4)
    out[:, :, :, :, :2] = ql.transpose(0, 2, 3, 5, 4, 1, 6)
    out[:, :, :, :, 2:] = qh.transpose(0, 2, 3, 5, 4, 1, 6)


def pack(raw, kind, shape, name: str = "weight", *, move=None) -> torch.Tensor:
    """The kernels' layout (module docstring) of a GGUF block tensor: a 1-D uint8 tensor.

    Args:
        raw: the tensor's bytes as ``gguf.GGUFReader`` gives them (``ReaderTensor.data``, numpy uint8
            (out, bytes per row) or flat) or a torch uint8 tensor.
        kind: q8_0, q4_0, q4_1, q4_k, q5_k or q6_k (a name in any case, or GGML's type number).
        shape: the matrix's (out, in) -- ``nn.Linear``'s layout (GGUF lists ggml's (in, out)).
        name: the tensor's name, for errors.
        move: the fields' byte moves done by ``decoderlab::pack_fields`` (the kernels' library's C++: its bound
            op, which :func:`decoderlab.kernels.pack` passes where the library is loaded); None: in NumPy here.
            The bytes are the same either way.

    Raises:
        ValueError: another type, a width that is not whole blocks, or a byte count that is not the shape's
            (named).
    """
    t, out, inp = check_shape(kind, shape, name)
    # in NumPy: byte moves on one thread whatever torch's intra-op threads (torch's two threads beside a busy
    # core ran these strided copies 5-10x slower than one)
    blocks = _as_bytes(raw, t, out, inp, name).numpy()
    pad = -out % ROWS
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), dtype=np.uint8)])
    groups = blocks.reshape(-1, ROWS, *blocks.shape[1:])
    g, nb = groups.shape[0], groups.shape[2]
    # q5_0 / q5_1's qh transposed apart (4 bytes a block), not in a copy of every block
    qh = _transposed_qh(groups[..., _QH[t.name]:_QH[t.name] + 4]) if t.name in _QH else None
    if move is not None:  # the byte moves in C++, then q5's fifth bits put in their place
        fields = [v for f in _FIELDS[t.name] for v in f]
        packed = move(torch.from_numpy(np.ascontiguousarray(groups)), nb, t.bytes, fields).numpy().reshape(g, nb, -1)
    else:  # each field copied straight into its place: no regrouped copy of the fields and then their
        # concatenation (Gemma 3's 178 MB embedding passed through two such transients as it loaded)
        packed = np.empty((g, nb, ROWS * t.bytes), dtype=np.uint8)
    at = 0
    for s, n, w in _FIELDS[t.name]:
        if move is None or qh is not None and s == _QH[t.name]:
            field = qh if qh is not None and s == _QH[t.name] else groups[..., s:s + n]
            _in_place(packed[..., at:at + ROWS * n], (g, nb, n // w, ROWS, w))[...] = _side_by_side(field, w)
        at += ROWS * n
    if t.name == "q6_k":
        _q6_k_quants(groups, _in_place(packed[..., at:], (g, nb, 2, 8, 3, ROWS, 4)))
    if t.name == "q8_0":
        packed[..., 2 * ROWS:] ^= 0x80
    return torch.from_numpy(packed.reshape(-1))


def unpack(packed: torch.Tensor, kind, shape) -> torch.Tensor:
    """The GGUF bytes of a packed weight: (out, bytes per row) uint8 -- the inverse of :func:`pack`."""
    t, out, inp = check_shape(kind, shape)
    nb = inp // t.block
    g = -(-out // ROWS)
    if packed.numel() != g * nb * ROWS * t.bytes or packed.dtype != torch.uint8:
        raise ValueError(f"a packed {t.name} matrix of shape ({out}, {inp}) is {g * nb * ROWS * t.bytes} uint8 "
                         f"bytes; got {packed.numel()} {packed.dtype}")
    packed = packed.reshape(g, nb, ROWS * t.bytes).clone()
    if t.name == "q8_0":
        packed[..., 2 * ROWS:] ^= 0x80
    blocks = torch.empty(g, ROWS, nb, t.bytes, dtype=torch.uint8, device=packed.device)
    at = 0
    for s, n, w in _FIELDS[t.name]:
        blocks[..., s:s + n] = packed[..., at:at + ROWS * n].reshape(g, nb, n // w, ROWS, w).permute(0, 3, 1, 2, 4) \
            .reshape(g, ROWS, nb, n)
        at += ROWS * n
    if t.name == "q6_k":
        quants = packed[..., at:].reshape(g, nb, 2, 8, 3, ROWS, 4).permute(0, 5, 1, 2, 4, 3, 6)  # (g,r,nb,half,3,c,b)
        blocks[..., :128] = quants[..., :2, :, :].reshape(g, ROWS, nb, 128)
        blocks[..., 128:192] = quants[..., 2:, :, :].reshape(g, ROWS, nb, 64)
    if t.name in _QH:
        at = _QH[t.name]
        blocks[..., at:at + 4] = torch.from_numpy(_transposed_qh(blocks[..., at:at + 4].numpy(), True))
    return blocks.reshape(g * ROWS, nb * t.bytes)[:out]
