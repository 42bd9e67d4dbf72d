"""The recipes' models: rotary positions with a plain (not gated) MLP -- ReLU², as the default recipe
``baby-shakespeare-speedrun`` trains, or GELU -- with or without a QK-norm.

* With ``qk_norm``: Apertus (``ApertusForCausalLM``): a per-head RMSNorm of queries and keys with a gain
  (written as ones when ours has none) before rope, an MLP ``down(act(up(x)))`` with ``hidden_act`` "relu2"
  (transformers' ``ReLUSquaredActivation``) or "gelu_pytorch_tanh".
* Without: Arcee (``ArceeForCausalLM``): Llama's block with the same plain MLP.

The default recipe's norm is a LayerNorm without a bias; both classes have RMSNorm, so its weights are centred
first (:func:`.convert.center_writes`: every write into the residual stream made mean-free, after which
LayerNorm's centring does nothing) -- the same function to rounding. Its interleaved rope becomes rotate-half
by permuting each head's query/key rows (:mod:`.convert`). Checked by logits against transformers in the tests.

Names (Apertus calls its norms attention_layernorm / feedforward_layernorm)::

    model.layers.{i}.attention_layernorm | input_layernorm          -> blocks.{i}.norm_1
    model.layers.{i}.feedforward_layernorm | post_attention_layernorm -> blocks.{i}.norm_2
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj / o_proj       -> blocks.{i}.attention.qkv / proj
    model.layers.{i}.self_attn.q_norm / k_norm (Apertus)           -> blocks.{i}.attention.q_norm / k_norm
    model.layers.{i}.mlp.up_proj / down_proj                       -> blocks.{i}.mlp.fc / proj

Apertus's own checkpoints (xIELU activation, llama3 rope scaling) are refused by their fields. Source: Swiss AI
Apertus, Arcee AFM (transformers' ``modeling_apertus.py``, ``modeling_arcee.py``); So et al. 2021 (ReLU²).
"""

from __future__ import annotations

import re

from ..config.model import ModelConfig
from .convert import ConfigError, Names, prepare_norm, rotary_config, rotary_mismatches, rotary_theirs

ARCHITECTURES = ("ApertusForCausalLM", "ArceeForCausalLM")
MODEL_TYPES = {"apertus": "ApertusForCausalLM", "arcee": "ArceeForCausalLM"}
PREFIX = "model."
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
TOP = {"we": "model.embed_tokens", "norm_f": "model.norm", "fc_layer": "lm_head"}
_ATTENTION = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "attention.proj": "self_attn.o_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
BLOCK = {"ApertusForCausalLM": {"norm_1": "attention_layernorm", "norm_2": "feedforward_layernorm", **_ATTENTION,
                                "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"},
         "ArceeForCausalLM": {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm", **_ATTENTION}}
#: transformers' activation names -> our mlp
ACTIVATIONS = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_APERTUS_THETA = 12_000_000.0  # ApertusConfig's default_theta


def _architecture_of(hf: dict) -> str:
    if hf.get("model_type") == "apertus" or "ApertusForCausalLM" in (hf.get("architectures") or ()):
        return "ApertusForCausalLM"
    return "ArceeForCausalLM"


def names(cfg: ModelConfig, hf: dict) -> Names:
    """Apertus: biases on q, k, v, o with attention_bias, none in the MLP, the q/k norms' gains. Arcee: Llama's
    attention_bias and mlp_bias."""
    name = _architecture_of(hf)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj") if hf.get("attention_bias") else ()
    mlp = ("up_proj", "down_proj") if hf.get("mlp_bias") and name == "ArceeForCausalLM" else ()
    return Names(TOP, BLOCK[name], "model.layers.{i}", bias=lambda t: t.endswith(attention + mlp) and bool(attention + mlp),
                 gains=("attention.q_norm", "attention.k_norm") if name == "ApertusForCausalLM" else ())


def to_ours(hf: dict, architecture: str, where: str) -> ModelConfig:
    """Our config of an Apertus / Arcee config.json: rotate-half rope, RMSNorm, a plain MLP (``mlp`` from
    hidden_act), and for Apertus a QK-norm with a gain.

    Raises:
        ConfigError: hidden_act other than relu2 / gelu_pytorch_tanh / gelu_new (Apertus's xielu included);
            rope scaling (Apertus's llama3 default when config.json has no rope_parameters).
    """
    default_act = "xielu" if architecture == "ApertusForCausalLM" else "relu2"
    act = hf.get("hidden_act", default_act)
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_act {act!r} is not implemented; allowed: {', '.join(map(repr, ACTIVATIONS))}",
                          "hidden_act")
    if architecture == "ApertusForCausalLM":
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            raise ConfigError(f"{where}: no rope_parameters, so ApertusForCausalLM's default llama3 rope scaling "
                              "applies, which is not implemented; allowed: rope_parameters of rope_type 'default'",
                              "rope_parameters")
        fields = rotary_config(hf, where, default_theta=_APERTUS_THETA)
        return ModelConfig(**fields, mlp=ACTIVATIONS[act], qk_norm=True, qk_norm_gain=True,
                           bias=bool(hf.get("attention_bias")))
    fields = rotary_config(hf, where)
    return ModelConfig(**fields, mlp=ACTIVATIONS[act], bias=bool(hf.get("attention_bias") or hf.get("mlp_bias")))


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """What Apertus / Arcee cannot carry: the rotary limits with a plain MLP (Apertus has no MLP biases: a model
    of ours with ``bias`` and a QK-norm is written when they are zero, else the writer refuses it)."""
    name = architecture(cfg)
    out = rotary_mismatches(cfg, ("relu2", "gelu"), name)
    return out  # (Apertus with bias: its MLP biases must be zero, as an import of attention_bias makes them)


def architecture(cfg: ModelConfig) -> str:
    return "ApertusForCausalLM" if cfg.qk_norm else "ArceeForCausalLM"


def to_theirs(cfg: ModelConfig) -> dict:
    """Apertus's or Arcee's config.json fields for ``cfg`` (plain rope written out: Apertus's default is llama3)."""
    name = architecture(cfg)
    act = "relu2" if cfg.mlp == "relu2" else "gelu_pytorch_tanh"
    out = dict(rotary_theirs(cfg, name, "apertus" if cfg.qk_norm else "arcee"), hidden_act=act,
               attention_bias=cfg.bias or cfg.qkv_bias)
    if not cfg.qk_norm:
        out["mlp_bias"] = cfg.bias
    return out


prepare = prepare_norm
