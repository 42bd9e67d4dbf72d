"""The GGUF header read by decoderlab.gguf.reader equals gguf.GGUFReader's (every metadata field, every
tensor's type, shape and bytes) on files of each architecture and type; damaged files are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from decoderlab.gguf.reader import GGUFFile

gguf = pytest.importorskip("gguf")


def same_as_gguf_reader(path) -> None:
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for k in keys:
        value = theirs.fields[k].contents()
        assert ours.metadata[k] == value, k
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        e = ours.tensors[t.name]
        assert (e.type, e.shape, e.nbytes) == (t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.n_bytes)
        assert np.array_equal(ours.data(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8)), t.name


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("qwen3", "Q4_1"), ("gpt2", "Q8_0"), ("qwen2", "BF16")])
def test_header_equals_gguf_reader(tiny_gguf, arch, qtype):
    path, _ = tiny_gguf(arch, qtype)
    same_as_gguf_reader(path)


def test_real_file_header_equals_gguf_reader(smollm_path):
    same_as_gguf_reader(smollm_path)


@pytest.mark.parametrize("cut", [3, 30, 5000, -1])
def test_truncated_file_is_refused(tiny_gguf, tmp_path, cut):
    path, _ = tiny_gguf("llama")
    data = path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError) as e:
        GGUFFile(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg
    assert ("truncated" in msg) or ("not a GGUF file" in msg)


def test_a_truncated_file_is_named_with_its_size_and_the_bytes_expected_where(tiny_gguf, tmp_path):
    """The message says the file's size, what was being read, how many bytes it needs and at which bytes -- the
    numbers with thousands separators, the last byte the one the field would end at."""
    path, _ = tiny_gguf("llama")
    data = path.read_bytes()
    n_kv = int.from_bytes(data[16:24], "little")
    (tmp_path / "head.gguf").write_bytes(data[:28])  # the first key's length is a u64 at byte 24
    with pytest.raises(ValueError) as e:
        GGUFFile(tmp_path / "head.gguf")
    assert str(e.value) == (f"{tmp_path / 'head.gguf'} is truncated or corrupt: the file is 28 bytes, but its header "
                            f"(metadata entry 1 of {n_kv}) needs 8 bytes at byte 24 (bytes 24 to 31)")
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    cut = int(tokens.offset) + 100  # inside the vocabulary's strings
    (tmp_path / "tokens.gguf").write_bytes(data[:cut])
    with pytest.raises(ValueError, match=rf"the file is {cut:,} bytes, but its header \(metadata key "
                                         r"tokenizer\.ggml\.tokens\) needs \d+ bytes at byte \d+ \(bytes \d+ to \d+\)$"):
        GGUFFile(tmp_path / "tokens.gguf")
    last = reader.tensors[-1]
    start, size = int(last.data_offset), len(data) - 1  # (gguf's offset: from the file's start)
    (tmp_path / "data.gguf").write_bytes(data[:-1])
    with pytest.raises(ValueError) as e:
        GGUFFile(tmp_path / "data.gguf")
    assert str(e.value) == (f"{tmp_path / 'data.gguf'} is truncated or corrupt: the file is {size:,} bytes, but "
                            f"tensor {last.name}'s data needs {last.n_bytes:,} bytes at byte {start:,} (bytes "
                            f"{start:,} to {start + last.n_bytes - 1:,})")


def test_not_gguf_and_bad_version_and_corrupt_count(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama")
    data = bytearray(path.read_bytes())
    cases = {"magic.gguf": b"GGML" + data[4:], "version.gguf": data[:4] + (7).to_bytes(4, "little") + data[8:],
             "count.gguf": data[:8] + (2 ** 40).to_bytes(8, "little") + data[16:]}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(bytes(content))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "magic.gguf")
    with pytest.raises(ValueError, match="GGUF version 7 .*allowed: 2, 3"):
        GGUFFile(tmp_path / "version.gguf")
    with pytest.raises(ValueError, match="corrupt: it claims"):
        GGUFFile(tmp_path / "count.gguf")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_a_released_tensor_reads_back_the_same_bytes(tiny_gguf):
    """release() gives the map's pages back once a loader copied a tensor out (a load's peak then holds the file's
    bytes once); the file is still there, and a later read gets the same bytes."""
    path, _ = tiny_gguf("llama", "Q8_0")
    gf = GGUFFile(path)
    before = {name: np.array(gf.data(name)) for name in gf.tensors}
    for name in gf.tensors:
        gf.release(name)
    for name, data in before.items():
        assert np.array_equal(gf.data(name), data), name
