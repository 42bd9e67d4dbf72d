"""Atomic writes (decoderlab.files): an error names the path the caller gave, never the temporary stand-in,
and leaves no temporary file behind."""

from __future__ import annotations

import os

import pytest

from decoderlab.files import atomic_write_chunks, atomic_write_text, naming, temporary_directory

LINUX_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


@LINUX_PROC
def test_a_file_that_cannot_be_made_is_named_as_given():
    """atomic_write_* named its mkstemp file: "No such file or directory: '/proc/.x.png.zc_2ge_d.tmp'"."""
    with pytest.raises(FileNotFoundError) as info:
        atomic_write_text("/proc/x.png", "x")
    assert info.value.filename == "/proc/x.png" and str(info.value).endswith(": '/proc/x.png'")


@LINUX_PROC
def test_a_directory_that_cannot_be_made_is_named_as_given():
    with pytest.raises(FileNotFoundError) as info:
        temporary_directory("/proc/ckpt")
    assert info.value.filename == "/proc/ckpt"


def test_a_failed_replace_names_the_path_and_leaves_nothing(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").write_text("x")
    with pytest.raises(OSError) as info:
        atomic_write_text(tmp_path / "taken", "text")  # a non-empty directory is in the way
    assert info.value.filename == str(tmp_path / "taken") and info.value.filename2 is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_error_about_another_file_is_kept(tmp_path):
    """An OSError raised by the data being written (it names its own file) is not renamed."""
    def chunks():
        yield b"a"
        raise FileNotFoundError(2, "No such file or directory", "/data/elsewhere")

    with pytest.raises(FileNotFoundError) as info:
        atomic_write_chunks(tmp_path / "out.bin", chunks())
    assert info.value.filename == "/data/elsewhere"
    assert list(tmp_path.iterdir()) == []
    e = OSError(5, "Input/output error")
    plain = OSError("no errno")
    assert naming("/x", e).filename == "/x" and naming("/x", plain) is plain
