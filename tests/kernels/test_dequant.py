"""decoderlab::dequantize (csrc/dequant.cpp, and the portable path's op): rows [start, stop) of a packed weight
equal gguf.quants' dequantization bit for bit -- and so portable.dequantize's -- for every block type, on random
blocks of every bit pattern, ranges that start inside the matrix and end inside a group, a row count that is no
multiple of 16; bad types, shapes and ranges refused naming the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from decoderlab import kernels
from decoderlab.kernels import portable

from ggml_reference import QTYPE, weight

gguf = pytest.importorskip("gguf")

SRC = str(Path(__file__).resolve().parents[2] / "src")
#: (start, stop) rows of a 40-row matrix: all, from the second group, ending inside a group, inside the last
#: (padded) group, one row, none
RANGES = ((0, 40), (16, 40), (16, 33), (32, 37), (0, 1), (16, 16))


def _random_blocks(name: str, out: int, inp: int, rng) -> np.ndarray:
    """GGUF bytes (out, row bytes) of random blocks: every quant bit pattern (q8_0's -128 included), scales and
    minimums float16 of both signs, zero and subnormal among them."""
    t = kernels.TYPES[name]
    raw = rng.integers(0, 256, size=(out, inp // t.block, t.bytes), dtype=np.uint8)
    fields = (208,) if name == "q6_k" else (0, 2) if name in ("q4_1", "q5_1", "q4_k", "q5_k") else (0,)
    for at in fields:
        scale = rng.uniform(-2, 2, size=raw.shape[:2]) * 10.0 ** rng.integers(-9, 1, size=raw.shape[:2])
        scale.flat[:3] = (0.0, 5.96e-8, -3e-6)  # zero, the smallest subnormal, a subnormal
        raw[..., at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def _cases(name: str):
    rng = np.random.default_rng(sum(map(ord, name)))
    block = kernels.TYPES[name].block
    for make in (weight, _random_blocks):
        for out, inp in ((40, 3 * block), (16, block)):
            yield make(name, out, inp, rng), out, inp


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("name", kernels.WEIGHT_BLOCK_TYPES)
def test_rows_are_gguf_quants_dequantization_bit_for_bit(name, path):
    isa = "portable" if path == "portable" else None
    if isa is None and kernels.load() == "portable":
        pytest.skip("no C++ kernels on this machine: the op is the portable path's")
    for raw, out, inp in _cases(name):
        packed = kernels.pack(raw, name, (out, inp))
        want = torch.from_numpy(gguf.quants.dequantize(raw, QTYPE[name]).astype(np.float32))
        assert torch.equal(portable.dequantize(packed, name, (out, inp)), want)
        for start, stop in RANGES if out == 40 else ((0, 16), (0, 5)):
            got = kernels.dequantize(packed, name, (out, inp), start, stop, isa=isa)
            assert got.dtype == torch.float32 and got.shape == (stop - start, inp)
            assert torch.equal(got, want[start:stop]), f"{name} {path} rows [{start}, {stop}) of ({out}, {inp})"


def test_one_and_two_threads_give_the_same_bits():
    raw = weight("q4_k", 256, 512, np.random.default_rng(3))
    packed = kernels.pack(raw, "q4_k", (256, 512))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.dequantize(packed, "q4_k", (256, 512))
        torch.set_num_threads(2)
        two = kernels.dequantize(packed, "q4_k", (256, 512))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("path", ["native", "portable"])
def test_bad_types_shapes_and_ranges_are_refused_naming_the_value(path):
    isa = "portable" if path == "portable" else None
    packed = kernels.pack(weight("q4_1", 40, 64, np.random.default_rng(4)), "q4_1", (40, 64))
    with pytest.raises(ValueError, match="q8_1"):
        kernels.dequantize(packed, "q8_1", (40, 64), isa=isa)
    with pytest.raises(ValueError, match=r"\(40, 48\)"):
        kernels.dequantize(packed, "q4_1", (40, 48), isa=isa)
    with pytest.raises(ValueError, match="1920 .*got 1600"):
        kernels.dequantize(packed[:1600], "q4_1", (40, 64), isa=isa)
    for start, stop in ((8, 24), (0, 41), (32, 16), (-16, 8)):
        with pytest.raises(ValueError, match=rf"\[{start}, {stop}\).*\[0, 40\].*16"):
            kernels.dequantize(packed, "q4_1", (40, 64), start, stop, isa=isa)
    if isa is None:
        with pytest.raises(ValueError, match="GGML type 99"):
            torch.ops.decoderlab.dequantize(packed, 99, 40, 64, 0, 40)


def test_the_op_traces_under_the_fake_tensor_checks():
    packed = kernels.pack(weight("q6_k", 40, 256, np.random.default_rng(5)), "q6_k", (40, 256))
    kernels.load()
    torch.library.opcheck(torch.ops.decoderlab.dequantize.default, (packed, 14, 40, 256, 16, 37),
                          test_utils=("test_schema", "test_faketensor"))


PORTABLE = """
import numpy as np, torch
from decoderlab import kernels
from decoderlab.kernels import portable
raw = np.random.default_rng(0).integers(0, 256, size=(37, 2 * 144), dtype=np.uint8)
raw.reshape(37, 2, 144)[..., :4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
packed = kernels.pack(raw, "q4_k", (37, 512))
kernels.load()
got = torch.ops.decoderlab.dequantize(packed, 12, 37, 512, 16, 37)
assert torch.equal(got, portable.dequantize(packed, "q4_k", (37, 512))[16:37])
try:
    torch.ops.decoderlab.dequantize(packed, 12, 37, 512, 8, 37)
except ValueError as e:
    print("refused:", e)
print(kernels.isa())
"""


def test_the_portable_paths_op_is_the_same(tmp_path):
    """DECODERLAB_KERNELS=portable: the op exists (the torch path's), gives the same rows and refuses the same."""
    env = {**os.environ, "PYTHONPATH": SRC, "DECODERLAB_KERNELS": "portable", "DECODERLAB_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", PORTABLE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["refused: rows [start, stop) = [8, 37) must lie in [0, 37] with start a "
                                     "multiple of 16", "portable"]
