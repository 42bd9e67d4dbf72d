"""The packed layout: the file's bytes moved (unpack gives them back, the size is the file's), 16 rows side by side
as the kernels read them, and shapes that are not whole blocks refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoderlab.kernels import ROWS, TYPES, WEIGHT_BLOCK_TYPES, pack, unpack


def _raw(name: str, out: int, inp: int) -> np.ndarray:
    t = TYPES[name]
    return np.random.default_rng(out).integers(0, 256, size=(out, inp // t.block * t.bytes), dtype=np.uint8)


@pytest.mark.parametrize("name", WEIGHT_BLOCK_TYPES)
def test_unpack_gives_the_files_bytes_back(name):
    block = TYPES[name].block
    for out in (16, 37):
        raw = _raw(name, out, 2 * block)
        packed = pack(raw, name, (out, 2 * block))
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == -(-out // ROWS) * ROWS * raw.shape[1]  # the file's size, rows padded to 16
        assert np.array_equal(unpack(packed, name, (out, 2 * block)).numpy(), raw)


def test_a_q4_0_group_holds_its_rows_scales_then_chunks_side_by_side():
    raw = _raw("q4_0", 16, 64)
    blocks = raw.reshape(16, 2, 18)
    packed = pack(raw, "q4_0", (16, 64)).numpy().reshape(2, 288)  # (block, 16 x 18 bytes)
    for b in range(2):
        assert np.array_equal(packed[b, :32].reshape(16, 2), blocks[:, b, :2])  # the 16 rows' float16 scales
        chunks = packed[b, 32:].reshape(4, 16, 4)  # chunk c: quant bytes 4c..4c+3 of each row
        for c in range(4):
            assert np.array_equal(chunks[c], blocks[:, b, 2 + 4 * c:6 + 4 * c])


def test_q8_0_quants_are_kept_with_their_sign_bit_flipped():
    raw = _raw("q8_0", 16, 32)
    packed = pack(raw, "q8_0", (16, 32)).numpy()
    assert np.array_equal(packed[32:].reshape(8, 16, 4) ^ 0x80, raw[:, 2:].reshape(16, 8, 4).transpose(1, 0, 2))


def test_padding_rows_are_zero_blocks():
    packed = pack(_raw("q4_k", 17, 256), "q4_k", (17, 256))
    assert not unpack(packed, "q4_k", (32, 256))[17:].any()  # the same bytes read as 32 rows


def test_shapes_that_are_not_whole_blocks_or_the_wrong_size_are_refused_by_name():
    with pytest.raises(ValueError, match=r"output\.weight: a q4_k .*multiple of 256.*\(49152, 576\)"):
        pack(np.zeros(10, np.uint8), "q4_k", (49152, 576), name="output.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: a q4_0 matrix of shape \(16, 64\) is 576 bytes; got 575"):
        pack(np.zeros(575, np.uint8), "q4_0", (16, 64), name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="not a block type the kernels multiply"):
        pack(np.zeros(10, np.uint8), "bf16", (5, 1))
    with pytest.raises(ValueError, match="576 uint8 bytes; got 575"):
        unpack(torch.zeros(575, dtype=torch.uint8), "q4_0", (16, 64))


@pytest.mark.parametrize("name", WEIGHT_BLOCK_TYPES)
def test_the_c_plus_plus_byte_moves_give_numpys_bytes(name):
    """kernels.pack moves the fields in the library's C++ (decoderlab::pack_fields) where it loads; the NumPy
    path of kernels.pack.pack gives the same bytes, padding rows included."""
    import importlib

    from decoderlab import kernels

    kernels.load()
    move = kernels.ops._state.get("pack_fields")
    if move is None:
        pytest.skip("the kernels' library is not loaded here")
    numpy_path = importlib.import_module("decoderlab.kernels.pack").pack
    block = TYPES[name].block
    for out in (16, 37):
        raw = _raw(name, out, 3 * block)
        assert torch.equal(numpy_path(raw, name, (out, 3 * block), move=move),
                           numpy_path(raw, name, (out, 3 * block)))


def test_the_byte_move_op_refuses_a_field_outside_the_block():
    from decoderlab import kernels

    kernels.load()
    move = kernels.ops._state.get("pack_fields")
    if move is None:
        pytest.skip("the kernels' library is not loaded here")
    with pytest.raises(ValueError, match=r"field \(30, 8, 4\) does not fit a block of 34 bytes"):
        move(torch.zeros(16 * 34, dtype=torch.uint8), 1, 34, [0, 2, 2, 30, 8, 4])
    with pytest.raises(ValueError, match="whole groups of 16 rows"):
        move(torch.zeros(15 * 34, dtype=torch.uint8), 1, 34, [0, 2, 2])
