"""The ops ``torch.ops.decoderlab.*`` made to exist once per process -- the C++ kernels where they build and the CPU
runs one of their instruction sets, else the portable torch path under the same names -- and the functions that
call them.

The ops (schemas as ``torch.library`` states them; fake implementations registered here, so that
``torch.compile``, ``torch.export`` and AOTInductor trace and call them as any op):

    decoderlab::block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor
    decoderlab::block_linear_many(Tensor x, Tensor[] packed, int[] ggml_types, int[] out_features) -> Tensor[]
    decoderlab::dense_linear(Tensor x, Tensor weight) -> Tensor
    decoderlab::dense_linear_many(Tensor x, Tensor[] weights) -> Tensor[]
    decoderlab::quantize_activation(Tensor x, int ggml_type) -> Tensor
    decoderlab::dequantize(Tensor packed, int ggml_type, SymInt out_features, SymInt in_features, SymInt start,
        SymInt stop) -> Tensor                          (float32 rows [start, stop) of a packed weight)
    decoderlab::kernels_isa(str request) -> str        (the C++ library only)
    decoderlab::kernels_isas() -> str[]                (the C++ library only)

The ``_many`` ops are the products of several weights that share an input (a layer's q, k and v; its gate and up
projections): one call, the input quantized (or rounded to bfloat16) once, the weights' rows split over the
threads together; each output is bit for bit the single op's. A Python call of an op costs microseconds (torch's
dispatch), as much as a small product's arithmetic: the fastest eager call is the bound overload,
``torch.ops.decoderlab.block_linear.default(...)``, or the functions here, which go straight to it.

Which path: ``$DECODERLAB_KERNELS`` = ``auto`` (the default: the best instruction set this CPU runs), ``portable``,
``amx-bf16`` (``avx512-bf16`` with the bfloat16 product by AMX's tiles), ``avx512-bf16`` (AVX512-VNNI with the
bfloat16 product by vdpbf16ps), ``avx512-vnni``, ``avx-vnni`` or ``avx2``;
:func:`set_isa` changes it in a running process, and each function's ``isa=`` argument for one call (the tests'
and benchmarks' way to compare paths). The portable path is said once on standard error, with why.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch

from . import portable
from . import pack as packing
from .pack import check_shape
from .types import TYPES, WEIGHT_BLOCK_TYPES, ggml_type

#: the environment variable that picks the path
ENV = "DECODERLAB_KERNELS"
#: the C++ kernels' instruction sets, best first
ISAS = ("amx-bf16", "avx512-bf16", "avx512-vnni", "avx-vnni", "avx2")
PATHS = ("auto", "portable", *ISAS)
#: the sets whose bfloat16 product multiplies bfloat16 pairs (the activations rounded, as ggml's) in an order that
#: does not follow the batch, for any number of rows
BF16_PAIRS = ("amx-bf16", "avx512-bf16")

_lock = threading.Lock()
_state: dict = {}
_SCHEMAS = {
    "block_linear": "block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor",
    "block_linear_many": "block_linear_many(Tensor x, Tensor[] packed, int[] ggml_types, int[] out_features) "
                         "-> Tensor[]",
    "dense_linear": "dense_linear(Tensor x, Tensor weight) -> Tensor",
    "dense_linear_many": "dense_linear_many(Tensor x, Tensor[] weights) -> Tensor[]",
    "quantize_activation": "quantize_activation(Tensor x, int ggml_type) -> Tensor",
    # SymInt: a compiled graph's row count stays symbolic (with int, a graph per batch size)
    "dequantize": "dequantize(Tensor packed, int ggml_type, SymInt out_features, SymInt in_features, SymInt start, "
                  "SymInt stop) -> Tensor",
}
#: the ops whose C++ is plain (the baseline's instructions): the library's, on every CPU that loads it
_PLAIN = ("dequantize",)
#: every way of naming a weight type (lower and upper case names, GGML's numbers) -> GGML's number
_NUMBERS = {**{k: t.number for k, t in TYPES.items()}, **{k.upper(): t.number for k, t in TYPES.items()},
            **{t.number: t.number for t in TYPES.values()}}
#: the same for the weight block types alone
_WEIGHT_NUMBERS = {k: v for k, v in _NUMBERS.items() if ggml_type(v).name in WEIGHT_BLOCK_TYPES}
#: the bound overloads, once the ops exist
_BOUND: dict = {}


def _portable_ops() -> dict:
    return {
        "block_linear": lambda x, packed, kind, out: portable.block_linear(x, packed, kind, out),
        "block_linear_many": lambda x, packed, kinds, outs: [portable.block_linear(x, p, k, o)
                                                             for p, k, o in zip(packed, kinds, outs, strict=True)],
        "dense_linear": portable.dense_linear,
        "dense_linear_many": lambda x, weights: [portable.dense_linear(x, w) for w in weights],
        "quantize_activation": portable.quantize_activation,
        "dequantize": portable.dequantize_rows,
    }


def _register_portable(define: bool) -> None:
    """The portable path as the ops' implementation: defining them (no C++ library) or for the CPU (a library
    whose kernels this CPU cannot run)."""
    lib = torch.library.Library("decoderlab", "DEF" if define else "IMPL")
    for name, fn in _portable_ops().items():
        if not define and name in _PLAIN:
            continue
        if define:
            lib.define(_SCHEMAS[name])
        lib.impl(name, fn, "CompositeExplicitAutograd" if define else "CPU")
    _state["libraries"].append(lib)


def _register_fakes() -> None:
    def block_fake(x, packed, kind, out):
        return x.new_empty(*x.shape[:-1], out)

    def dense_fake(x, weight):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def quantize_fake(x, kind):
        t = ggml_type(kind)
        return x.new_empty(*x.shape[:-1], x.shape[-1] // t.block * t.bytes, dtype=torch.uint8)

    def block_many_fake(x, packed, kinds, outs):
        return [x.new_empty(*x.shape[:-1], out) for out in outs]

    def dense_many_fake(x, weights):
        return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]

    def dequantize_fake(packed, kind, out, inp, start, stop):
        return packed.new_empty(stop - start, inp, dtype=torch.float32)

    for name, fn in (("dequantize", dequantize_fake), ("block_linear", block_fake),
                     ("block_linear_many", block_many_fake),
                     ("dense_linear", dense_fake), ("dense_linear_many", dense_many_fake),
                     ("quantize_activation", quantize_fake)):
        torch.library.register_fake(f"decoderlab::{name}", fn)


def _say_portable(why: str) -> None:
    print(f"decoderlab: products use the portable torch path ({why})", file=sys.stderr)


def _load() -> None:
    """Set ``_state["mode"]`` (``"native"`` or ``"portable"``) as soon as the ops exist, then take the chosen path."""
    choice = (os.environ.get(ENV) or "auto").strip().lower()
    if choice not in PATHS:
        raise ValueError(f"{ENV}={choice!r} is not a kernel path; allowed: {', '.join(PATHS)}")
    _state["libraries"] = []
    from .build import library  # not at import: `python -m decoderlab.kernels.build` imports this package first

    path, why = (None, f"{ENV}=portable") if choice == "portable" else library()
    if path is not None:
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:  # a library that does not load (another torch's symbols, say)
            path, why = None, f"the kernels' library {path} did not load: {str(e).splitlines()[0]}"
    if path is None:
        _register_portable(define=True)
        _state["mode"] = "portable"
    else:
        _state["mode"] = "native"
        if not list(torch.ops.decoderlab.kernels_isas()):
            _register_portable(define=False)
            _state["mode"], why = "portable", "this CPU lacks AVX2, FMA or F16C"
    _register_fakes()
    _state["pack_fields"] = torch.ops.decoderlab.pack_fields.default if path is not None else None
    if _state["mode"] == "portable":
        _say_portable(why)
    elif choice != "auto":
        torch.ops.decoderlab.kernels_isa(choice)  # ValueError for a set this CPU does not run
    _BOUND.update({name: getattr(torch.ops.decoderlab, name).default for name in _SCHEMAS})


def pack(raw, kind, shape, name: str = "weight") -> torch.Tensor:
    """:func:`decoderlab.kernels.pack.pack` -- a GGUF block tensor's bytes in the kernels' layout, a 1-D uint8
    tensor -- with its byte moves in the library's C++ where it loads (Gemma 3's 180 MB q8_0 embedding: 0.54 s
    in NumPy); the same bytes either way.

    Raises:
        ValueError: as :func:`decoderlab.kernels.pack.pack`."""
    load()
    return packing.pack(raw, kind, shape, name, move=_state.get("pack_fields"))


def load() -> str:
    """Make the ops exist in this process (building the kernels on first use); returns the path in use:
    ``"portable"`` or the instruction set's name.

    Raises:
        ValueError: ``$DECODERLAB_KERNELS`` names no path, or an instruction set this CPU does not run."""
    with _lock:
        if "mode" not in _state:
            _load()
    return isa()


def isa() -> str:
    """The path the ops take now: ``"portable"`` or the instruction set's name (``"avx512-vnni"``...)."""
    if "mode" not in _state:
        return load()
    if _state["mode"] == "portable":
        return "portable"
    return str(torch.ops.decoderlab.kernels_isa(""))


def available_isas() -> list[str]:
    """The paths this process can take: ``"portable"`` and the instruction sets the CPU runs, best first."""
    load()
    native = list(torch.ops.decoderlab.kernels_isas()) if _state["mode"] == "native" else []
    return [*native, "portable"]


def set_isa(name: str) -> str:
    """Make the ops take instruction set ``name`` (or ``"auto"``, the best); returns the one taken before.

    Raises:
        ValueError: a name this CPU (or a process on the portable path) cannot take, naming those it can."""
    before = load()
    if name == before:
        return before
    if _state["mode"] != "native" or name == "portable":
        raise ValueError(f"the ops cannot switch to {name!r} here; this process's path is {before!r} "
                         f"(set {ENV} before the first product to choose it)")
    torch.ops.decoderlab.kernels_isa(name)
    return before


@contextmanager
def _using(name: str | None):
    if name is None:
        yield
        return
    before = set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


def block_linear(x: torch.Tensor, packed: torch.Tensor, kind, out_features: int, *, isa: str | None = None):
    """``x @ W.T`` for a block weight in the kernels' layout (:func:`decoderlab.kernels.pack`): float32 ``x``
    (..., in) -> float32 (..., out_features). ``x`` is quantized to the type's activation blocks (q8_0 / q8_1 /
    q8_k) as ggml does, the blocks multiplied in integers, then scaled.

    Args:
        kind: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k (name or GGML number).
        isa: this call's path (``"portable"``, ``"avx2"`` ...); None = the process's.

    Raises:
        ValueError: an unknown type, a width that is not whole blocks, a packed tensor of another size, a path
            this CPU does not run."""
    op, number = _BOUND.get("block_linear"), _NUMBERS.get(kind)
    if isa is None and op is not None and number is not None:  # the hot path: no Python work but the call
        return op(x, packed, number, out_features)
    t = ggml_type(kind)
    if isa == "portable":
        return portable.block_linear(x, packed, t, out_features)
    load()
    with _using(isa):
        return torch.ops.decoderlab.block_linear(x, packed, t.number, out_features)


def block_linear_many(x: torch.Tensor, packed, kinds, out_features, *, isa: str | None = None) -> list:
    """``[x @ W.T for each W]`` for block weights that share the input ``x`` (q, k and v; gate and up): one call,
    ``x`` quantized once per activation type, each output equal to :func:`block_linear`'s bit for bit.

    Args:
        packed: the weights in the kernels' layout, a sequence.
        kinds: each weight's type (name or GGML number), a sequence as long.
        out_features: each weight's out, a sequence as long.
        isa: as for :func:`block_linear`.

    Raises:
        ValueError: sequences of different lengths, or as :func:`block_linear` for any weight."""
    op = _BOUND.get("block_linear_many")
    numbers = [_NUMBERS.get(k) for k in kinds]
    if isa is None and op is not None and None not in numbers:
        return op(x, list(packed), numbers, list(out_features))
    numbers = [ggml_type(k).number for k in kinds]
    if not len(packed) == len(numbers) == len(out_features):
        raise ValueError(f"block_linear_many: one type and one out_features per weight; got {len(packed)} weights, "
                         f"{len(numbers)} types, {len(out_features)} out_features")
    if isa == "portable":
        return [portable.block_linear(x, p, k, o) for p, k, o in zip(packed, numbers, out_features)]
    load()
    with _using(isa):
        return torch.ops.decoderlab.block_linear_many(x, list(packed), numbers, list(out_features))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, *, isa: str | None = None):
    """``x @ W.T`` for a float32 / float16 / bfloat16 weight (out, in), float32 ``x`` (..., in) -> float32
    (..., out); the weight is widened to float32 exactly, the products accumulated in float32. A bfloat16 weight
    multiplies ``x`` rounded to bfloat16 (to nearest, ties to even), as ggml's (its vec_dot_type for BF16 is
    BF16); a float16 or float32 weight multiplies ``x`` as it is (ggml rounds it to float16 for a float16 weight).
    ``isa`` as for :func:`block_linear`.

    Raises:
        ValueError: another dtype or a weight whose width is not x's."""
    op = _BOUND.get("dense_linear")
    if isa is None and op is not None:
        return op(x, weight)
    if isa == "portable":
        return portable.dense_linear(x, weight)
    load()
    with _using(isa):
        return torch.ops.decoderlab.dense_linear(x, weight)


def dense_linear_many(x: torch.Tensor, weights, *, isa: str | None = None) -> list:
    """``[x @ W.T for each W]`` for 16/32-bit weights that share the input ``x``: one call, each output equal to
    :func:`dense_linear`'s bit for bit. ``isa`` as for :func:`block_linear`.

    Raises:
        ValueError: no weights, or as :func:`dense_linear` for any weight."""
    op = _BOUND.get("dense_linear_many")
    if isa is None and op is not None:
        return op(x, list(weights))
    if isa == "portable":
        return [portable.dense_linear(x, w) for w in weights]
    load()
    with _using(isa):
        return torch.ops.decoderlab.dense_linear_many(x, list(weights))


def quantize_activation(x: torch.Tensor, kind, *, isa: str | None = None):
    """ggml's block bytes of float32 ``x`` (..., k) quantized to ``kind`` = q8_0, q8_1 or q8_k: uint8 (..., k /
    block * block bytes) -- what a product of a weight type pairing with it multiplies (:data:`TYPES`).

    Raises:
        ValueError: another type, or a width that is not whole blocks."""
    t = ggml_type(kind)
    if t.name not in ("q8_0", "q8_1", "q8_k"):
        raise ValueError(f"{t.name} is not an activation type; allowed: q8_0, q8_1, q8_k")
    if isa == "portable":
        return portable.quantize_activation(x, t)
    load()
    with _using(isa):
        return torch.ops.decoderlab.quantize_activation(x, t.number)


def dequantize(packed: torch.Tensor, kind, shape, start: int = 0, stop: int | None = None, *,
               isa: str | None = None) -> torch.Tensor:
    """Rows [start, stop) of a packed block weight (:func:`decoderlab.kernels.pack`) of logical ``shape`` (out, in)
    as float32 (stop - start, in) -- ``gguf.quants``' numbers bit for bit (:func:`portable.dequantize`'s), read
    from the packed bytes by the C++ op (~0.3-0.5 ns a weight on one AVX2 core, against ~5 for the torch path).
    ``stop`` None = out. A weight on another device, or ``isa="portable"``, takes the torch path.

    Raises:
        ValueError: a type that is not a weight block type, a width that is not whole blocks, a packed tensor of
            another size, rows outside [0, out] or a ``start`` that is not a multiple of 16 (the values named)."""
    out, inp = shape  # (no int(): a compiled graph's symbolic row count stays symbolic)
    stop = out if stop is None else stop
    op, number = _BOUND.get("dequantize"), _WEIGHT_NUMBERS.get(kind)
    if isa is None and op is not None and number is not None and packed.device.type == "cpu":
        return op(packed, number, out, inp, start, stop)
    t = ggml_type(kind)
    if t.name not in WEIGHT_BLOCK_TYPES:
        check_shape(t, (1, t.block), "packed")  # the one error naming the block types
    if isa == "portable" or packed.device.type != "cpu":
        return portable.dequantize_rows(packed, t, out, inp, start, stop)
    load()
    with _using(isa):
        return torch.ops.decoderlab.dequantize(packed, t.number, out, inp, start, stop)


__all__ = ["ENV", "ISAS", "PATHS", "TYPES", "available_isas", "block_linear", "block_linear_many", "dense_linear",
           "dense_linear_many", "dequantize", "isa", "load", "quantize_activation", "set_isa"]
