"""decoderlab.gguf's names, and the two packages named gguf kept apart: inside decoderlab/gguf/ ``import gguf`` is
the PyPI package (absolute imports), in the import graph the linter checks too; and tests/gguf/ stays a plain
directory (an ``__init__.py`` there would make ``import gguf`` in the tests this directory, as tests/ is on the
path)."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")


def test_import_gguf_is_the_pypi_package_inside_decoderlab_gguf_and_in_the_graph():
    import grimp

    from decoderlab.gguf import reader, weights

    assert gguf.__name__ == "gguf" and hasattr(gguf, "GGUFWriter") and hasattr(gguf, "quants")
    assert reader.np is not None and weights.dequantizable()  # (the gguf package's dequantizers)
    graph = grimp.build_graph("decoderlab", include_external_packages=True, cache_dir=None)
    assert "gguf" in graph.find_modules_directly_imported_by("decoderlab.gguf.reader")
    assert "decoderlab.gguf" not in graph.find_modules_directly_imported_by("decoderlab.gguf.reader")
    assert not (Path(__file__).parent / "__init__.py").exists()


def test_the_public_names():
    import decoderlab as dl
    import decoderlab.gguf as ours

    assert dl.gguf is ours and set(ours.__all__) <= set(dir(ours))
    assert ours.ARCHITECTURES == ("llama", "qwen2", "qwen3", "gpt2", "gemma3")
    assert [f.__name__ for f in ours.FAMILIES] == ["decoderlab.gguf.llama", "decoderlab.gguf.gpt2",
                                                   "decoderlab.gguf.gemma3"]
