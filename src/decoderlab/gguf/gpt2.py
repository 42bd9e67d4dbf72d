"""llama.cpp's ``gpt2`` architecture, both ways: GPT-2's shape -- learned positions, LayerNorm with a bias, a GELU
MLP, one fused q/k/v projection, biases on every layer but the output.

Metadata (``gpt2.``): the shared sizes (:mod:`.architecture`) and ``attention.layer_norm_epsilon`` -> norm_eps.

Tensors, besides the shared ``token_embd`` / ``output_norm`` / ``output``: ``position_embd.weight`` (max_len,
d_model); ``output_norm.bias``; per block ``attn_norm``, ``attn_qkv`` (3 d_model, d_model), ``attn_output``,
``ffn_norm``, ``ffn_up`` (d_ff, d_model), ``ffn_down`` (d_model, d_ff), each ``.weight`` and ``.bias`` (a model
without biases is written with zero biases). A model is written as gpt2 when its shape is GPT-2's
(``decoderlab.config.names.GPT2_SHAPE``).

Source: llama.cpp's ``llama-arch.cpp`` (LLM_ARCH_GPT2's tensors) and ``convert_hf_to_gguf.py`` (``GPT2Model``).
"""

from __future__ import annotations

from ..config.names import GPT2_SHAPE
from .metadata import number
from .weights import BLOCK_NAMES, layer_tensors

ARCHITECTURES = ("gpt2",)
#: q, k and v are one tensor (``attn_qkv``), read and written as it is
SPLIT_QKV = False
#: a learned position table (``position_embd.weight``) and a bias on the final norm (``output_norm.bias``)
LEARNED_POSITIONS = NORM_BIAS = True
#: a block's tensors, llama.cpp's names in its order
_BLOCK = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")


def fields(meta: dict, arch: str, common: dict, names, path="") -> dict:
    """The ModelConfig fields of a gpt2 file besides the shared sizes (``common``)."""
    return dict(norm="layernorm", position="learned", mlp="gelu", bias=True, attn_out_proj=True, lm_head_bias=False,
                init="gpt2", norm_eps=float(number(meta, arch, "attention.layer_norm_epsilon", 1e-5, path=path)))


def block_shapes(arch: str, fields: dict) -> dict[str, tuple[int, ...]]:
    """A block's tensors (llama.cpp's name after ``blk.{i}.`` -> logical shape)."""
    d, f = fields["d_model"], fields["d_ff"]
    shapes = {"attn_norm": (d,), "attn_qkv": (3 * d, d), "attn_output": (d, d), "ffn_norm": (d,), "ffn_up": (f, d),
              "ffn_down": (d, f)}
    return {f"{k}.{p}": (s if p == "weight" else s[:1]) for k, s in shapes.items() for p in ("weight", "bias")}


def block_tensors(block, i: int, cfg, arch: str) -> list[tuple]:
    """Block ``i``'s tensors as the writer takes them (:func:`~.weights.layer_tensors`)."""
    out = []
    for theirs in _BLOCK:
        ours = BLOCK_NAMES[theirs]
        out += layer_tensors(block.get_submodule(ours), f"blk.{i}.{theirs}", f"blocks.{i}.{ours}",
                             not theirs.endswith("norm"), True)
    return out


def write_header(writer, cfg, arch: str) -> None:
    """The metadata a gpt2 file has besides the shared sizes."""
    writer.add_layer_norm_eps(float(cfg.norm_eps))


# -- which models it computes -------------------------------------------------------------------------------------


def shape_faults(config) -> list[tuple]:
    """The rows of ``GPT2_SHAPE`` (field, value, train option, why) where ``config`` differs from GPT-2's shape."""
    return [(f, v, opt, why) for f, v, opt, why in GPT2_SHAPE if getattr(config, f) != v]


def architecture(config) -> str:
    """The architecture of a model without :func:`shape_faults`."""
    return "gpt2"


def shaped_presets() -> list[str]:
    """The model presets whose shape is GPT-2's (``GPT2_SHAPE``), which both export formats carry."""
    from ..config.model import ModelConfig
    from ..config.presets import PRESETS

    defaults = ModelConfig()
    return [name for name, shape in PRESETS.items()
            if all(shape.get(f, getattr(defaults, f)) in (v, None if v is False else v) for f, v, _, _ in GPT2_SHAPE)]


def how(bad) -> str:
    """How to train a shape llama.cpp's gpt2 carries instead: the presets (and the options)."""
    how = f"--preset {' / '.join(shaped_presets())}"
    if all(opt for _, _, opt, _ in bad):
        how += " (or " + " ".join(f"{opt} {v}" for _, v, opt, _ in bad) + ")"
    return how
