"""A trained model out of decoderlab: a Hugging Face directory, or one GGUF file for llama.cpp and ollama.

``--format hf`` writes the Hugging Face class whose forward equals the model's (:mod:`decoderlab.hf`: GPT-2,
Llama, Qwen2 / Qwen3, Apertus / Arcee for the recipes' rope + ReLU² models), with the tokenizer and its chat
template always; a model no class computes is refused before a file is written, naming the fields and the
nearest class. ``--format gguf`` carries GPT-2's shape only (``decoderlab.config.names.GPT2_SHAPE``: learned
positions, LayerNorm, a GELU MLP, an attention output projection, no query/key norm, no bias in the output
layer); any other model is refused naming the field, its value and the train option that sets it
(:func:`check_shape`). ``bias=False`` models are written with zero biases where the format always has them.

    export(run_dir, out, format="gguf", dtype="q8_0")   # what ``decoderlab export`` calls
    to_gguf(model, tokenizer, "model.gguf", dtype="f16")
    to_hf(model, tokenizer, "hf-dir", template)         # decoderlab.hf.save_hf_directory, LoRA merged first

Source: the GGUF format of ggml / llama.cpp, written with its ``gguf`` Python package; GPT-2 (Radford et al.
2019) for its shape; transformers 5's classes for Hugging Face's.
"""

from __future__ import annotations

import os

from ..config.names import EXPORT_FORMATS, GGUF_DTYPES, GPT2_SHAPE
from .gguf import to_gguf

__all__ = ["EXPORT_FORMATS", "GGUF_DTYPES", "ExportShapeError", "chat_template_text", "check_gpt2_shape",
           "check_shape", "export", "gpt2_shaped_presets", "to_gguf", "to_hf"]


class ExportShapeError(ValueError):
    """A model whose shape the export format cannot carry; ``field`` names the ModelConfig field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def gpt2_shaped_presets() -> list[str]:
    """The model presets whose shape is GPT-2's (``GPT2_SHAPE``), which both formats carry."""
    from ..config.model import ModelConfig
    from ..config.presets import PRESETS

    defaults = ModelConfig()
    return [name for name, shape in PRESETS.items()
            if all(shape.get(f, getattr(defaults, f)) in (v, None if v is False else v) for f, v, _, _ in GPT2_SHAPE)]


def check_shape(config, fmt: str = "gguf") -> None:
    """Raise :class:`ExportShapeError` (a ``ValueError``) when format ``fmt`` ("hf" or "gguf") cannot carry the
    shape of ``config``. ``hf``: no Hugging Face class computes the model (:func:`decoderlab.hf.export_family`:
    the fields in the way and the nearest class). ``gguf``: no llama.cpp architecture computes it exactly
    (:func:`decoderlab.export.gguf.gguf_architecture`: gpt2, llama, qwen2, qwen3; one message naming every field
    in the way of the nearest, its value and the train option that set it). ``field`` is the first such field.

    Raises:
        ValueError: an unknown format (naming the allowed ones); a shape the format cannot carry.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if fmt == "hf":
        from ..hf import ExportError, export_family

        try:
            export_family(config)
        except ExportError as e:
            raise ExportShapeError(f"--format hf: {e}", e.field) from None
        return
    from .gguf import gguf_architecture

    gguf_architecture(config)


def check_gpt2_shape(config) -> list[tuple]:
    """The rows of ``GPT2_SHAPE`` (field, value, train option, why) where ``config`` differs from GPT-2's shape."""
    return [(f, v, opt, why) for f, v, opt, why in GPT2_SHAPE if getattr(config, f) != v]


def gpt2_how(bad) -> str:
    """How to train a shape llama.cpp's gpt2 carries instead: the presets (and the options)."""
    how = f"--preset {' / '.join(gpt2_shaped_presets())}"
    if all(opt for _, _, opt, _ in bad):
        how += " (or " + " ".join(f"{opt} {v}" for _, v, opt, _ in bad) + ")"
    return how


def chat_template_text(template, tokenizer) -> str | None:
    """The Jinja text of ``template`` for tokenizer_config.json's ``chat_template`` (None without a template).

    The hook for branch ``jinja``: its ``decoderlab.chat.hf_templates.chat_template_jinja`` writes any template
    as Jinja (decoderlab's built-in ones included); until it is merged, a template that holds its Jinja text
    (``source``) gives it and a built-in one gives None (the directory then has no chat template)."""
    if template is None:
        return None
    try:
        from ..chat.hf_templates import chat_template_jinja
    except ImportError:  # the jinja branch not merged yet
        source = getattr(template, "source", None)
        return source if isinstance(source, str) else None
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


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, format: str = "gguf", dtype: str = "f32",
           name: str | None = None, force: bool = False) -> dict:
    """Export the checkpoint ``run_dir`` (a decoderlab run directory, a Hugging Face directory or a GGUF file) to
    ``out`` in ``format`` ("gguf": one file in llama.cpp's architecture for the model, weights in ``dtype`` --
    f32, f16 or q8_0 --, the tokenizer and chat template inside, an ollama Modelfile beside it, an existing
    file replaced only with ``force``; "hf": a directory, its class, tokenizer and chat template). Returns a
    summary: format, dtype, out, parameters, bytes written, tensors, the tokenizer kind, the architecture or
    class (and for gguf the Modelfile).

    Raises:
        ValueError: an unknown format or dtype (``dtype`` other than f32 with ``format="hf"`` too); a shape
            the format cannot carry (:func:`check_shape`, checked before the weights are read); a tokenizer
            the format cannot carry.
        FileNotFoundError: ``run_dir`` is not a checkpoint.
    """
    from pathlib import Path

    from ..chat import load_model
    from ..gguf_import import is_gguf_file, open_checked
    from ..hf import is_hf_directory, read_config
    from ..model import ModelConfig

    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if dtype not in GGUF_DTYPES or (format == "hf" and dtype != "f32"):
        allowed = GGUF_DTYPES if format == "gguf" else ("f32",)
        raise ValueError(f"--dtype {dtype!r} is not one --format {format} writes; allowed: {', '.join(allowed)}")
    if is_gguf_file(run_dir):
        check_shape(ModelConfig.from_dict(open_checked(run_dir)[2]), format)  # from its header
    elif is_hf_directory(run_dir):
        check_shape(read_config(run_dir)[3], format)  # before the weights are read
    else:
        from ..checkpoint import read_config as read_our_config

        check_shape(read_our_config(run_dir), format)
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
