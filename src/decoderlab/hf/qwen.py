"""Qwen2 (``Qwen2ForCausalLM``: Qwen2 and Qwen2.5) and Qwen3 (``Qwen3ForCausalLM``): Llama's block with biases
on q, k and v (Qwen2), or with a per-head RMSNorm of the queries and keys, a gain of d_head shared by the heads,
before rope (Qwen3, whose ``attention_bias`` puts biases on q, k, v and o).

Names: Llama's (:mod:`.llama`), and for Qwen3::

    model.layers.{i}.self_attn.q_norm / k_norm    -> blocks.{i}.attention.q_norm / k_norm

A model of ours with ``qkv_bias`` exports to Qwen2; with ``qk_norm`` to Qwen3 (a QK-norm without a gain is
written with unit gains). The layers that slide (``use_sliding_window`` from ``max_window_layers`` on, or
``layer_types``) attend through their window, as transformers' do; a model of ours with sliding layers is
written with its ``layer_types``. transformers 5 rebuilds
the tokenizer of every ``qwen2`` directory as Qwen's own (``Qwen2Tokenizer``: NFC, Qwen's split, single digits),
whatever its tokenizer.json says, so a model whose tokenizer is not Qwen's goes to Llama's class instead (the same
forward: q/k/v biases and a zero o_proj bias), where ``AutoTokenizer`` reads the tokenizer.json written. Source: Qwen2 /
Qwen3 technical reports; transformers' ``modeling_qwen2.py`` / ``modeling_qwen3.py``.
"""

from __future__ import annotations

import re

from ..config.model import ModelConfig
from .convert import (ConfigError, Names, layer_list, prepare_norm, rotary_config, rotary_mismatches, rotary_theirs,
                      window_of)

ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: the split of transformers' ``Qwen2Tokenizer`` (``PRETOKENIZE_REGEX``), which AutoTokenizer imposes on qwen2
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
               r"""|\s+(?!\S)|\s+""")
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PREFIX = "model."
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
TOP = {"we": "model.embed_tokens", "norm_f": "model.norm", "fc_layer": "lm_head"}
BLOCK = {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
         "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attention.proj": "self_attn.o_proj",
         "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
         "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


def names(cfg: ModelConfig, hf: dict) -> Names:
    """Qwen2: q, k, v biases; Qwen3: q, k, v, o biases with attention_bias, and the q/k norms' gains."""
    qwen3 = hf.get("model_type") == "qwen3" or "Qwen3ForCausalLM" in (hf.get("architectures") or ())
    block = dict(BLOCK) if qwen3 else {k: v for k, v in BLOCK.items() if not k.endswith("_norm")}
    if qwen3:
        attention = ("q_proj", "k_proj", "v_proj", "o_proj") if hf.get("attention_bias") else ()
    else:
        attention = ("q_proj", "k_proj", "v_proj")
    return Names(TOP, block, "model.layers.{i}", bias=lambda t: bool(attention) and t.endswith(attention),
                 gains=("attention.q_norm", "attention.k_norm") if qwen3 else ())


def to_ours(hf: dict, architecture: str, where: str) -> ModelConfig:
    """Our config of a Qwen2 / Qwen3 config.json: Llama's (SwiGLU, rotate-half rope) with ``qkv_bias`` (Qwen2),
    or ``qk_norm`` with its gain (Qwen3; ``attention_bias`` gives ``bias=True``, the MLP's biases zero).

    Raises:
        ConfigError: hidden_act other than silu, rope scaling, layer types transformers cannot run
            (:func:`sliding_layers`).
    """
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not implemented for {architecture}; allowed: 'silu' (SwiGLU)",
                          "hidden_act")
    fields = rotary_config(hf, where)
    layers, window = sliding_layers(hf, fields["n_layer"], where)
    if layers:
        fields["sliding_window"] = window
        fields["layer_types"] = tuple("sliding_attention" if i in layers else "full_attention"
                                      for i in range(fields["n_layer"]))
    if architecture == "Qwen3ForCausalLM":
        if "head_dim" not in hf:  # Qwen3Config's default, not d_model // n_head
            fields["head_dim"] = 0 if 128 * fields["n_head"] == fields["d_model"] else 128
        return ModelConfig(**fields, mlp="swiglu", qk_norm=True, qk_norm_gain=True, bias=bool(hf.get("attention_bias")))
    return ModelConfig(**fields, mlp="swiglu", qkv_bias=True)


#: the layer types Qwen2 / Qwen3 attention runs (transformers' legacy "attention" is "full_attention")
LAYER_TYPES = {"full_attention": "full_attention", "attention": "full_attention",
               "sliding_attention": "sliding_attention"}


def sliding_layers(hf: dict, n_layer: int, where: str) -> tuple[list[int], int | None]:
    """``(the layers Qwen2Config / Qwen3Config make slide, their window)``, as transformers derives them: a
    window (``sliding_window``, 4096 when absent) only with ``use_sliding_window``; the ``layer_types`` of
    config.json where it lists them, else "sliding_attention" for the layers from ``max_window_layers`` (28 when
    absent) on, when there is a window -- so a ``max_window_layers`` that covers every layer leaves every layer
    full attention, whatever the window.

    Raises:
        ConfigError: a ``layer_types`` that is not one of :data:`LAYER_TYPES` per layer, or that makes a layer
            slide without a window (transformers cannot run it); a ``max_window_layers`` that is not an integer.
    """
    window = window_of(hf, 4096, where) if hf.get("use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        start = hf.get("max_window_layers", 28)
        if not isinstance(start, int) or isinstance(start, bool):
            raise ConfigError(f"{where}: max_window_layers is {start!r}; allowed: an integer (the first layer "
                              "that slides)", "max_window_layers")
        return (list(range(max(start, 0), n_layer)) if window is not None else []), window
    if (not isinstance(types, list) or len(types) != n_layer
            or not all(isinstance(t, str) and t in LAYER_TYPES for t in types)):
        raise ConfigError(f"{where}: layer_types {types!r} is not one type per layer; allowed: a list of "
                          f"num_hidden_layers {n_layer} of 'full_attention', 'sliding_attention'", "layer_types")
    layers = [i for i, t in enumerate(types) if LAYER_TYPES[t] == "sliding_attention"]
    if layers and window is None:
        raise ConfigError(f"{where}: layer_types makes {layer_list(layers)} 'sliding_attention', but "
                          "use_sliding_window is false, which gives them no window (transformers cannot run them); "
                          "allowed: 'full_attention' layers, or use_sliding_window true", "layer_types")
    return layers, window


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """What Qwen2 / Qwen3 cannot carry: Llama's limits, and an MLP or output projection bias without a QK-norm
    (Qwen2 biases q, k and v only; Qwen3 q, k, v and o but never the MLP: a model of ours with ``bias`` goes
    to Qwen3 when its MLP biases are zero, else the writer refuses it naming the tensor)."""
    name = architecture(cfg)
    out = [f for f in rotary_mismatches(cfg, "swiglu", name) if f[0] != "sliding_window"]  # (layer_types carry it)
    if not cfg.qk_norm and not cfg.qkv_bias:
        out.append(("qkv_bias", False, True, "Qwen2ForCausalLM has q/k/v biases (a model without them is Llama's)"))
    if cfg.bias and not cfg.qk_norm:
        out.append(("bias", True, False, f"{name} has no MLP or output biases"))
    return out  # (Qwen3 with bias: its MLP biases must be zero, as an import of attention_bias makes them)


def architecture(cfg: ModelConfig) -> str:
    return "Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM"


def carries_tokenizer(cfg: ModelConfig, tokenizer) -> bool:
    """Whether ``AutoTokenizer`` reads ``tokenizer`` back with its ids from the class of ``cfg``: always for
    Qwen3; for Qwen2 only a tokenizer of Qwen's own pipeline (NFC, :data:`QWEN2_SPLIT`, ``<|endoftext|>``), the one
    transformers rebuilds there."""
    if cfg.qk_norm or tokenizer is None:
        return True
    spec = tokenizer.to_dict() if getattr(tokenizer, "kind", None) == "bpe" else {}
    steps = (spec.get("pre_tokenizer") or {}).get("pretokenizers") or []
    split = steps[0].get("pattern", {}).get("Regex") if steps and steps[0].get("type") == "Split" else None
    return ((spec.get("normalizer") or {}).get("type") == "NFC" and split == QWEN2_SPLIT
            and "<|endoftext|>" in tokenizer.token_to_id)


def to_theirs(cfg: ModelConfig) -> dict:
    """Qwen2's or Qwen3's config.json fields for ``cfg``: the sliding layers as ``layer_types`` when any."""
    name = architecture(cfg)
    types = [("sliding_attention" if cfg.window_of(i) else "full_attention") for i in range(cfg.n_layer)]
    slides = "sliding_attention" in types
    out = dict(rotary_theirs(cfg, name, "qwen3" if cfg.qk_norm else "qwen2"), hidden_act="silu",
               use_sliding_window=slides, sliding_window=cfg.sliding_window if slides else None,
               max_window_layers=cfg.n_layer, layer_types=types)
    if cfg.qk_norm:
        out["attention_bias"] = cfg.bias or cfg.qkv_bias
    return out


prepare = prepare_norm
