"""A trained model out of decoderlab: a Hugging Face GPT-2 directory, or one GGUF file for llama.cpp and ollama.

Both formats carry GPT-2's shape only (``decoderlab.config.names.GPT2_SHAPE``: learned positions, LayerNorm, a
GELU MLP, an attention output projection, no query/key norm, no bias in the output layer); any other model is
refused before a file is written, naming the field, its value and the train option that sets it
(:func:`check_shape`). ``bias=False`` models are written with zero biases, as both formats always have them.

    export(run_dir, out, format="gguf", dtype="q8_0")   # what ``decoderlab export`` calls
    to_gguf(model, tokenizer, "model.gguf", dtype="f16")
    to_hf(model, tokenizer, "gpt2-dir")                 # decoderlab.hf.to_gpt2, with the shape checked first

Source: the GGUF format of ggml / llama.cpp, written with its ``gguf`` Python package; GPT-2 (Radford et al.
2019) for the shape.
"""

from __future__ import annotations

import os

from ..config.names import EXPORT_FORMATS, GGUF_DTYPES
from .gguf import to_gguf
from .shape import ExportShapeError, check_shape, gpt2_shaped_presets

__all__ = ["EXPORT_FORMATS", "GGUF_DTYPES", "ExportShapeError", "check_shape", "export", "gpt2_shaped_presets",
           "to_gguf", "to_hf"]


def to_hf(model, tokenizer, path: str | os.PathLike) -> None:
    """Write ``model`` as a Hugging Face GPT-2 directory (:func:`decoderlab.hf.to_gpt2`), with GPT-2's tokenizer
    files when ``tokenizer`` is a byte-level BPE (a character or word vocabulary has no GPT-2 form: the
    directory then holds the weights alone). The shape is checked first (:func:`check_shape`).

    Raises:
        ValueError: a shape GPT-2 cannot carry; a tokenizer whose size is not the model's.
        ImportError: transformers is not installed.
    """
    from ..hf import to_gpt2

    check_shape(model.config, "hf")
    bpe = getattr(tokenizer, "byte_level", False)
    to_gpt2(model, path, tokenizer=tokenizer if bpe else None)


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, format: str = "gguf", dtype: str = "f32",
           name: str | None = None) -> dict:
    """Export the checkpoint ``run_dir`` (a decoderlab run directory or a Hugging Face GPT-2 directory) to
    ``out`` in ``format`` ("gguf": one file, weights in ``dtype`` -- f32, f16 or q8_0; "hf": a directory).
    Returns a summary: format, dtype, out, parameters, bytes written, tensors and the tokenizer kind.

    Raises:
        ValueError: an unknown format or dtype (``dtype`` other than f32 with ``format="hf"`` too); a shape
            the format cannot carry (:func:`check_shape`, checked before the weights are read); a tokenizer
            the format cannot carry.
        FileNotFoundError: ``run_dir`` is not a checkpoint.
    """
    from pathlib import Path

    from ..checkpoint import read_config
    from ..hf import checkpoint_reader, is_gpt2_directory

    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if dtype not in GGUF_DTYPES or (format == "hf" and dtype != "f32"):
        allowed = GGUF_DTYPES if format == "gguf" else ("f32",)
        raise ValueError(f"--dtype {dtype!r} is not one --format {format} writes; allowed: {', '.join(allowed)}")
    if not is_gpt2_directory(run_dir):
        check_shape(read_config(run_dir), format)  # before the weights are read
    model, tokenizer = checkpoint_reader(run_dir)(run_dir)
    check_shape(model.config, format)
    summary = dict(format=format, dtype=dtype, out=str(out), parameters=model.num_parameters(),
                   tokenizer=getattr(tokenizer, "kind", None))
    if format == "gguf":
        summary.update(to_gguf(model, tokenizer, out, dtype=dtype, name=name or Path(run_dir).resolve().name))
    else:
        to_hf(model, tokenizer, out)
        summary["bytes"] = sum(f.stat().st_size for f in Path(out).iterdir())
        summary["tokenizer_written"] = bool(getattr(tokenizer, "byte_level", False))
    return summary
