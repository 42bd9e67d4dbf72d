"""Gemma 3's text models (``Gemma3ForCausalLM``, model_type ``gemma3_text``: Gemma 3 270M and 1B): rotary
positions with two bases, sliding-window and full layers, norms before and after attention and the MLP, a
GELU-gated MLP, a scaled embedding, per-head q/k RMSNorm, multi-query attention with heads wider than
d_model / n_head.

Names (q, k and v stack into our one fused projection)::

    model.embed_tokens / model.norm / lm_head            -> we / norm_f / fc_layer (lm_head absent when tied)
    model.layers.{i}.input_layernorm                    -> blocks.{i}.norm_1
    model.layers.{i}.post_attention_layernorm           -> blocks.{i}.norm_1_post
    model.layers.{i}.pre_feedforward_layernorm          -> blocks.{i}.norm_2
    model.layers.{i}.post_feedforward_layernorm         -> blocks.{i}.norm_2_post
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj     -> blocks.{i}.attention.qkv
    model.layers.{i}.self_attn.o_proj                   -> blocks.{i}.attention.proj
    model.layers.{i}.self_attn.q_norm / k_norm          -> blocks.{i}.attention.q_norm / k_norm
    model.layers.{i}.mlp.gate_proj / up_proj / down_proj -> blocks.{i}.mlp.gate / fc / proj

Gemma's RMSNorm multiplies by (1 + weight): every norm's stored weight is our gain minus 1 (added in float32
when read, as the class adds it at run time; subtracted when written).

The config (``Gemma3TextConfig``'s defaults where config.json is silent): ``layer_types`` (else five
"sliding_attention" layers to one "full_attention", ``sliding_window_pattern`` 6), ``sliding_window`` (4096),
the rotary bases per layer kind -- ``rope_parameters`` {"full_attention": ..., "sliding_attention": ...}, or the
older ``rope_theta`` (1,000,000) and ``rope_local_base_freq`` (10,000) -- ``query_pre_attn_scalar`` (256),
``head_dim`` (256), ``num_key_value_heads`` (4), ``hidden_activation`` ``gelu_pytorch_tanh``. Refused, naming the
field: a rope scaling of either kind (Gemma 3 4B-27B scale their full layers' rope linearly), soft-capped
attention or final logits, bidirectional attention, another activation, and the classes around the text model:
Gemma 3's vision tower (``Gemma3ForConditionalGeneration``) and Gemma 3n.

Source: Gemma Team 2025, "Gemma 3 Technical Report"; transformers' ``modeling_gemma3.py`` and
``configuration_gemma3.py``.
"""

from __future__ import annotations

import re

from ..config.model import ModelConfig
from .convert import ConfigError, Names, rotary_config

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM"}
#: the classes of the family decoderlab does not compute -> (the config field that makes them, why)
REFUSED = {
    "Gemma3ForConditionalGeneration": ("vision_config", "Gemma 3's vision tower (SigLIP) and its image tokens are "
                                                        "not computed"),
    "Gemma3nForCausalLM": ("model_type", "Gemma 3n's per-layer embeddings, AltUp and LAuReL are not computed"),
    "Gemma3nForConditionalGeneration": ("model_type", "Gemma 3n's per-layer embeddings, AltUp, LAuReL and its "
                                                      "audio/vision towers are not computed"),
}
REFUSED_TYPES = {"gemma3": "Gemma3ForConditionalGeneration", "gemma3n": "Gemma3nForConditionalGeneration",
                 "gemma3n_text": "Gemma3nForCausalLM"}
PREFIX = "model."
IGNORED = re.compile(r"\.rotary_emb\.\w*inv_freq$")
TOP = {"we": "model.embed_tokens", "norm_f": "model.norm", "fc_layer": "lm_head"}
BLOCK = {"norm_1": "input_layernorm", "norm_1_post": "post_attention_layernorm",
         "norm_2": "pre_feedforward_layernorm", "norm_2_post": "post_feedforward_layernorm",
         "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attention.proj": "self_attn.o_proj",
         "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
         "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
#: our norms whose gain Gemma stores as weight = gain - 1
NORMS = ("norm_1", "norm_1_post", "norm_2", "norm_2_post", "norm_f", "attention.q_norm", "attention.k_norm")
#: ``Gemma3TextConfig``'s defaults of the fields read here
DEFAULTS = dict(head_dim=256, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                sliding_window=4096, query_pre_attn_scalar=256, max_position_embeddings=131072)
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # (both GELU's tanh approximation)


def names(cfg: ModelConfig, hf: dict) -> Names:
    """Gemma 3's names: biases on q, k, v, o with attention_bias, the q/k norms' gains, every norm's weight
    stored minus 1."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj") if hf.get("attention_bias") else ()
    return Names(TOP, BLOCK, "model.layers.{i}", bias=lambda t: bool(attention) and t.endswith(attention),
                 gains=("attention.q_norm", "attention.k_norm"), norm_offset=1.0, norms=NORMS)


def to_ours(hf: dict, architecture: str, where: str) -> ModelConfig:
    """Our config of a Gemma 3 text config.json (module docstring).

    Raises:
        ConfigError: a field the model does not compute (soft-capping, bidirectional attention, rope scaling,
            another activation), a sliding window that is not a positive integer, ``layer_types`` that are not
            one known type per layer -- each naming the field and what is allowed.
    """
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in DEFAULTS or k == "sliding_window"}}
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(field) is not None:
            raise ConfigError(f"{where}: {field} is {hf[field]!r}; soft-capped logits are not implemented; allowed: "
                              "null (Gemma 3's own configs)", field)
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention is true (an encoder's attention, EmbeddingGemma's); "
                          "allowed: false (causal attention)", "use_bidirectional_attention")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_activation {act!r} is not implemented; allowed: "
                          f"{', '.join(map(repr, _ACTIVATIONS))} (GELU's tanh approximation)", "hidden_activation")
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    fields = rotary_config(plain, where)  # the sizes, heads, eps and tying; the rope is read below
    types, window = layer_types(hf, fields["n_layer"], where)
    full, local = rope_thetas(hf, where)
    scalar = hf.get("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ConfigError(f"{where}: query_pre_attn_scalar is {scalar!r}; allowed: a positive number",
                          "query_pre_attn_scalar")
    fields.update(rope_theta=full, rope_local_theta=local if "sliding_attention" in types else 0.0,
                  sliding_window=window if "sliding_attention" in types else 0,
                  layer_types=tuple(types) if "sliding_attention" in types else (),
                  query_pre_attn_scalar=float(scalar))
    return ModelConfig(**fields, mlp="geglu", qk_norm=True, qk_norm_gain=True, sandwich_norm=True, embed_scale=True,
                       bias=bool(hf.get("attention_bias")))


def layer_types(hf: dict, n_layer: int, where: str) -> tuple[list[str], int]:
    """``(each layer's type, the sliding window)`` as ``Gemma3TextConfig`` makes them: config.json's
    ``layer_types``, else "full_attention" every ``sliding_window_pattern``-th layer (6) and "sliding_attention"
    elsewhere.

    Raises:
        ConfigError: types that are not one of the two per layer; a window that is not a positive integer
            while a layer slides; a pattern that is not a positive integer."""
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{where}: sliding_window_pattern is {pattern!r}; allowed: a positive integer",
                              "sliding_window_pattern")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    if (not isinstance(types, list) or len(types) != n_layer
            or not all(t in ("full_attention", "sliding_attention") for t in types)):
        raise ConfigError(f"{where}: layer_types {types!r} is not one type per layer; allowed: a list of "
                          f"num_hidden_layers {n_layer} of 'full_attention', 'sliding_attention'", "layer_types")
    window = hf.get("sliding_window")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_window is {window!r}, but layer_types has 'sliding_attention' layers; "
                          "allowed: a positive integer", "sliding_window")
    return types, window


def rope_thetas(hf: dict, where: str) -> tuple[float, float]:
    """``(the full layers' rotary base, the sliding layers')``, as ``Gemma3TextConfig`` reads them:
    ``rope_parameters`` by layer type, a legacy ``rope_scaling`` merged into the full layers', the bases from
    ``rope_theta`` / ``rope_local_base_freq`` where a kind states none (1,000,000 / 10,000).

    Raises:
        ConfigError: ``rope_parameters`` that are not one block per layer type; a rope_type other than
            "default" (linear scaling, Gemma 3 4B-27B's, is not implemented)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= set(_THETA) or not all(
            isinstance(b, dict) or b is None for b in params.values()):
        raise ConfigError(f"{where}: rope_parameters {params!r} is not one block per layer type; allowed: "
                          "{\"full_attention\": {...}, \"sliding_attention\": {...}}", "rope_parameters")
    blocks = {kind: dict(params.get(kind) or {"rope_type": "default"}) for kind in _THETA}
    scaling = hf.get("rope_scaling")
    if scaling:
        if not isinstance(scaling, dict):
            raise ConfigError(f"{where}: rope_scaling {scaling!r} is not a JSON object", "rope_scaling")
        blocks["full_attention"].update(scaling)
    legacy = {"full_attention": hf.get("rope_theta"), "sliding_attention": hf.get("rope_local_base_freq")}
    out = []
    for kind, block in blocks.items():
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            key = "rope_scaling" if scaling and kind == "full_attention" else f"rope_parameters.{kind}"
            raise ConfigError(f"{where}: {key} of rope_type {rope_type!r} is not implemented; allowed: rope_type "
                              "'default' (plain rotary positions, Gemma 3 270M's and 1B's)", key.split(".")[0])
        theta = block.get("rope_theta", legacy[kind] if legacy[kind] is not None else _THETA[kind])
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"{where}: the rope_theta of {kind} is {theta!r}; allowed: a positive number",
                              "rope_parameters")
        out.append(float(theta))
    return out[0], out[1]


def refusal(name: str, hf: dict, where: str) -> ConfigError | None:
    """The error naming what a class of Gemma's family that decoderlab does not compute adds, or None."""
    if name not in REFUSED:
        return None
    field, why = REFUSED[name]
    return ConfigError(f"{where}: {name} ({field} {hf.get(field, hf.get('model_type'))!r:.60}): {why}; allowed: "
                       "Gemma3ForCausalLM, a text-only Gemma 3 (model_type gemma3_text)", field)


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """What Gemma3ForCausalLM cannot carry: another MLP, positions, norm; no sandwich norms, scaled embedding or
    QK-norm (it has all three); q/k/v biases without o's."""
    name = "Gemma3ForCausalLM"
    want = [("position", "rope", f"{name} has rotary positions"), ("norm", "rmsnorm", f"{name} uses RMSNorm"),
            ("mlp", "geglu", f"{name}'s MLP is GELU-gated (geglu)"),
            ("sandwich_norm", True, f"{name} has norms before and after attention and the MLP"),
            ("embed_scale", True, f"{name} scales its embeddings by sqrt(d_model)"),
            ("qk_norm", True, f"{name} normalises each head's queries and keys"),
            ("attn_out_proj", True, f"{name} attention has an output projection (o_proj)"),
            ("lm_head_bias", False, f"{name}'s lm_head has no bias"),
            ("qkv_bias", False, f"{name}'s biases are on q, k, v and o together (attention_bias)")]
    out = [(f, getattr(cfg, f), v, why) for f, v, why in want if getattr(cfg, f) != v]
    if not float(cfg.query_pre_attn_scalar).is_integer():
        out.append(("query_pre_attn_scalar", cfg.query_pre_attn_scalar, round(cfg.query_pre_attn_scalar),
                    f"{name}'s query_pre_attn_scalar is an integer"))
    return out  # (with bias: its MLP biases must be zero, as an import of attention_bias makes them)


def architecture(cfg: ModelConfig) -> str:
    return "Gemma3ForCausalLM"


def to_theirs(cfg: ModelConfig) -> dict:
    """Gemma 3's config.json fields for ``cfg``: sizes, heads, the layer types and window, both rotary bases, the
    attention scale, the activation."""
    types = [("sliding_attention" if cfg.window_of(i) else "full_attention") for i in range(cfg.n_layer)]
    local = cfg.rope_local_theta or cfg.rope_theta
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=cfg.num_tokens,
                hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                num_key_value_heads=cfg.kv_heads, head_dim=cfg.d_head, intermediate_size=cfg.ff_size,
                max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, layer_types=types,
                sliding_window=cfg.sliding_window or cfg.max_len,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.d_head),
                hidden_activation="gelu_pytorch_tanh",
                attention_bias=cfg.bias, final_logit_softcapping=None, attn_logit_softcapping=None,
                use_bidirectional_attention=False, tie_word_embeddings=cfg.tie_weights, attention_dropout=0.0)


def prepare(cfg: ModelConfig, state):
    return cfg, state
