"""The weight files read in place (decoderlab.hf.weights): the tensors safetensors' own reader gives, as views of
the mapped file; each damaged header named with its file."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoderlab.hf.weights import WeightFiles, write_safetensors


@pytest.fixture
def tensors():
    torch.manual_seed(0)
    return {"a.weight": torch.randn(7, 5), "b.bias": torch.randn(3).to(torch.bfloat16),
            "c": torch.randn(2, 3, 4).to(torch.float16), "empty": torch.zeros(0, 4)}


def test_views_hold_what_safetensors_reads(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = WeightFiles(tmp_path)
    want = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(files.names()) == sorted(want)
    for name, t in want.items():
        assert files.shape(name) == tuple(t.shape) and files.dtype(name) == t.dtype
        assert torch.equal(files.view(name), t)
        files.release(name)  # its pages go; reading again reads the file again
        assert torch.equal(files.view(name), t)
    assert files.where("c") == str(tmp_path / "model.safetensors")


def test_a_state_dict_reads_the_same_way(tensors):
    files = WeightFiles.of_state(tensors, "my state")
    assert files.view("a.weight") is tensors["a.weight"] and files.where("a.weight") == "my state"
    with pytest.raises(TypeError, match=r"my state: value of 'x' is a list, not a tensor"):
        WeightFiles.of_state({"x": [1.0]}, "my state")


def test_the_writer_writes_what_the_reader_reads(tmp_path, tensors):
    write_safetensors(tmp_path / "model.safetensors", {"t": tensors["a.weight"].t()})  # not contiguous: made so
    assert torch.equal(WeightFiles(tmp_path).view("t"), tensors["a.weight"].t())


def header_file(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_damaged_files_are_named(tmp_path):
    path = tmp_path / "model.safetensors"
    cases = [
        (b"abc", "shorter than its 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "its header length 1000 runs past the end of the file's 10 bytes"),
        (struct.pack("<Q", 3) + b"{{{", "its header is not JSON"),
    ]
    for data, words in cases:
        path.write_bytes(data)
        with pytest.raises(ValueError, match=words):
            WeightFiles(tmp_path)
    header_file(path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(ValueError, match=r"tensor 'x' \(F32, shape \(4,\)\) has data_offsets \[0, 16\] that do not "
                                         r"fit its size or the file's"):
        WeightFiles(tmp_path)
    header_file(path, {"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="tensor 'x' has dtype I64; allowed: F32, BF16, F16"):
        WeightFiles(tmp_path)
    header_file(path, {"x": {"dtype": "F32"}})
    with pytest.raises(ValueError, match="tensor 'x' has no valid dtype, shape and data_offsets"):
        WeightFiles(tmp_path)


def test_an_index_that_is_not_one(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a sharded index"):
        WeightFiles(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"shard \.\./elsewhere\.safetensors \(holding 'x'\) is missing"):
        WeightFiles(tmp_path)


def test_no_weights_names_the_three_files_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no weights file; expected model.safetensors, "
                                                "model.safetensors.index.json .with its shards. or pytorch_model.bin"):
        WeightFiles(tmp_path)
