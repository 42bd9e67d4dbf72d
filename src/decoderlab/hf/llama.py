"""Llama (``LlamaForCausalLM``: SmolLM2, TinyLlama, Llama 3.2 without its rope scaling) and Mistral
(``MistralForCausalLM`` without a sliding window shorter than the context): rotary positions (rotate-half),
RMSNorm with a gain, grouped-query attention, a SwiGLU MLP.

Names (q, k and v stack, in this order, into our one fused projection)::

    model.embed_tokens / model.norm / lm_head      -> we / norm_f / fc_layer (lm_head absent when tied)
    model.layers.{i}.input_layernorm              -> blocks.{i}.norm_1
    model.layers.{i}.post_attention_layernorm     -> blocks.{i}.norm_2
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj -> blocks.{i}.attention.qkv
    model.layers.{i}.self_attn.o_proj             -> blocks.{i}.attention.proj
    model.layers.{i}.mlp.gate_proj / up_proj / down_proj -> blocks.{i}.mlp.gate / fc / proj

Llama's ``attention_bias`` (q, k, v, o) and ``mlp_bias`` are read as ``bias=True`` (the biases the class lacks
are zeros); Mistral has neither, so an ``attention_bias`` in its config.json is refused (the class would ignore
it). Source: Touvron et al. 2023; Jiang et al. 2023; transformers' ``modeling_llama.py`` /
``modeling_mistral.py``.
"""

from __future__ import annotations

import re

from ..config.model import ModelConfig
from .convert import (ConfigError, Names, no_sliding_window, prepare_norm, rotary_config, rotary_mismatches,
                      rotary_theirs, window_of)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
PREFIX = "model."
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
TOP = {"we": "model.embed_tokens", "norm_f": "model.norm", "fc_layer": "lm_head"}
BLOCK = {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
         "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attention.proj": "self_attn.o_proj",
         "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def names(cfg: ModelConfig, hf: dict) -> Names:
    """Llama's names; biases where config.json's attention_bias / mlp_bias put them."""
    def bias(t: str) -> bool:
        return (hf.get("attention_bias", False) and t.endswith(_ATTENTION)) or (hf.get("mlp_bias", False)
                                                                                 and t.endswith(_MLP))
    return Names(TOP, BLOCK, "model.layers.{i}", bias=bias)


def to_ours(hf: dict, architecture: str, where: str) -> ModelConfig:
    """Our config of a Llama or Mistral config.json (:func:`.convert.rotary_config`, ``mlp="swiglu"``).

    Raises:
        ConfigError: hidden_act other than silu; rope scaling of any kind; a sliding window shorter than the
            context (Mistral's default is 4096 when config.json does not say); attention_bias or mlp_bias in a
            Mistral config (the class has no biases).
    """
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not implemented for {architecture}; allowed: 'silu' (SwiGLU)",
                          "hidden_act")
    if architecture == "MistralForCausalLM":
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ConfigError(f"{where}: {key}={hf[key]!r}, but MistralForCausalLM has no biases (transformers "
                                  f"would leave them out); allowed: {key} false or absent, or LlamaForCausalLM",
                                  key)
    fields = rotary_config(hf, where)
    if architecture == "MistralForCausalLM":  # one window for every layer (MistralConfig has no layer_types)
        window = window_of(hf, 4096, where)
        no_sliding_window(where, list(range(fields["n_layer"])), window, fields,
                          why="MistralForCausalLM slides every layer", allowed="sliding_window null, or >= "
                          "max_position_embeddings")
    bias = bool(hf.get("attention_bias") or hf.get("mlp_bias"))
    return ModelConfig(**fields, mlp="swiglu", bias=bias)


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """What Llama cannot carry (:func:`.convert.rotary_mismatches` with SwiGLU; no QK-norm)."""
    out = rotary_mismatches(cfg, "swiglu", "LlamaForCausalLM")
    if cfg.qk_norm:
        out.append(("qk_norm", True, False, "LlamaForCausalLM has no query/key norm (Qwen3ForCausalLM has)"))
    return out


def architecture(cfg: ModelConfig) -> str:
    return "LlamaForCausalLM"


def to_theirs(cfg: ModelConfig) -> dict:
    """Llama's config.json fields for ``cfg``: attention_bias when any of ours has q/k/v/o biases, mlp_bias with
    ``bias``."""
    return dict(rotary_theirs(cfg, "LlamaForCausalLM", "llama"), hidden_act="silu",
                attention_bias=cfg.bias or cfg.qkv_bias, mlp_bias=cfg.bias)


prepare = prepare_norm
