"""The ops ``torch.ops.decoderlab.*`` made to exist once per process -- the C++ kernels where they build and the CPU
runs one of their instruction sets, else the portable torch path under the same names -- and the functions that
call them.

The ops (schemas as ``torch.library`` states them; fake implementations registered here, so that
``torch.compile``, ``torch.export`` and AOTInductor trace and call them as any op):

    decoderlab::block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor
    decoderlab::dense_linear(Tensor x, Tensor weight) -> Tensor
    decoderlab::quantize_activation(Tensor x, int ggml_type) -> Tensor
    decoderlab::kernels_isa(str request) -> str        (the C++ library only)
    decoderlab::kernels_isas() -> str[]                (the C++ library only)

Which path: ``$DECODERLAB_KERNELS`` = ``auto`` (the default: the best instruction set this CPU runs), ``portable``,
``avx2``, ``avx-vnni`` or ``avx512-vnni``; :func:`set_isa` changes it in a running process, and each function's
``isa=`` argument for one call (the tests' and benchmarks' way to compare paths). The portable path is said once
on standard error, with why.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch

from . import portable
from .types import TYPES, ggml_type

#: the environment variable that picks the path
ENV = "DECODERLAB_KERNELS"
#: the C++ kernels' instruction sets, best first
ISAS = ("avx512-vnni", "avx-vnni", "avx2")
PATHS = ("auto", "portable", *ISAS)

_lock = threading.Lock()
_state: dict = {}
_SCHEMAS = {
    "block_linear": "block_linear(Tensor x, Tensor packed, int ggml_type, int out_features) -> Tensor",
    "dense_linear": "dense_linear(Tensor x, Tensor weight) -> Tensor",
    "quantize_activation": "quantize_activation(Tensor x, int ggml_type) -> Tensor",
}


def _portable_ops() -> dict:
    return {
        "block_linear": lambda x, packed, kind, out: portable.block_linear(x, packed, kind, out),
        "dense_linear": portable.dense_linear,
        "quantize_activation": portable.quantize_activation,
    }


def _register_portable(define: bool) -> None:
    """The portable path as the ops' implementation: defining them (no C++ library) or for the CPU (a library
    whose kernels this CPU cannot run)."""
    lib = torch.library.Library("decoderlab", "DEF" if define else "IMPL")
    for name, fn in _portable_ops().items():
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

    for name, fn in (("block_linear", block_fake), ("dense_linear", dense_fake),
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
    if _state["mode"] == "portable":
        _say_portable(why)
    elif choice != "auto":
        torch.ops.decoderlab.kernels_isa(choice)  # ValueError for a set this CPU does not run


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
        kind: q8_0, q4_0, q4_1, q4_k, q5_k or q6_k (name or GGML number).
        isa: this call's path (``"portable"``, ``"avx2"`` ...); None = the process's.

    Raises:
        ValueError: an unknown type, a width that is not whole blocks, a packed tensor of another size, a path
            this CPU does not run."""
    t = ggml_type(kind)
    if isa == "portable":
        return portable.block_linear(x, packed, t, out_features)
    load()
    with _using(isa):
        return torch.ops.decoderlab.block_linear(x, packed, t.number, out_features)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, *, isa: str | None = None):
    """``x @ W.T`` for a float32 / float16 / bfloat16 weight (out, in), float32 ``x`` (..., in) -> float32
    (..., out); the weight is widened to float32 exactly, the products accumulated in float32 (no activation
    quantization). ``isa`` as for :func:`block_linear`.

    Raises:
        ValueError: another dtype or a weight whose width is not x's."""
    if isa == "portable":
        return portable.dense_linear(x, weight)
    load()
    with _using(isa):
        return torch.ops.decoderlab.dense_linear(x, weight)


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


__all__ = ["ENV", "ISAS", "PATHS", "TYPES", "available_isas", "block_linear", "dense_linear", "isa", "load",
           "quantize_activation", "set_isa"]
