"""GGUF files in and out: the one file llama.cpp and ollama run -- llama.cpp's ``gpt2``, ``llama``, ``qwen2`` and
``qwen3`` architectures -- to and from one ``DecoderOnlyTransformer`` with the same logits, its tokenizer and chat
template inside.

    model, tokenizer, info = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # what decoderlab.load and --checkpoint read
    save_gguf(model, tokenizer, "out.gguf", dtype="q8_0")                   # what `export --format gguf` writes

Each family is a room of its own -- its metadata and tensors both ways, and the models it computes -- beside one
shared loader and writer (the shape of :mod:`decoderlab.hf`, and of llama.cpp's converter); a new family is one
new module listed in :data:`.architecture.FAMILIES`:

    gpt2.py           gpt2: learned positions, LayerNorm, GELU, a fused q/k/v, biases
    llama.py          llama, qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm): rope, RMSNorm, GQA, SwiGLU
    architecture.py   the families' table: metadata -> ModelConfig fields, the tensors that shape has; a model ->
                      the architecture that computes it exactly
    weights.py        tensors both ways: dequantized (gguf.quants) or kept in their blocks, renamed, q/k/v stacked
                      and permuted; encoded in the GGML type of a dtype
    tokenizer.py      tokenizer.ggml.* both ways, with llama.cpp's special ids and flags where a key is absent
    pretokenizers.py  llama.cpp's pre-tokenizers by name, both ways
    reader.py         the file's header and its memory-mapped tensor bytes; metadata.py its keys read as numbers
    loader.py         read_gguf / load_gguf / read_info: every check, then the weights
    writer.py         save_gguf: the architecture, the header, the tokenizer, the tensors, atomically

Inside this package ``import gguf`` is the PyPI ``gguf`` package (absolute imports), never this one.

Source: ggml's GGUF format (ggml-org/ggml, docs/gguf.md); llama.cpp's ``llama-arch.cpp``, ``llama-vocab.cpp`` and
``convert_hf_to_gguf.py`` for what each key and tensor holds.
"""

from __future__ import annotations

from .architecture import ARCHITECTURES, FAMILIES, ExportError, gguf_architecture
from .loader import GGUFContents, GGUFInfo, is_gguf_file, load_gguf, open_checked, read_gguf, read_info
from .pretokenizers import PRE_TOKENIZERS
from .reader import GGUFFile
from .weights import DequantReport, dequantizable
from .writer import save_gguf

__all__ = ["ARCHITECTURES", "FAMILIES", "PRE_TOKENIZERS", "DequantReport", "ExportError", "GGUFContents", "GGUFFile",
           "GGUFInfo", "dequantizable", "gguf_architecture", "is_gguf_file", "load_gguf", "open_checked",
           "read_gguf", "read_info", "save_gguf"]
