"""ggml's definitions written again in numpy, for the kernel tests: the activation quantizers (ggml-cpu's x86
quantize_row_q8_0 / _q8_1, and quantize_row_q8_K_ref), weights of every block type (gguf.quants' quantizers where
it has them, random valid blocks otherwise), and the float64 reference product with its float32 error bound."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from decoderlab.kernels import TYPES  # noqa: E402

F32 = np.float32
#: float32's unit roundoff
U = 2.0 ** -24
QTYPE = {name: Q[name.upper()] for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")}


def q8_32(x: np.ndarray, with_sum: bool) -> np.ndarray:
    """ggml-cpu's x86 quantize_row_q8_0 (with_sum False) / quantize_row_q8_1 (True) of float32 rows (n, k): the
    block bytes (n, k / 32 * 34 or 36). amax / 127 as float16; round-half-even(x * (127 / amax)); q8_1's s =
    float16(d * sum(q)) with the float32 d."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * inverse[..., None]).astype(np.int8)
    parts = [d.astype(np.float16)[..., None].view(np.uint8)]
    if with_sum:
        s = (d * q.sum(-1, dtype=np.int32).astype(F32)).astype(np.float16)
        parts.append(s[..., None].view(np.uint8))
    parts.append(q.view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(x.shape[0], -1)


def q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref of float32 rows (n, k): the block bytes (n, k / 256 * 292): the first value of
    largest magnitude m, iscale = -127 / m, q = min(127, round-half-even(iscale x)), d = 1 / iscale (float32), the
    int16 sums of each 16 quants (a block of zeros: all zero)."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 256)
    peak = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    some = peak != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(some, F32(-127) / peak, F32(0)).astype(F32)
        d = np.where(some, F32(1) / iscale, F32(0)).astype(F32)
    q = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int8)
    sums = q.reshape(*q.shape[:-1], 16, 16).sum(-1, dtype=np.int16)
    parts = [d[..., None].view(np.uint8), q.view(np.uint8), sums.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(x.shape[0], -1)


def activation_bytes(x: np.ndarray, kind: str) -> np.ndarray:
    return {"q8_0": lambda: q8_32(x, False), "q8_1": lambda: q8_32(x, True), "q8_k": lambda: q8_k(x)}[kind]()


def dequantized_activation(x: np.ndarray, kind: str) -> np.ndarray:
    """float64 rows of d * q of ``x`` quantized to ``kind`` (the float16 d of q8_0 / q8_1, q8_k's float32 d)."""
    raw = activation_bytes(x, kind)
    t = TYPES[kind]
    blocks = raw.reshape(-1, t.bytes)
    if kind == "q8_k":
        d, q = blocks[:, :4].copy().view(F32), blocks[:, 4:260].view(np.int8)
    else:
        d, q = blocks[:, :2].copy().view(np.float16), blocks[:, -32:].view(np.int8)
    return (d.astype(np.float64) * q.astype(np.float64)).reshape(x.shape[0], -1)


def _set_f16(raw: np.ndarray, at: int, values: np.ndarray) -> None:
    raw[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)


def weight(name: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes (out, bytes per row) of a random (out, inp) weight: gguf.quants.quantize of normal floats for
    the types gguf's Python package quantizes (q8_0, q4_0, q4_1, q5_0, q5_1), else random bytes with finite float16 scales
    (every bit pattern of the other fields is a valid K-quant block; gguf.quants only dequantizes them)."""
    t = TYPES[name]
    if t.block == 32:
        return quants.quantize(rng.standard_normal((out, inp)).astype(F32), QTYPE[name])
    raw = rng.integers(0, 256, size=(out, inp // 256, t.bytes), dtype=np.uint8)
    scale = lambda: rng.uniform(-2, 2, size=raw.shape[:2]) * 1e-3  # noqa: E731
    for at in ((208,) if name == "q6_k" else (0, 2)):
        _set_f16(raw, at, scale())
    return raw.reshape(out, -1)


def dequantized(name: str, raw: np.ndarray) -> np.ndarray:
    return quants.dequantize(raw, QTYPE[name]).astype(np.float64)


def _quants_zeroed(name: str, raw: np.ndarray) -> np.ndarray:
    """The blocks with every quant bit zero (scales kept): what a weight is before its quants' part."""
    t = TYPES[name]
    blocks = raw.reshape(raw.shape[0], -1, t.bytes).copy()
    spans = {"q8_0": (2, 34), "q4_0": (2, 18), "q4_1": (4, 20), "q5_0": (2, 22), "q5_1": (4, 24),
             "q4_k": (16, 144), "q5_k": (16, 176),
             "q6_k": (0, 192)}
    lo, hi = spans[name]
    blocks[..., lo:hi] = 0
    return blocks.reshape(raw.shape)


def reference(name: str, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 product of gguf.quants' dequantized weight and the dequantized quantized activations, the
    float32 error bound of the kernels' sums): bound = (2 blocks + 6) u M, M = (|A| + |B|) @ |xq| where the weight
    W = A + B splits into its quants' part A and the part B a block has with its quants zero (q4_0's -8 d, q5_0's
    -16 d, q4_1's and q5_1's m, the K-quants' minimums, q6_k's -32 d sc) -- each block adds at most two float32 terms into a lane, each
    term carries the rounding of its scale product and of its converted integer sum, gguf's float32 W its own."""
    act = TYPES[name].activation
    xq = dequantized_activation(x, act)
    w = dequantized(name, raw)
    b = dequantized(name, _quants_zeroed(name, raw))
    m = np.abs(xq) @ (np.abs(w - b) + np.abs(b)).T
    blocks = raw.shape[1] // TYPES[name].bytes
    return xq @ w.T, (2 * blocks + 6) * U * m
