"""The build: one compile however many processes ask at once (a file lock), a cache key that follows the sources,
and a failure that is one line and the portable path -- never a broken import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from decoderlab.kernels import build

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _fake_builds(monkeypatch, tmp_path) -> list:
    """A build that takes a while and writes the library; returns the list each build appends to."""
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "unsupported", lambda: None)
    monkeypatch.setattr(build, "compiler", lambda: "/nonexistent/c++")
    builds = []

    def slow_build(cxx, target):
        builds.append(target)
        time.sleep(0.5)
        target.write_bytes(b"library")

    monkeypatch.setattr(build, "_build", slow_build)
    return builds


def test_two_callers_at_once_build_once(monkeypatch, tmp_path):
    builds = _fake_builds(monkeypatch, tmp_path)
    found = []
    callers = [threading.Thread(target=lambda: found.append(build.library())) for _ in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert len(builds) == 1
    assert found[0] == found[1] and found[0][0].read_bytes() == b"library"
    assert found[0][0].parent.parent == tmp_path / "kernels"


def test_a_built_library_is_found_again_and_force_builds_anew(monkeypatch, tmp_path):
    builds = _fake_builds(monkeypatch, tmp_path)
    first, _ = build.library()
    again, _ = build.library()
    assert again == first and len(builds) == 1
    build.library(force=True)
    assert len(builds) == 2


def test_the_key_follows_the_sources_and_the_flags(monkeypatch, tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    key = build.fingerprint("/nonexistent/c++")
    assert build.fingerprint("/nonexistent/c++") == key
    (copy / "block_kernels.h").write_text((copy / "block_kernels.h").read_text() + "\n// edited\n")
    edited = build.fingerprint("/nonexistent/c++")
    assert edited != key
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-g"))
    assert build.fingerprint("/nonexistent/c++") not in (key, edited)


def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": SRC, "DECODERLAB_CACHE": str(tmp_path), **env}
    if "DECODERLAB_KERNELS" not in env:
        environ.pop("DECODERLAB_KERNELS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)


PRODUCT = """
import numpy as np, torch
from decoderlab import kernels
from decoderlab.kernels import portable
raw = np.random.default_rng(0).integers(0, 256, size=(16, 2 * 20), dtype=np.uint8)
raw.reshape(16, 2, 20)[..., :4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
packed = kernels.pack(raw, "q4_1", (16, 64))
x = torch.randn(2, 64)
y = kernels.block_linear(x, packed, "q4_1", 16)
y = kernels.block_linear(x, packed, "q4_1", 16)
assert torch.allclose(y, portable.block_linear(x, packed, "q4_1", 16))
print(kernels.isa())
"""


@pytest.mark.skipif(build.unsupported() is not None, reason="no kernels to build on this machine")
def test_a_failed_build_is_one_line_and_the_portable_path(tmp_path):
    r = _python(PRODUCT, tmp_path, CXX=shutil.which("false") or "false")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "portable"
    said = [line for line in r.stderr.splitlines() if "portable" in line]
    assert len(said) == 1 and "did not compile" in said[0] and "build.log" in said[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(build.unsupported() is not None, reason="no kernels to build on this machine")
def test_a_cached_library_that_does_not_load_is_one_line_and_the_portable_path(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    broken = build.cache_dir() / build.fingerprint(build.compiler()) / build.LIBRARY
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a shared library")
    r = _python(PRODUCT, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "portable"
    said = [line for line in r.stderr.splitlines() if "portable" in line]
    assert len(said) == 1 and "did not load" in said[0] and str(broken) in said[0], r.stderr


def test_the_portable_path_chosen_by_the_environment_is_said_once(tmp_path):
    r = _python(PRODUCT, tmp_path, DECODERLAB_KERNELS="portable")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "portable"
    assert [line for line in r.stderr.splitlines() if line.startswith("decoderlab:")] == [
        "decoderlab: products use the portable torch path (DECODERLAB_KERNELS=portable)"]
    assert not (tmp_path / "kernels").exists()  # nothing built


def test_an_unknown_path_in_the_environment_is_refused_naming_the_allowed(tmp_path):
    r = _python("from decoderlab import kernels; kernels.load()", tmp_path, DECODERLAB_KERNELS="neon")
    assert r.returncode != 0
    assert "ValueError: DECODERLAB_KERNELS='neon' is not a kernel path; allowed: auto, portable, amx-bf16, avx512-bf16, " \
        in r.stderr


def test_make_installs_build_step_exits_zero_on_a_failure(tmp_path):
    environ = {**os.environ, "PYTHONPATH": SRC, "DECODERLAB_CACHE": str(tmp_path), "CXX": "false"}
    r = subprocess.run([sys.executable, "-m", "decoderlab.kernels.build"], capture_output=True, text=True,
                       env=environ, timeout=300)
    assert r.returncode == 0
    assert r.stderr.strip().splitlines()[-1].startswith("decoderlab: no CPU kernels (")
    assert "portable torch path" in r.stderr and "Traceback" not in r.stderr
