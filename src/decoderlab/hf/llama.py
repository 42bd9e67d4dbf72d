"""Llama (``LlamaForCausalLM``: SmolLM2, TinyLlama, Llama 3.2 without its rope scaling) and Mistral
(``MistralForCausalLM``: every layer slides over ``sliding_window`` positions, 4096 when config.json does not say,
none when null): rotary positions (rotate-half), RMSNorm with a gain, grouped-query attention, a SwiGLU MLP. A
model of ours whose every layer slides is written as Mistral, one without a window as Llama.

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
from .convert import (ConfigError, Names, prepare_norm, rotary_config, rotary_mismatches,
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
        ConfigError: hidden_act other than silu; rope scaling of any kind; a sliding window that is neither null
            nor a positive integer; attention_bias or mlp_bias in a Mistral config (the class has no biases).
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
        fields["sliding_window"] = window_of(hf, 4096, where) or 0
    bias = bool(hf.get("attention_bias") or hf.get("mlp_bias"))
    return ModelConfig(**fields, mlp="swiglu", bias=bias)


def _mistral(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is Mistral's: every layer slides over one window."""
    return bool(cfg.sliding_window) and all(cfg.window_of(i) for i in range(cfg.n_layer))


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """What Llama cannot carry (:func:`.convert.rotary_mismatches` with SwiGLU; no QK-norm; a sliding window on
    some layers only -- every layer's is Mistral's, without biases)."""
    name = architecture(cfg)
    out = [f for f in rotary_mismatches(cfg, "swiglu", name) if f[0] != "sliding_window" or not _mistral(cfg)]
    if cfg.qk_norm:
        out.append(("qk_norm", True, False, f"{name} has no query/key norm (Qwen3ForCausalLM has)"))
    if name == "MistralForCausalLM" and (cfg.bias or cfg.qkv_bias):
        out.append(("bias" if cfg.bias else "qkv_bias", True, False, "MistralForCausalLM has no biases"))
    return out


def architecture(cfg: ModelConfig) -> str:
    return "MistralForCausalLM" if _mistral(cfg) else "LlamaForCausalLM"


def to_theirs(cfg: ModelConfig) -> dict:
    """Llama's config.json fields for ``cfg``: attention_bias when any of ours has q/k/v/o biases, mlp_bias with
    ``bias``; Mistral's with its window."""
    if _mistral(cfg):
        return dict(rotary_theirs(cfg, "MistralForCausalLM", "mistral"), hidden_act="silu",
                    sliding_window=cfg.sliding_window)
    return dict(rotary_theirs(cfg, "LlamaForCausalLM", "llama"), hidden_act="silu",
                attention_bias=cfg.bias or cfg.qkv_bias, mlp_bias=cfg.bias)


prepare = prepare_norm
