"""The type table against gguf's own (GGML_QUANT_SIZES, the type numbers) and ggml's pairing of weight and
activation blocks."""

from __future__ import annotations

import pytest

from decoderlab.kernels import TYPES, ggml_type

gguf = pytest.importorskip("gguf")


def test_block_sizes_bytes_and_numbers_are_ggmls():
    for name, t in TYPES.items():
        member = gguf.GGMLQuantizationType[name.upper()]
        assert t.number == member.value, name
        if name != "q8_1":
            assert (t.block, t.bytes) == gguf.GGML_QUANT_SIZES[member], name
    # gguf-py still lists q8_1 as float32 d and s (40 bytes); ggml-common.h's block_q8_1 holds two float16s and the
    # 32 quants (static_assert sizeof == 2 * sizeof(ggml_half) + QK8_1). It is never in a file: activations only
    assert (TYPES["q8_1"].block, TYPES["q8_1"].bytes) == (32, 2 * 2 + 32)


def test_each_weight_type_pairs_with_ggmls_activation_blocks():
    pairs = {n: t.activation for n, t in TYPES.items()}
    assert pairs == {"f32": None, "f16": None, "bf16": None, "q4_0": "q8_0", "q8_0": "q8_0", "q4_1": "q8_1", "q5_0": "q8_0", "q5_1": "q8_1",
                     "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k", "q8_1": None, "q8_k": None}
    for t in TYPES.values():
        if t.activation:
            assert TYPES[t.activation].block == t.block


def test_a_type_is_named_any_way_and_an_unknown_one_is_refused():
    assert ggml_type("Q4_K") is ggml_type(12) is ggml_type(gguf.GGMLQuantizationType.Q4_K) is TYPES["q4_k"]
    with pytest.raises(ValueError, match=r"'IQ2_XXS'.*known: f32, f16"):
        ggml_type(gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError, match="'q3_k'"):
        ggml_type("q3_k")
