"""GGML's tensor types that the kernels multiply, as one table: block size, bytes per block, and the 8-bit block
type ggml quantizes a product's activations to for each (its ``vec_dot_type``).

    type   number  block  bytes  activations   a weight
    f32         0      1      4  (float32)     the float itself
    f16         1      1      2  (float32)     IEEE half
    bf16       30      1      2  (bfloat16)    the top 16 bits of a float32
    q4_0        2     32     18  q8_0          d * (q - 8), q a nibble
    q4_1        3     32     20  q8_1          d * q + m
    q5_0        6     32     22  q8_0          d * (q - 16), q 5 bits: a nibble and a bit of qh
    q5_1        7     32     24  q8_1          d * q + m
    q8_0        8     32     34  q8_0          d * q, q an int8
    q4_k       12    256    144  q8_k          d * sc * q - dmin * mn, 8 sub-blocks of 32 with 6-bit sc and mn
    q5_k       13    256    176  q8_k          the same with 5-bit q
    q6_k       14    256    210  q8_k          d * sc * (q - 32), 16 sub-blocks of 16 with int8 sc, 6-bit q
    q8_1        9     32     36  --            an activation block: d * q, and s = d * sum(q)
    q8_k       15    256    292  --            an activation block: float32 d, 256 int8, 16 sums of 16

q5_0 and q5_1 are here because llama.cpp's quantizer writes them in a K-quant file for every matrix whose width is
not a multiple of 256 (Q4_K's fallback is Q5_0, Q5_K's Q5_1, Q6_K's Q8_0: ``llama-quant.cpp``): SmolLM2-135M's
width 576 is one, so its Q4_K_M file holds K-quants only in its 1536-wide down projections.

The 16- and 32-bit weights take no activation blocks: a bf16 weight multiplies the activations rounded to bfloat16
(ggml's vec_dot_type for BF16), f16 and f32 weights the float32 activations as they are (ggml rounds them to
float16 for an F16 weight; the kernels do not, since it buys no speed there). Plain data, no torch.

Source: ggml's ``ggml-common.h`` (the block structs) and ``ggml-cpu.c``'s ``type_traits_cpu`` (each type's
``vec_dot_type``), github.com/ggml-org/ggml; ``gguf.constants.GGML_QUANT_SIZES`` holds the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    """One GGML tensor type.

    Attributes:
        name: lower-case GGML name (``"q4_k"``).
        number: GGML's type number (``gguf.GGMLQuantizationType``'s value).
        block: weights per block (1 for the float types).
        bytes: bytes per block.
        activation: the activation block type a product quantizes its input to (``"q8_0"``, ``"q8_1"``,
            ``"q8_k"``), None for float weights and for the activation types themselves.
    """

    name: str
    number: int
    block: int
    bytes: int
    activation: str | None

    @property
    def quantized(self) -> bool:
        """Whether the type holds blocks of integers (not a float type)."""
        return self.block > 1


#: every type here, by name
TYPES = {t.name: t for t in (
    GGMLType("f32", 0, 1, 4, None),
    GGMLType("f16", 1, 1, 2, None),
    GGMLType("bf16", 30, 1, 2, None),
    GGMLType("q4_0", 2, 32, 18, "q8_0"),
    GGMLType("q4_1", 3, 32, 20, "q8_1"),
    GGMLType("q5_0", 6, 32, 22, "q8_0"),
    GGMLType("q5_1", 7, 32, 24, "q8_1"),
    GGMLType("q8_0", 8, 32, 34, "q8_0"),
    GGMLType("q4_k", 12, 256, 144, "q8_k"),
    GGMLType("q5_k", 13, 256, 176, "q8_k"),
    GGMLType("q6_k", 14, 256, 210, "q8_k"),
    GGMLType("q8_1", 9, 32, 36, None),
    GGMLType("q8_k", 15, 256, 292, None),
)}
#: the block types whose weights the kernels multiply (the others of :data:`TYPES` are float or activation types)
WEIGHT_BLOCK_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
#: the float weight types, by the torch dtype name that holds them
FLOAT_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: the activation block types
ACTIVATION_TYPES = ("q8_0", "q8_1", "q8_k")


def ggml_type(kind) -> GGMLType:
    """The :class:`GGMLType` of ``kind``: a name in any case (``"Q4_K"``), GGML's type number, or a
    ``gguf.GGMLQuantizationType`` member. Raises ``ValueError`` naming it and the types known."""
    if isinstance(kind, GGMLType):
        return kind
    if isinstance(kind, str) and kind.lower() in TYPES:
        return TYPES[kind.lower()]
    if isinstance(kind, int) and not isinstance(kind, bool):
        for t in TYPES.values():
            if t.number == int(kind):
                return t
    shown = getattr(kind, "name", kind)
    raise ValueError(f"GGML type {shown!r} is not one the kernels know; known: {', '.join(TYPES)}")
