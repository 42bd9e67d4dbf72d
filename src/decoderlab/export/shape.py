"""What the export formats carry, checked before a file is written (:func:`check_shape`, used by
:func:`decoderlab.export.export` and by the writers): ``hf`` every model a Hugging Face class computes
(:func:`decoderlab.hf.export_family`), ``gguf`` every model a llama.cpp architecture computes exactly
(:func:`decoderlab.gguf.gguf_architecture`: GPT-2's shape, ``decoderlab.config.names.GPT2_SHAPE``, or the
llama family's)."""

from __future__ import annotations

from ..config.names import EXPORT_FORMATS


class ExportShapeError(ValueError):
    """A model whose shape the export format cannot carry; ``field`` names the ModelConfig field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_shape(config, fmt: str = "gguf") -> None:
    """Raise :class:`ExportShapeError` (a ``ValueError``) when format ``fmt`` ("hf" or "gguf") cannot carry the
    shape of ``config``. ``hf``: no Hugging Face class computes the model (:func:`decoderlab.hf.export_family`:
    the fields in the way and the nearest class). ``gguf``: no llama.cpp architecture computes it exactly
    (:func:`decoderlab.gguf.gguf_architecture`: gpt2, llama, qwen2, qwen3; one message naming every field in the
    way of the nearest, its value and the train option that set it). ``field`` is the first such field.

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
    from ..gguf import ExportError, gguf_architecture

    try:
        gguf_architecture(config)
    except ExportError as e:
        raise ExportShapeError(str(e), e.field) from None
