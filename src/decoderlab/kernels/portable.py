"""The kernels' products in plain torch, for a machine with no C++ compiler or none of the instruction sets (Apple
silicon, an x86 CPU without AVX2): the same activation quantization as the C++ ops, bit for bit, and the same
integer sums -- exact in float64 -- then the scales, in float64, rounded once to float32. The C++ kernels agree
with it to their float32 accumulation (tests/kernels).

Activations, as ggml's x86 CPU backend quantizes them (``ggml-cpu/arch/x86/quants.c``):
  q8_0 / q8_1: per block of 32, amax = max |x|, d = amax / 127 stored as float16, q = round-half-even(x * (127 /
  amax)); q8_1 adds s = float16(d * sum(q)) with d before its rounding to float16.
  q8_K (``quantize_row_q8_K_ref``): per block of 256, m = the first value of largest magnitude, q = min(127,
  round-half-even(x * (-127 / m))), d = 1 / (-127 / m) in float32, and the sums of each 16 quants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pack import ROWS, check_shape, unpack
from .types import ggml_type

# ---- activations ------------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() < 1 or x.shape[-1] < 1 or x.shape[-1] % block:
        raise ValueError(f"x must be float32 with a width that is a positive multiple of {block}; got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1] // block, block)


def quantize32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8_0 / q8_1 blocks of float32 ``x`` (..., k): (q int8 (n, k / 32, 32), d float16 (n, k / 32), the sums of q
    int32, d before its rounding float32)."""
    xb = _rows(x, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0) / torch.where(amax != 0, amax, 1), 0)
    q = torch.round(xb * inverse.unsqueeze(-1))
    return q.to(torch.int8), d.half(), q.sum(-1).to(torch.int32), d


def quantize256(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8_K blocks of float32 ``x`` (..., k): (q int8 (n, k / 256, 256), d float32 (n, k / 256), the sums of each
    16 quants int32 (n, k / 256, 16))."""
    xb = _rows(x, 256)
    amax = xb.abs().amax(-1)
    peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True)).squeeze(-1)  # the first of largest magnitude
    some = amax != 0
    iscale = torch.where(some, torch.full_like(peak, -127.0) / torch.where(some, peak, 1), 0)
    q = torch.round(xb * iscale.unsqueeze(-1)).clamp(max=127)
    d = torch.where(some, torch.ones_like(iscale) / torch.where(some, iscale, 1), 0)
    return q.to(torch.int8), d, q.reshape(*q.shape[:-1], 16, 16).sum(-1).to(torch.int32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(*t.shape[:-1], -1) if t.dim() else t


def quantize_activation(x: torch.Tensor, kind) -> torch.Tensor:
    """ggml's block bytes of ``x`` (..., k) quantized to q8_0, q8_1 or q8_k: uint8 (..., k / block * bytes)."""
    t = ggml_type(kind)
    if t.name == "q8_k":
        q, d, sums = quantize256(x)
        parts = [_bytes(d.unsqueeze(-1)), _bytes(q), _bytes(sums.to(torch.int16))]
    elif t.name in ("q8_0", "q8_1"):
        q, dh, total, d = quantize32(x)
        parts = [_bytes(dh.unsqueeze(-1))]
        if t.name == "q8_1":
            parts.append(_bytes((d * total.float()).half().unsqueeze(-1)))
        parts.append(_bytes(q))
    else:
        raise ValueError(f"{t.name} is not an activation type; allowed: q8_0, q8_1, q8_k")
    return torch.cat(parts, dim=-1).reshape(*x.shape[:-1], -1)


# ---- weights: the file's blocks as integers and scales ----------------------------------------------------------


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    return raw[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).double()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32): low nibbles, then high ones (ggml's q4 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 scale bytes (..., 12) -> the 8 six-bit scales and minimums (..., 8)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _parts_k(name: str, raw: torch.Tensor) -> dict:
    """The integer quants (..., subs, len) and scales of K-quant blocks (..., bytes)."""
    if name == "q6_k":
        lead = raw.shape[:-1]
        ql, qh = raw[..., :128].reshape(*lead, 2, 2, 32), raw[..., 128:192].reshape(*lead, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=-2)  # (..., half, k: ql[0:32] lo, ql[32:64] lo, hi, hi, 32)
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
        q = (low | (high << 4)).reshape(*raw.shape[:-1], 16, 16)
        return {"q": q, "sc": raw[..., 192:208].contiguous().view(torch.int8), "d": _f16(raw, 208)}
    sc, mn = _scale_min_k4(raw[..., 4:16])
    # 4 runs of 32 bytes: low nibbles sub-block 2p, high nibbles 2p + 1
    qs = (raw[..., 16:144] if name == "q4_k" else raw[..., 48:176]).reshape(*raw.shape[:-1], 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*raw.shape[:-1], 8, 32)
    if name == "q5_k":
        qh = raw[..., 16:48].unsqueeze(-2)  # (..., 1, 32): bit j is sub-block j's fifth bit
        shifts = torch.arange(8, dtype=torch.uint8, device=raw.device).reshape(8, 1)
        q = q | (((qh >> shifts) & 1) << 4)
    return {"q": q, "sc": sc, "mn": mn, "d": _f16(raw, 0), "dmin": _f16(raw, 2)}


# ---- the products -----------------------------------------------------------------------------------------------


def _dots(qw: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """Exact integer sums in float64: qw (out, blocks, subs, len), qx (n, blocks, subs, len) -> (n, out, blocks,
    subs)."""
    return torch.einsum("absl,obsl->aobs", qx.double(), qw.double())


def _block32(name: str, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q, dh, total, _ = quantize32(x)
    dx = dh.double()  # (n, blocks)
    sx = total.double()
    dw = _f16(raw, 0)  # (out, blocks)
    minimum = name in ("q4_1", "q5_1")
    if name == "q8_0":
        qw = raw[..., 2:34].contiguous().view(torch.int8)
    else:
        qw = _nibbles(raw[..., -16:])
    if name in ("q5_0", "q5_1"):  # qh's bit j is weight j's fifth
        at = 4 if minimum else 2
        bits = (raw[..., at:at + 4].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        qw = qw | (bits.reshape(*raw.shape[:-1], 32) << 4)
    p = _dots(qw.unsqueeze(-2), q.unsqueeze(-2)).squeeze(-1)  # (n, out, blocks)
    if name in ("q4_0", "q5_0"):
        p = p - (8 if name == "q4_0" else 16) * sx.unsqueeze(1)
    y = dx.unsqueeze(1) * dw.unsqueeze(0) * p
    if minimum:
        y = y + _f16(raw, 2).unsqueeze(0) * (dx * sx).unsqueeze(1)
    return y.sum(-1)


def _block256(name: str, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q, dx, sums16 = quantize256(x)
    parts = _parts_k(name, raw)
    if name == "q6_k":
        p = _dots(parts["q"], q.reshape(*q.shape[:-1], 16, 16)) - 32 * sums16.double().unsqueeze(1)
        inner = (p * parts["sc"].double().unsqueeze(0)).sum(-1) * parts["d"].unsqueeze(0)
    else:
        p = _dots(parts["q"], q.reshape(*q.shape[:-1], 8, 32))  # (n, out, blocks, 8)
        sums32 = sums16.reshape(*sums16.shape[:-1], 8, 2).sum(-1).double()  # (n, blocks, 8)
        scaled = (p * parts["sc"].double().unsqueeze(0)).sum(-1) * parts["d"].unsqueeze(0)
        mins = (parts["mn"].double().unsqueeze(0) * sums32.unsqueeze(1)).sum(-1) * parts["dmin"].unsqueeze(0)
        inner = scaled - mins
    return (inner * dx.double().unsqueeze(1)).sum(-1)


def block_linear(x: torch.Tensor, packed: torch.Tensor, kind, out_features: int, rows: int = 2048) -> torch.Tensor:
    """``x @ W.T`` for a packed block weight (:func:`decoderlab.kernels.pack.pack`): float32 ``x`` (..., in) ->
    float32 (..., out_features), ``rows`` weight rows at a time (each chunk's integer sums are held in float64).

    Raises:
        ValueError: a type that is not a weight block type, or a width that is not whole blocks.
    """
    t, out, inp = check_shape(kind, (out_features, x.shape[-1]), "x")
    raw = unpack(packed, t, (out, inp)).reshape(out, inp // t.block, t.bytes)
    flat = x.reshape(-1, inp)
    product = _block32 if t.block == 32 else _block256
    y = torch.cat([product(t.name, raw[s:s + rows], flat) for s in range(0, out, rows)], dim=-1)
    return y.float().reshape(*x.shape[:-1], out)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a float32 / float16 / bfloat16 weight (out, in) and float32 ``x``: ``F.linear`` on the
    weight widened to float32 (exactly), accumulated in float32; a bfloat16 weight's ``x`` rounded to bfloat16 first
    (to nearest, ties to even), as the C++ kernels and ggml do."""
    if weight.dtype == torch.bfloat16:
        x = x.to(torch.bfloat16).to(torch.float32)
    return F.linear(x, weight.to(torch.float32))


# ---- weights back to float: gguf.quants' dequantization -----------------------------------------------------------


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """q5_0 / q5_1's 4 qh bytes (..., 4) -> (..., 32): bit j of the little-endian word is weight j's fifth bit."""
    return ((qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=qh.device)) & 1).reshape(
        *qh.shape[:-1], 32)


def _dequantize32(name: str, raw: torch.Tensor) -> torch.Tensor:
    """(..., bytes) blocks of 32 -> float32 (..., 32)."""
    d = _f16(raw, 0).float().unsqueeze(-1)
    if name == "q8_0":
        return d * raw[..., 2:34].contiguous().view(torch.int8).float()
    q = _nibbles(raw[..., -16:])
    if name in ("q5_0", "q5_1"):
        at = 4 if name == "q5_1" else 2
        q = q | (_fifth_bits(raw[..., at:at + 4]) << 4)
    if name in ("q4_0", "q5_0"):
        return d * (q.to(torch.int16) - (8 if name == "q4_0" else 16)).float()
    return d * q.float() + _f16(raw, 2).float().unsqueeze(-1)


def dequantize_bytes(raw: torch.Tensor, kind) -> torch.Tensor:
    """A block weight's GGUF bytes, uint8 (rows, bytes per row), as float32 (rows, in): ``gguf.quants.dequantize``'s
    numbers bit for bit (the same float32 products and sums, each rounded as numpy rounds it: a K-quant's
    ``d * sc`` is exact in float32, then ``(d * sc) * q - dmin * m``).

    Raises:
        ValueError: a type that is not a weight block type, or a row that is not whole blocks."""
    t = ggml_type(kind)
    if not t.quantized or t.activation is None or raw.dtype != torch.uint8 or raw.dim() != 2 or \
            raw.shape[1] % t.bytes:
        raise ValueError(f"dequantize_bytes takes uint8 rows of whole {t.name} blocks ({t.bytes} bytes); got "
                         f"{raw.dtype} of shape {tuple(raw.shape)}")
    rows, nb = raw.shape[0], raw.shape[1] // t.bytes
    blocks = raw.reshape(rows, nb, t.bytes)
    if t.block == 32:
        return _dequantize32(t.name, blocks).reshape(rows, -1)
    parts = _parts_k(t.name, blocks)
    if t.name == "q6_k":  # (rows, nb, 16 sub-blocks, 16)
        scale = (parts["d"].unsqueeze(-1) * parts["sc"].double()).float().unsqueeze(-1)
        return (scale * (parts["q"].to(torch.int16) - 32).float()).reshape(rows, -1)
    scale = (parts["d"].unsqueeze(-1) * parts["sc"].double()).float().unsqueeze(-1)  # exact: 11 x 6 bits
    low = (parts["dmin"].unsqueeze(-1) * parts["mn"].double()).float().unsqueeze(-1)
    return (scale * parts["q"].float() - low).reshape(rows, -1)


def dequantize(packed: torch.Tensor, kind, shape) -> torch.Tensor:
    """A packed weight (:func:`decoderlab.kernels.pack.pack`) of logical ``shape`` (out, in) as float32 (out, in),
    as :func:`dequantize_bytes` dequantizes its GGUF bytes."""
    return dequantize_bytes(unpack(packed, kind, shape), kind)


def dequantize_rows(packed: torch.Tensor, kind, out_features: int, in_features: int, start: int,
                    stop: int) -> torch.Tensor:
    """Rows [start, stop) of a packed (out_features, in_features) weight as float32 (stop - start, in_features),
    :func:`dequantize`'s numbers: only the groups of 16 rows that hold them are unpacked (the op
    ``decoderlab::dequantize`` on this path).

    Raises:
        ValueError: a type that is not a weight block type, a width that is not whole blocks, a packed tensor of
            another size, or rows outside [0, out_features] / a start that is not a multiple of 16 (named)."""
    t, out, inp = check_shape(kind, (out_features, in_features), "packed")
    group = -(-in_features // t.block) * ROWS * t.bytes
    if packed.dtype != torch.uint8 or packed.numel() != -(-out // ROWS) * group:
        raise ValueError(f"a packed {t.name} matrix of shape ({out}, {inp}) is {-(-out // ROWS) * group} uint8 bytes; "
                         f"got {packed.numel()} {packed.dtype}")
    if not (0 <= start <= stop <= out and start % ROWS == 0):
        raise ValueError(f"rows [start, stop) = [{start}, {stop}) must lie in [0, {out}] with start a multiple of "
                         f"{ROWS}")
    part = packed.reshape(-1)[start // ROWS * group:-(-stop // ROWS) * group]
    return dequantize(part, t, (stop - start, inp)) if stop > start else torch.empty(0, inp)
