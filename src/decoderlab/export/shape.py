"""What the export formats carry, checked before a file is written (:func:`check_shape`, used by
:func:`decoderlab.export.export` and by the writers): ``hf`` every model a Hugging Face class computes
(:func:`decoderlab.hf.export_family`), ``gguf`` every model a llama.cpp architecture computes exactly
(:func:`decoderlab.export.gguf.gguf_architecture`: GPT-2's shape, ``decoderlab.config.names.GPT2_SHAPE``, or the
llama family's)."""

from __future__ import annotations

from ..config.names import EXPORT_FORMATS, GPT2_SHAPE


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
