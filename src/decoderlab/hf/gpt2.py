"""GPT-2 (``GPT2LMHeadModel``): learned positions, pre-LayerNorm, a GELU MLP (ReLU² too: transformers'
``activation_function="relu2"``), one fused q/k/v projection, biases everywhere.

Names (GPT-2 stores its ``Conv1D`` weights as (in, out): transposed into our ``nn.Linear`` (out, in))::

    transformer.wte / wpe / ln_f       -> we / pe / norm_f
    lm_head                            -> fc_layer (absent when tied to wte)
    transformer.h.{i}.ln_1 / ln_2      -> blocks.{i}.norm_1 / norm_2
    transformer.h.{i}.attn.c_attn      -> blocks.{i}.attention.qkv     (transposed; q, k, v rows as ours)
    transformer.h.{i}.attn.c_proj      -> blocks.{i}.attention.proj    (transposed)
    transformer.h.{i}.mlp.c_fc / c_proj -> blocks.{i}.mlp.fc / proj    (transposed)

A model of ours without biases is written with zero biases (GPT-2 always has them) and read back with
``bias=True``. The causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` of older transformers versions are
no weights. Source: Radford et al. 2019; the names of transformers' ``modeling_gpt2.py``.
"""

from __future__ import annotations

import re

from ..config.model import ModelConfig, preset
from .convert import ConfigError, Names, plain_faults

ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel"}
PREFIX = "transformer."
IGNORED = re.compile(r"\.attn\.(bias|masked_bias)$")
TOP = {"we": "transformer.wte", "pe": "transformer.wpe", "norm_f": "transformer.ln_f", "fc_layer": "lm_head"}
BLOCK = {"norm_1": "ln_1", "attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj", "norm_2": "ln_2",
         "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
#: transformers' activation names -> our mlp ("gelu_new" is GELU with the tanh approximation, as ours)
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu2": "relu2"}
_FIXED = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False))


def names(cfg: ModelConfig, hf: dict) -> Names:
    """GPT-2's names: every module but the embeddings and the LM head has a bias."""
    return Names(TOP, BLOCK, "transformer.h.{i}", bias=lambda t: not t.endswith(("wte", "wpe", "lm_head")),
                 transposed=("c_attn", "c_proj", "c_fc"))


def to_ours(hf: dict, architecture: str, where: str) -> ModelConfig:
    """Our config of a GPT-2 config.json: num_tokens = vocab_size, d_model = n_embd, n_layer, n_head, max_len =
    n_positions, d_ff = n_inner (or 4 n_embd), norm_eps = layer_norm_epsilon, dropout = resid_pdrop, tie_weights =
    tie_word_embeddings;
    the ``gpt2`` preset's design (learned positions, LayerNorm, biases, no LM-head bias).

    Raises:
        ConfigError: another activation function, unscaled attention, scale_attn_by_inverse_layer_idx,
            reorder_and_upcast_attn, a missing size (each named with what is allowed).
    """
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation_function {act!r} is not implemented; allowed: "
                          f"{', '.join(map(repr, ACTIVATIONS))}", "activation_function")
    for key, ok in _FIXED:
        if key in hf and bool(hf[key]) != ok:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not implemented; allowed: {key}={ok}", key)
    sizes = {}
    for ours, theirs in (("num_tokens", "vocab_size"), ("d_model", "n_embd"), ("n_layer", "n_layer"),
                         ("n_head", "n_head"), ("max_len", "n_positions")):
        if not isinstance(hf.get(theirs), int) or isinstance(hf.get(theirs), bool):
            raise ConfigError(f"{where}: {theirs} is {hf.get(theirs)!r}; allowed: a positive integer ({ours})", theirs)
        sizes[ours] = hf[theirs]
    return preset("gpt2", **sizes, d_ff=int(hf.get("n_inner") or 0), mlp=ACTIVATIONS[act],
                  norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                  dropout=float(hf.get("resid_pdrop") or 0.0),
                  tie_weights=bool(hf.get("tie_word_embeddings", True)), attention="sdpa")


def mismatches(cfg: ModelConfig) -> list[tuple[str, object, object, str]]:
    """(field, value, the value GPT-2 needs, why) for each field of ``cfg`` that GPT-2 cannot carry."""
    want = [("position", "learned", "GPT-2 has learned absolute positions (wpe)"),
            ("norm", "layernorm", "GPT-2 uses pre-LayerNorm"),
            ("mlp", ("gelu", "relu2"), "GPT-2's MLP is not gated (GELU, or ReLU² as its activation_function)"),
            ("attn_out_proj", True, "GPT-2 attention has an output projection (c_proj)"),
            ("lm_head_bias", False, "GPT-2's lm_head has no bias"),
            ("qk_norm", False, "GPT-2 has no query/key norm"),
            ("n_kv_head", (0, cfg.n_head), "GPT-2 has a key/value head per query head"),
            ("head_dim", (0, cfg.d_model // cfg.n_head), "GPT-2's heads split d_model")]
    return [(f, getattr(cfg, f), v, why) for f, v, why in want
            if getattr(cfg, f) not in (v if isinstance(v, tuple) else (v,))] + plain_faults(cfg, "GPT2LMHeadModel")


def architecture(cfg: ModelConfig) -> str:
    return "GPT2LMHeadModel"


def to_theirs(cfg: ModelConfig) -> dict:
    """GPT-2's config.json fields for ``cfg`` (which :func:`mismatches` accepts). ``n_ctx`` repeats
    ``n_positions`` (llama.cpp's converter reads it)."""
    act = "gelu_new" if cfg.mlp == "gelu" else "relu2"
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.num_tokens,
                n_positions=cfg.max_len, n_ctx=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
                n_head=cfg.n_head, n_inner=None if cfg.ff_size == 4 * cfg.d_model else cfg.ff_size,
                activation_function=act, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_weights, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)


def prepare(cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
    """Nothing to rewrite: GPT-2's LayerNorm, positions and MLP are ours."""
    return cfg, state


def infer(shapes: dict[str, tuple[int, ...]], n_head: int | None, where: str) -> dict:
    """A GPT-2 config.json's sizes read from a state dict's tensor shapes (canonical names -> shapes); the
    number of heads cannot be, so ``n_head`` must be given.

    Raises:
        ValueError: no ``n_head``; a tensor the sizes are read from is missing or not 2-D (named).
    """
    if n_head is None:
        raise ValueError(f"{where}: n_head cannot be inferred from a GPT-2 state dict's tensor shapes; pass it as "
                         "from_hf(state_dict, n_head=...) or give config= (a transformers config or its dict)")
    for key in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.mlp.c_fc.weight"):
        if key not in shapes:
            raise ValueError(f"{where}: missing tensor {key.removeprefix(PREFIX)!r}; cannot infer the model's sizes")
        if len(shapes[key]) != 2:
            raise ValueError(f"{where}: tensor {key!r} must be 2-D, got shape {shapes[key]}")
    v, d = shapes["transformer.wte.weight"]
    layers = [int(m.group(1)) for k in shapes if (m := re.match(r"transformer\.h\.(\d+)\.", k))]
    return dict(architectures=list(ARCHITECTURES), model_type="gpt2", vocab_size=v, n_embd=d,
                n_layer=1 + max(layers, default=-1), n_head=n_head, n_positions=shapes["transformer.wpe.weight"][0],
                n_inner=shapes["transformer.h.0.mlp.c_fc.weight"][1])
