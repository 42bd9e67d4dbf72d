"""What the export formats carry, checked before a file is written (:func:`check_shape`, used by
:func:`decoderlab.export.export` and by the writers): ``hf`` every model a Hugging Face class computes
(:func:`decoderlab.hf.export_family`), ``gguf`` every model a llama.cpp architecture computes exactly
(:func:`gguf_architecture`: GPT-2's shape, ``decoderlab.config.names.GPT2_SHAPE``, or the
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
    (:func:`gguf_architecture`: gpt2, llama, qwen2, qwen3; one message naming every field
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


#: llama.cpp's architectures the export writes
GGUF_ARCHITECTURES = ("gpt2", "llama", "qwen2", "qwen3")
#: the fields every llama-family architecture needs: (field, value, train option, why)
LLAMA_SHAPE = (
    ("position", "rope", "--position", "llama.cpp's llama, qwen2 and qwen3 have rotary positions"),
    ("norm", "rmsnorm", "--norm", "they use RMSNorm"),
    ("mlp", "swiglu", "--mlp", "their blocks have a SwiGLU MLP"),
    ("bias", False, "--bias", "they have no biases but qwen2's on q/k/v"),
    ("attn_out_proj", True, None, "they have an attention output projection"),
    ("lm_head_bias", False, None, "their output layer has no bias"),
)


def gguf_architecture(config) -> str:
    """llama.cpp's architecture that computes exactly the model of ``config``: ``gpt2`` (GPT-2's shape), ``llama``
    (rope, RMSNorm, SwiGLU, grouped-query attention), ``qwen2`` (with q/k/v biases) or ``qwen3`` (with a QK-norm).

    Raises:
        ExportShapeError (a ValueError): none does -- one line naming each field in the way against the
            nearest architecture (value, the option that sets it, why); ``field`` is the first.
    """
    gpt2_bad = check_gpt2_shape(config)
    if not gpt2_bad:
        return "gpt2"
    llama_bad = [(f, v, opt, why) for f, v, opt, why in LLAMA_SHAPE if getattr(config, f) != v]
    if config.qkv_bias and config.qk_norm:
        llama_bad.append(("qk_norm", False, None, "no llama.cpp architecture has both q/k/v biases (qwen2) and "
                                                  "a query/key norm (qwen3)"))
    if not llama_bad:
        return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
    gpt2_nearest = len(gpt2_bad) < len(llama_bad)
    bad, nearest = (gpt2_bad, "gpt2") if gpt2_nearest else (llama_bad, "llama / qwen2 / qwen3")
    has = ", ".join(f"{f}={getattr(config, f)!r} ({f'{opt} {getattr(config, f)}' if opt else 'ModelConfig.' + f})"
                    for f, _, opt, _ in bad)
    how = f"; train with {gpt2_how(bad)} to export it" if gpt2_nearest else ""
    raise ExportShapeError(f"--format gguf writes the models a llama.cpp architecture computes exactly "
                           f"({', '.join(GGUF_ARCHITECTURES)}); the nearest is {nearest}, where "
                           f"{'; '.join(w for *_, w in bad)}; this model has {has}{how}", bad[0][0])
