"""Shared pieces of the glass-box tests: small models of every preset family and of every variant the glass
box must handle, and parsers for the printed matrices of ``explain``."""

import math
import re

import numpy as np
import torch

import decoderlab as dl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LESSON_OUT = [[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]]


def vec(s):
    return [float(x) for x in s.strip("[]").split(",")]


def hand_checks(text):
    found = [float(x) for x in re.findall(r"check: max \|diff\| = ([0-9.e+-]+)", text)]
    assert found, "no hand-check line printed"
    return found


def matrix_after(text, title, n_rows):
    """Parse the numbers of the n_rows rows printed under the line starting with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = lines[start + 2 : start + 2 + n_rows]
    cells = [re.findall(r"(?<=\s)(-?\d+\.\d+|-)(?=\s|$)", r) for r in rows]
    return np.array([[math.nan if x == "-" else float(x) for x in row] for row in cells])  # '-' = masked


SMALL = {
    "statquest": dict(),
    "baby-shakespeare": dict(n_layer=2, max_len=16),
    "shakespeare-char": dict(n_layer=2, max_len=16, d_model=48, n_head=6),
    "gpt2": dict(n_layer=2, num_tokens=97, max_len=24, d_model=64, n_head=4),
}
VARIANTS = {
    "preset": dict(),
    "rope-rmsnorm-nobias": dict(position="rope", norm="rmsnorm", bias=False),
    "sinusoidal-bias": dict(position="sinusoidal", bias=True),
}


def small_model(name, variant="preset", **more):
    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset(name, **SMALL[name], **VARIANTS[variant], **more)).eval()




# ---------------------------------------------------------------------------------------------------------
# every variant the glass box must handle, in float64 with exact tables
# ---------------------------------------------------------------------------------------------------------

_BASE = dict(num_tokens=23, d_model=16, n_layer=2, n_head=4, max_len=12, attn_out_proj=True, attention="sdpa")
VARIANT_CONFIGS = {
    "learned-layernorm-gelu": dict(position="learned", norm="layernorm", mlp="gelu", bias=True, tie_weights=True,
                                   lm_head_bias=False),
    "sinusoidal-layernorm-nobias": dict(position="sinusoidal", norm="layernorm", mlp="gelu", bias=False),
    "rope-rmsnorm-relu2": dict(position="rope", norm="rmsnorm", mlp="relu2"),
    "rope-qknorm-rmsnorm": dict(position="rope", norm="rmsnorm", mlp="relu2", qk_norm=True),
    "learned-qknorm-layernorm": dict(position="learned", norm="layernorm", mlp="gelu", qk_norm=True, bias=True),
    "no-positions-no-norm": dict(position="none", norm="none", mlp="gelu", bias=True),
    "attention-only": dict(position="learned", norm="layernorm", mlp="none", bias=True, attention="explicit"),
    # the Llama family: grouped-query attention, SwiGLU, rotate-half rope with its own base (Llama, Mistral)
    "llama-gqa-swiglu": dict(position="rope", rope_layout="rotate_half", rope_theta=500.0, norm="rmsnorm",
                             mlp="swiglu", n_kv_head=2, d_ff=24, lm_head_bias=False),
    # Qwen2's q/k/v biases and Qwen3's QK-norm gains, one key/value head (multi-query), heads of 6 (4 x 6 != 16)
    "qwen-mqa-biases-gains": dict(position="rope", rope_layout="rotate_half", rope_theta=1000.0, norm="rmsnorm",
                                  mlp="swiglu", n_kv_head=1, head_dim=6, qkv_bias=True, qk_norm=True,
                                  qk_norm_gain=True, tie_weights=True, lm_head_bias=False),
    # Gemma 3's: a sliding layer (window 3 of the 9 tokens) with its own rope base beside a full one, norms after
    # attention and the MLP, GeGLU, a scaled embedding, 1 / sqrt(5) attention, MQA with heads of 8 (4 x 8 != 16)
    "gemma-sliding-sandwich": dict(position="rope", rope_layout="rotate_half", rope_theta=1000.0,
                                   rope_local_theta=10.0, sliding_window=3,
                                   layer_types=("sliding_attention", "full_attention"), norm="rmsnorm",
                                   sandwich_norm=True, mlp="geglu", embed_scale=True, query_pre_attn_scalar=5.0,
                                   n_kv_head=1, head_dim=8, qk_norm=True, qk_norm_gain=True, tie_weights=True,
                                   lm_head_bias=False),
    "statquest": None,  # the lesson's 37-parameter model: d_model 2, one head, no norm, no MLP, no projection
}


def exact_tables(model):
    """The sinusoidal and rotary tables recomputed in float64 (the model builds them in float32), so that the
    float64 NumPy reference, which recomputes them from the formulas, can agree to 1e-12."""
    cfg = model.config
    if cfg.position == "sinusoidal":
        from decoderlab.glassbox.reference import np_sinusoidal

        model.pe.pe = torch.from_numpy(np_sinusoidal(cfg.max_len, cfg.d_model)).to(model.pe.pe.dtype)
    if cfg.position == "rope":
        for rope in {id(b.attention.rope): b.attention.rope for b in model.blocks}.values():  # (a base per kind)
            inv_freq = rope.base ** (-torch.arange(0, rope.d_head, 2, dtype=torch.float64) / rope.d_head)
            angles = torch.arange(rope.max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
            rope.cos, rope.sin = angles.cos().to(rope.cos.dtype), angles.sin().to(rope.sin.dtype)
    return model


def variant_model(name, dtype=torch.float64, seed=0):
    """A small model of variant ``name`` (``VARIANT_CONFIGS``) in eval mode, every weight, bias and gain
    perturbed so that each part matters, in ``dtype`` (float64 by default, with exact tables)."""
    torch.manual_seed(seed)
    spec = VARIANT_CONFIGS[name]
    if spec is None:
        model = dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    else:
        model = dl.DecoderOnlyTransformer(dl.ModelConfig(**{**_BASE, **spec}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return exact_tables(model.to(dtype)).eval()


def variant_ids(model, batch=2, seed=1):
    """(batch, min(9, max_len)) random ids for ``model``."""
    t = min(9, model.config.max_len)
    return torch.randint(0, model.config.num_tokens, (batch, t), generator=torch.Generator().manual_seed(seed))
