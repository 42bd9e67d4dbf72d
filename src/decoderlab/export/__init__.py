"""A trained model out of decoderlab: a Hugging Face directory, or one GGUF file for llama.cpp and ollama.

A thin command over the two formats' own writers: ``--format hf`` writes the Hugging Face class whose forward
equals the model's (:func:`decoderlab.hf.save_hf_directory`: GPT-2, Llama, Qwen2 / Qwen3, Apertus / Arcee for the
recipes' rope + ReLU² models), with the tokenizer and its chat template always; a model no class computes is
refused before a file is written, naming the fields and the nearest class. ``--format gguf`` writes the llama.cpp
architecture that computes the model exactly (:func:`decoderlab.gguf.save_gguf`: gpt2, llama, qwen2, qwen3), the
tokenizer and chat template inside, an ollama Modelfile beside it (:mod:`.modelfile`); any other model is refused
naming the fields, their values and the train options that set them (:func:`check_shape`). ``bias=False`` models
are written with zero biases where the format always has them. What both take from here: LoRA adapters merged,
the chat template as Jinja text (:func:`chat_template_text`: decoderlab's built-in templates too).

    export(run_dir, out, format="gguf", dtype="q8_0")   # what ``decoderlab export`` calls
    to_gguf(model, tokenizer, "model.gguf", dtype="float16", template=template)
    to_hf(model, tokenizer, "hf-dir", template)

Source: the GGUF format of ggml / llama.cpp, written with its ``gguf`` Python package; GPT-2 (Radford et al.
2019) for its shape; transformers 5's classes for Hugging Face's.
"""

from __future__ import annotations

import os

from pathlib import Path

from ..config.names import EXPORT_FORMATS, GGUF_DTYPES
from .shape import ExportShapeError, check_shape

__all__ = ["EXPORT_FORMATS", "GGUF_DTYPES", "ExportShapeError", "chat_template_text", "check_shape", "export",
           "to_gguf", "to_hf"]


def chat_template_text(template, tokenizer) -> str | None:
    """The Jinja text of ``template`` for tokenizer_config.json's ``chat_template``
    (:func:`decoderlab.chat.chat_template_jinja`: a Hugging Face template's own text, decoderlab's built-in ones
    written as Jinja that transformers renders to the same ids); None without a template."""
    if template is None:
        return None
    from ..chat import chat_template_jinja

    return chat_template_jinja(template, tokenizer)


def to_hf(model, tokenizer, path: str | os.PathLike, template=None) -> dict:
    """Write ``model`` as a Hugging Face directory (:func:`decoderlab.hf.save_hf_directory`): the class whose
    forward equals the model's, the tokenizer always (a character or word vocabulary too), the chat
    ``template`` as Jinja (:func:`chat_template_text`), LoRA adapters merged first. Returns its summary
    (architecture, bytes, tensors).

    Raises:
        ValueError: a model no Hugging Face class computes (naming the fields and the nearest class), before
            anything is written; a tokenizer whose size is not the model's.
    """
    from ..hf import plain_model, save_hf_directory

    model = plain_model(model)
    check_shape(model.config, "hf")
    return save_hf_directory(model, tokenizer, path, chat_template=chat_template_text(template, tokenizer))


def to_gguf(model, tokenizer, path: str | os.PathLike, *, dtype: str = "float32", name: str | None = None,
            template=None, force: bool = False, modelfile: bool = True) -> dict:
    """Write ``model`` as one GGUF file (:func:`decoderlab.gguf.save_gguf`: the llama.cpp architecture that
    computes it, its tensors in ``dtype`` -- "float32", "bfloat16", "float16", "q8_0", "q4_0" or "q4_1" --, the
    tokenizer inside) with the chat ``template`` as Jinja and its end of turn, LoRA adapters merged first, and an
    ollama Modelfile beside it (``<path without .gguf>.Modelfile``, unless ``modelfile=False``). Each is written
    next to its place and renamed into it. Returns ``{"architecture", "bytes", "tensors", "types", "modelfile"}``.

    Raises:
        ExportShapeError (a ValueError): a shape no llama.cpp architecture computes exactly (:func:`check_shape`),
            before anything is written.
        FileExistsError: the file or the Modelfile exists and ``force`` is False.
        ValueError, FileNotFoundError, ImportError: as :func:`decoderlab.gguf.save_gguf` (an unknown dtype, a
            weight outside float16's range, a tokenizer the format cannot carry, a missing directory).
    """
    from ..files import atomic_write_text
    from ..gguf import save_gguf
    from ..gguf.writer import refuse_existing
    from ..hf import plain_model
    from .modelfile import modelfile_path, modelfile_text

    model = plain_model(model)
    check_shape(model.config, "gguf")
    path = Path(path)
    side = modelfile_path(path) if modelfile else None
    for p in (path, side) if side is not None else (path,):
        refuse_existing(p, force)  # both, before either is written
    jinja = chat_template_text(template, tokenizer)
    end_of_turn = None if template is None else template.end_of_turn_id(tokenizer)
    summary = save_gguf(model, tokenizer, path, dtype=dtype, name=name, chat_template=jinja, end_of_turn=end_of_turn,
                        force=force)
    if side is not None:
        atomic_write_text(side, modelfile_text(path, template, tokenizer, jinja))
    return {**summary, "modelfile": None if side is None else str(side)}


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, format: str = "gguf", dtype: str = "float32",
           name: str | None = None, force: bool = False) -> dict:
    """Export the checkpoint ``run_dir`` (a decoderlab run directory, a Hugging Face directory or a GGUF file) to
    ``out`` in ``format`` ("gguf": one file in llama.cpp's architecture for the model, weights in ``dtype`` --
    float32, bfloat16, float16, q8_0, q4_0 or q4_1 --, the tokenizer and chat template inside, an ollama Modelfile beside it, an existing
    file replaced only with ``force``; "hf": a directory, its class, tokenizer and chat template). Returns a
    summary: format, dtype, out, parameters, bytes written, tensors, the tokenizer kind, the architecture or
    class (and for gguf the Modelfile).

    Raises:
        ValueError: an unknown format or dtype (``dtype`` other than float32 with ``format="hf"`` too); a shape
            the format cannot carry (:func:`check_shape`, checked before the weights are read); a tokenizer
            the format cannot carry.
        FileNotFoundError: ``run_dir`` is not a checkpoint (:func:`decoderlab.chat.checkpoint_kind`'s one message).
    """
    from ..chat import checkpoint_kind, load_model
    from ..checkpoint import read_config
    from ..gguf import open_checked
    from ..hf import read_hf_config
    from ..model import ModelConfig

    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if dtype not in GGUF_DTYPES or (format == "hf" and dtype != "float32"):
        allowed = GGUF_DTYPES if format == "gguf" else ("float32",)
        raise ValueError(f"--dtype {dtype!r} is not one --format {format} writes; allowed: {', '.join(allowed)}")
    kind = checkpoint_kind(run_dir)  # the front door's one message for a path that is no checkpoint
    if kind == "gguf":
        config = ModelConfig.from_dict(open_checked(run_dir)[2])  # from its header
    else:
        config = read_hf_config(run_dir)[3] if kind == "hf" else read_config(run_dir)
    check_shape(config, format)  # before the weights are read
    model, tokenizer, template, _ = load_model(run_dir)
    check_shape(model.config, format)
    summary = dict(format=format, dtype=dtype, out=str(out), parameters=model.num_parameters(),
                   tokenizer=getattr(tokenizer, "kind", None))
    if format == "gguf":
        summary.update(to_gguf(model, tokenizer, out, dtype=dtype, name=name or Path(run_dir).resolve().name,
                               template=template, force=force))
    else:
        summary.update(to_hf(model, tokenizer, out, template))
    return summary
