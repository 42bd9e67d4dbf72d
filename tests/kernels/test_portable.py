"""The portable path's own parts: its quantizers against ggml's scalar reference (gguf.quants' Q8_0, which rounds
half away from zero and scales by 1 / d), and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoderlab.kernels import portable

gguf = pytest.importorskip("gguf")


def test_q8_0_differs_from_ggmls_scalar_reference_only_by_one_at_rounding_ties():
    """The x86 backend's q = round-half-even(x * (127 / amax)) and the reference's round-half-away(x * (1 / d)) are
    one quant apart where x * scale falls on (or within an ulp of) a half; the scales are the same bytes."""
    x = torch.randn(64, 1024) * 3
    ours = portable.quantize_activation(x, "q8_0").numpy().reshape(-1, 34)
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert np.array_equal(ours[:, :2], ref[:, :2])
    diff = ours[:, 2:].view(np.int8).astype(int) - ref[:, 2:].view(np.int8).astype(int)
    assert np.abs(diff).max() <= 1 and (diff != 0).mean() < 1e-3


def test_q8_k_takes_the_first_value_of_largest_magnitude():
    x = torch.zeros(1, 256)
    x[0, 3], x[0, 7] = -2.0, 2.0  # the first, -2, sets the sign: the scale is -127 / -2
    q, d, sums = portable.quantize256(x)
    assert q[0, 0, 3] == -127 and q[0, 0, 7] == 127 and d[0, 0] == pytest.approx(2 / 127)
    assert sums[0, 0].tolist() == [-127 + 127] + [0] * 15


def test_inputs_that_are_not_whole_blocks_or_float32_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        portable.quantize_activation(torch.zeros(2, 48), "q8_0")
    with pytest.raises(ValueError, match="float32"):
        portable.quantize_activation(torch.zeros(2, 64, dtype=torch.float64), "q8_1")
    with pytest.raises(ValueError, match="not an activation type"):
        portable.quantize_activation(torch.zeros(2, 64), "q4_0")
