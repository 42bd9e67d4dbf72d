"""The eager decode step in one call: a whole model's one-token step through ``torch.ops.decoderlab.decode_step``
(``kernels/csrc/decode.cpp``) instead of ~15 torch calls a layer from Python.

Why: on a small model a Python step spends more time between the products than in them (SmolLM2-135M, one thread:
~1/3 of an eager step was its 151 products, the rest torch's per-call cost; ``bench/llamacpp.py``). The C++ step
runs the same products (the kernels' ops, the same numbers) and does the norms, rotary positions, the KV-cache
write and attention in float32 itself: its logits equal the model's own blocks' to float32 rounding
(``tests/test_fastdecode.py`` holds them to it, and the greedy tokens equal).

Which steps take it (:func:`plan` says why not, :func:`step` then returns None and the model runs its blocks): the
C++ kernels loaded (not the portable path); no grad; no hook points installed (the glass box reads the blocks);
every linear a :class:`decoderlab.quant.BlockLinear`, a :class:`decoderlab.half.HalfLinear` (16-bit weights) or a
plain float32 ``nn.Linear`` without torch hooks (PEFT's
LoRA layers and other wrappers take the blocks); RMSNorm everywhere, a gated MLP (SwiGLU or GELU-tanh, Gemma's),
rotary or no positions inside attention (no added position table), an output projection; optional q/k/v biases,
QK-norm, sandwich norms, sliding windows (a ring cache); float32 activations; the cache not static (a compiled
step has no Python to save) and, with a padding mask, no ring layer. Llama, SmolLM2, Qwen2 and Gemma 3 models
take it; GPT-2 (LayerNorm, learned positions) and the lesson's models do not.

The program (what :func:`program` writes; ``decode.cpp`` reads it in the same order): integers ``n_layer, n_head,
n_kv_head, head_dim, rope layout (0 none, 1 interleaved, 2 rotate_half), activation (0 SiLU, 1 GELU-tanh),
qk_norm, sandwich``; floats ``norm eps, QK-norm eps, attention scale``; then per layer its ring and window (0: none) and the
tensors norm_1, qkv, [q_norm, k_norm], [cos, sin], o, [norm_1_post], norm_2, gate, up, down, [norm_2_post]; then
norm_f and the output layer. A linear is ``n`` weights (integers ``n``, then each weight's GGML type -- -1 for a
float weight -- and out features; the tensors: its packed bytes or float weight) and ``has_bias`` (then the bias).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import kernels
from .kernels import ops
from .half import HALF, HalfLinear
from .quant import BlockLinear

_LAYOUTS = {"interleaved": 1, "rotate_half": 2}


def _linear(layer, ints: list, tensors: list) -> str | None:
    """Append one linear layer to the program; why it cannot be, or None."""
    if type(layer) is BlockLinear:
        if layer.out_dtype != torch.float32:
            return f"a block layer computing in {layer.out_dtype}"
        ints.append(len(layer.kinds))
        for kind, out, packed in zip(layer.kinds, layer.outs, layer.packed):
            ints += [kernels.ggml_type(kind).number, out]
            tensors.append(packed)
    elif type(layer) in (nn.Linear, HalfLinear):
        w = layer.weight
        allowed = (torch.float32, *HALF) if type(layer) is HalfLinear else (torch.float32,)
        if w.dtype not in allowed or not w.is_contiguous() or layer._forward_hooks or layer._forward_pre_hooks:
            return f"a {w.dtype} or hooked linear layer"
        ints += [1, -1, w.size(0)]
        tensors.append(w)
    else:
        return f"a {type(layer).__name__} layer"
    bias = layer.bias
    if bias is not None and bias.dtype != torch.float32:
        return f"a {bias.dtype} bias"
    ints.append(0 if bias is None else 1)
    if bias is not None:
        tensors.append(bias)
    return None


def _norm(norm, tensors: list) -> str | None:
    if type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
        return f"a {type(norm).__name__} norm"
    tensors.append(norm.weight)
    return None


def _header(model) -> tuple[list, list] | str:
    """The program's header (integers, floats), or why the model's shape does not take the step."""
    cfg = model.config
    if model.pe is not None or cfg.mlp not in ("swiglu", "geglu") or cfg.norm != "rmsnorm":
        return f"positions {type(model.pe).__name__}, mlp {cfg.mlp!r}, norm {cfg.norm!r}"
    att = model.blocks[0].attention
    if att.proj is None or (att.rope is not None and att.rope.layout not in _LAYOUTS):
        return "attention without an output projection or with another rope layout"
    layout = 0 if att.rope is None else _LAYOUTS[att.rope.layout]
    scale = att.scale if att.scale is not None else att.d_head ** -0.5
    ints = [cfg.n_layer, att.n_head, att.n_kv_head, att.d_head, layout, int(cfg.mlp == "geglu"), int(att.qk_norm),
            int(model.blocks[0].norm_1_post is not None)]
    return ints, [float(model.blocks[0].norm_1.eps), float(att.qk_norm_eps), float(scale)]


def _layer(block, layer_cache, ints: list, tensors: list, shape: list) -> str | None:
    """Append one block to the program; why it cannot be, or None."""
    att, mlp = block.attention, block.mlp
    if block.hooks is not None or att.hooks is not None or mlp.hooks is not None:
        return "hook points installed"
    # a sliding window's layer: a ring of W slots (generate's cache), or every column with those W or more behind
    # the step's hidden (the scheduler's batch cache)
    ints += [layer_cache.ring or 0, 0 if layer_cache.ring else att.sliding_window or 0]
    why = _norm(block.norm_1, tensors) or _linear(att.qkv, ints, tensors)
    if why:
        return why
    if shape[6]:  # QK-norm: the heads' gains (ones where the model has none)
        for n in (att.q_norm, att.k_norm):
            tensors.append(n.weight if n is not None else torch.ones(att.d_head))
    if shape[4]:
        tensors += [att.rope.cos, att.rope.sin]
    why = _linear(att.proj, ints, tensors)
    if not why and shape[7]:
        why = _norm(block.norm_1_post, tensors)
    why = why or _norm(block.norm_2, tensors)
    for layer in (mlp.gate, mlp.fc, mlp.proj):
        why = why or _linear(layer, ints, tensors)
    if not why and shape[7]:
        why = _norm(block.norm_2_post, tensors)
    return why


def _walk(model, layer_caches) -> tuple[list, list, list] | str:
    """The program over the layers' caches (their ``ring`` is what it reads), or why the model's shape cannot
    take the step."""
    head = _header(model)
    if isinstance(head, str):
        return head
    (ints, floats), tensors = head, []
    for block, layer_cache in zip(model.blocks, layer_caches):
        why = _layer(block, layer_cache, ints, tensors, ints[:8])
        if why:
            return why
    why = _norm(model.norm_f, tensors) or _linear(model.fc_layer, ints, tensors)
    return why or (tensors, ints, floats)


def program(model, cache) -> tuple[list, list, list] | str:
    """``(tensors, ints, floats)`` of the model's step over ``cache`` (a :class:`decoderlab.attention.KVCache`
    prefilled by the model), or why the step cannot take it (a short reason; ``step`` then returns None)."""
    if ops.load() == "portable":
        return "the portable kernel path"
    if model.training or torch.is_grad_enabled() or model.hooks is not None or cache is None or cache.static:
        return "training, grad, hook points or a static cache"
    if any(c.k is None or c.k.dtype != torch.float32 or c.k.device.type != "cpu" for c in cache.layers):
        return "a cache not prefilled in float32"
    return _walk(model, cache.layers)


def _cached_program(model, cache):
    """The model's program over ``cache``, made at its first step and kept on the cache (walking the modules took
    ~1.5 ms a step, 10% of SmolLM2's); what may change between steps -- grad, training, hook points -- is checked
    at every step. None where the step cannot be fused."""
    kept = getattr(cache, "_fused_program", None)
    if kept is None or kept[0] is not model:
        made = program(model, cache)
        if isinstance(made, str):
            return None
        kept = (model, [m for b in model.blocks for m in (b, b.attention, b.mlp)], made)
        cache._fused_program = kept
    _, owners, made = kept
    if (model.training or torch.is_grad_enabled() or model.hooks is not None
            or any(o.hooks is not None for o in owners)):
        return None
    return made


class _AnyCache:
    ring = None


def why_not(model) -> str | None:
    """None when the model's eager decode steps take the fused step (over a float32 cache it prefilled, no hook
    points, no grad), else why not -- for the command line, which then suggests a compiled step."""
    if ops.load() == "portable":
        return "the portable kernel path"
    made = _walk(model, [_AnyCache] * len(model.blocks))
    return made if isinstance(made, str) else None


def step(model, tokens: torch.Tensor, positions, padding_mask, cache) -> torch.Tensor | None:
    """The logits (B, num_tokens) of one decode step as ``model.decode`` computes them (same arguments: tokens
    (B, 1), positions an int, (1,) or (B, 1), padding_mask None or (B, T_k)), the keys and values written into
    ``cache`` (not advanced); None when the model or the step does not take the fused path (module docstring)."""
    made = _cached_program(model, cache)
    if made is None or (padding_mask is not None and any(c.ring for c in cache.layers)):
        return None
    tensors, ints, floats = made
    b = tokens.size(0)
    x = model.we(tokens).reshape(b, -1)
    if x.dtype != torch.float32:
        return None
    if model.config.embed_scale:  # sqrt(d_model) in float32, as decoderlab.model.embed_scale makes it
        x = x * torch.tensor(math.sqrt(model.config.d_model), dtype=torch.float32)
    column = cache.length
    if isinstance(positions, int):
        positions = torch.full((b,), positions, dtype=torch.long)
    positions = positions.reshape(-1).expand(b).to(torch.long)
    logits = torch.ops.decoderlab.decode_step.default(
        x, positions, column, padding_mask, tensors, ints, floats,
        [c.k[:b] for c in cache.layers], [c.v[:b] for c in cache.layers])  # (a batch cache's running rows)
    for c in cache.layers:  # as LayerKVCache.update leaves them after a one-token step
        c.key_start = None if c.ring is not None and column >= c.ring else 0
    return logits
