"""GGUF files out: one file for llama.cpp and ollama, written with the ``gguf`` package (``pip install
'decoderlab[gguf]'``): the model in the llama.cpp architecture that computes exactly what it computes
(:func:`~.architecture.gguf_architecture`: gpt2, llama, qwen2, qwen3; anything else is refused naming the field,
before a file is written), its tokenizer (:func:`~.tokenizer.write_tokenizer`), its chat template as Jinja text
(``tokenizer.chat_template``), in float32, bfloat16, float16, q8_0, q4_0 or q4_1.

    save_gguf(model, tokenizer, "model.gguf", dtype="q8_0", chat_template=jinja_text)

The tensors are those of :mod:`.weights`' mapping, each family writing its blocks (:mod:`.gpt2`, :mod:`.llama`);
our ``nn.Linear`` weights are already (out, in), the layout llama.cpp multiplies with, and the ``gguf`` writer
stores a (rows, cols) array as ggml's (cols, rows). Query and key rows follow the architecture's rotary layout
(llama's interleaved, qwen's rotate-half: a model in the other layout has its rows permuted). Norms, biases and
the position table stay float32 as llama.cpp's converter keeps them; the other matrices take ``dtype`` (q8_0,
q4_0, q4_1: blocks of 32 weights with a float16 scale, :mod:`decoderlab.quant`, the bytes llama.cpp's reference
quantizers write; a matrix whose rows are not a multiple of 32 is written as f16, as the converter does). A model
already holding blocks of ``dtype`` (loaded with ``--dtype q4_1``) writes them as they are, rows moved whole, not
quantized again. Missing biases where the architecture has them are written as zeros. LoRA adapters are merged
first; a weight outside what ``dtype``'s float16 numbers hold is refused, naming the tensor.

Source: the GGUF format of ggml / llama.cpp; llama.cpp's ``convert_hf_to_gguf.py`` (what each key holds).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config.names import BLOCK_DTYPES, GGUF_DTYPES
from .architecture import family_of, gguf_architecture
from .tokenizer import write_tokenizer
from .weights import array, encode, layer_tensors

_INSTALL_HINT = "pip install 'decoderlab[gguf]'"


def require_gguf():
    """The ``gguf`` package, or ``ImportError`` saying how to install it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"GGUF export needs the gguf package; install it with: {_INSTALL_HINT}") from e
    return gguf


def refuse_existing(path: Path, force: bool) -> None:
    """``FileExistsError`` for an existing ``path`` unless ``force`` (what a writer checks before writing)."""
    if path.exists() and not force:
        raise FileExistsError(f"refusing to replace {path}: it exists (--force, or force=True, replaces it)")


def gguf_tensors(model, arch: str) -> list[tuple]:
    """``(GGUF name, float32 array or BlockWeight, takes the weight dtype, our name)`` for every tensor of ``model``
    written as ``arch``, in llama.cpp's order (module docstring). Arrays are (rows, cols) as ours."""
    from ..quant import is_block_layer

    cfg, family = model.config, family_of(arch)
    out = [("token_embd.weight", array(model.we if is_block_layer(model.we) else model.we.weight), True,
            "we.weight")]
    if family.LEARNED_POSITIONS:
        out.append(("position_embd.weight", array(model.pe.weight), False, "pe.weight"))
    for i, block in enumerate(model.blocks):
        out += family.block_tensors(block, i, cfg, arch)
    out += layer_tensors(model.norm_f, "output_norm", "norm_f", False, family.NORM_BIAS)
    if not cfg.tie_weights:
        head = model.fc_layer
        out.append(("output.weight", array(head if is_block_layer(head) else head.weight), True, "fc_layer.weight"))
    return out


def _plain(model):
    """The bare ``DecoderOnlyTransformer`` of ``model`` (compiled or wrapped), its LoRA adapters merged."""
    from ..checkpoint import unwrap_model
    from ..lora import has_lora, merge_lora
    from ..model import DecoderOnlyTransformer

    model = unwrap_model(model)
    if not isinstance(model, DecoderOnlyTransformer):
        raise TypeError(f"a GGUF export takes a DecoderOnlyTransformer, got {type(model).__name__}")
    return merge_lora(model) if has_lora(model) else model


def save_gguf(model, tokenizer, path: str | os.PathLike, *, dtype: str = "float32", name: str | None = None,
              chat_template: str | None = None, end_of_turn: int | None = None, force: bool = False) -> dict:
    """Write ``model`` (LoRA adapters merged first) and its ``tokenizer`` as one GGUF file at ``path`` (module
    docstring), written next to its place and renamed into it: a failure leaves nothing. ``dtype``: "float32",
    "bfloat16", "float16", "q8_0", "q4_0" or "q4_1"; ``name``: ``general.name``; ``chat_template``: the Jinja
    text of ``tokenizer.chat_template``; ``end_of_turn``: its end-of-turn id. Returns ``{"architecture",
    "bytes", "tensors", "types"}``.

    Raises:
        FileExistsError: ``path`` exists and ``force`` is False.
        ValueError: a shape no llama.cpp architecture computes exactly (``ExportError``, naming the field); an
            unknown ``dtype``; a weight outside float16's range for float16 / q8_0 (naming the tensor); a
            tokenizer the format cannot carry, or whose size is not the model's.
        FileNotFoundError: the directory of ``path`` does not exist (naming it).
        ImportError: the gguf package is not installed.
        TypeError: ``model`` is not a ``DecoderOnlyTransformer``.
    """
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    model = _plain(model)
    arch = gguf_architecture(model.config)
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
                         f"{model.config.num_tokens}")
    path = Path(path)
    if not path.parent.is_dir():  # (else the writer's error names its temporary file)
        raise FileNotFoundError(f"cannot write the GGUF file {path}: directory {path.parent} does not exist")
    refuse_existing(path, force)
    gguf = require_gguf()
    types = _write(gguf, model, tokenizer, path, arch, dtype, name, chat_template, end_of_turn)
    return {"architecture": arch, "bytes": path.stat().st_size, "tensors": len(types), "types": types}


def _write(gguf, model, tokenizer, path: Path, arch: str, dtype: str, name, chat_template, end_of_turn) -> dict:
    """The GGUF file written next to ``path`` and renamed into place; the GGML type of each tensor by name."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _write_header(writer, gguf, model.config, arch, dtype, name or "decoderlab")
        write_tokenizer(writer, tokenizer, end_of_turn, chat_template)
        types = {}
        for tname, data, matrix, ours in gguf_tensors(model, arch):
            arr, qtype = encode(data, dtype, matrix, ours)
            writer.add_tensor(tname, arr, raw_dtype=qtype)
            types[tname] = qtype.name
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return types


def _write_header(writer, gguf, cfg, arch: str, dtype: str, name: str) -> None:
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
                  "float16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                  "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    writer.add_name(name)
    writer.add_file_type(int(file_types[dtype]))
    if dtype in BLOCK_DTYPES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.max_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.ff_size)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    family_of(arch).write_header(writer, cfg, arch)
