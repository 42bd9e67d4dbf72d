"""Named hook points of a ``DecoderOnlyTransformer`` (TransformerLens's names) and the one way to use them.

Every module with hook points -- the model, each ``DecoderBlock``, its ``MultiHeadAttention`` and its ``MLP``
-- has an attribute ``hooks``: None, and then the forward pass costs one ``is None`` test per point (the
training step, ``model.decode`` and the server's batches run so), or a :class:`HookDispatch` that calls
the functions installed at its points. :func:`use_hooks` installs functions for the length of a ``with``
block and always restores what was there; the glass box (``trace``, ``run_with_cache``, patching) and
generation with hooks all go through it.

A hook function is called as ``fn(activation, name)``; it returns None (it only looked, or changed the tensor
in place) or a replacement of the same shape, dtype and device, which the rest of the pass then uses.

The names, in forward order (B batch, T tokens, H heads; L a layer index)::

    hook_embed                            (B, T, d_model)    word embeddings
    hook_pos_embed                        (B, T, d_model)    learned or sinusoidal position encodings
    blocks.L.hook_resid_pre               (B, T, d_model)    the block's input
    blocks.L.ln1.hook_scale               (B, T, 1)          sqrt(mean((x - mean x)^2) + eps); RMSNorm: no centring
    blocks.L.ln1.hook_normalized          (B, T, d_model)    (x - mean x) / scale, before the gain and bias
    blocks.L.attn.hook_q                  (B, T, H, d_head)  as projected
    blocks.L.attn.hook_k / hook_v         (B, T, H_kv, d_head)  as projected (H_kv = n_kv_head key/value heads)
    blocks.L.attn.hook_q_normed / hook_k_normed  (B, T, H / H_kv, d_head)  after QK-norm (and its gain)
    blocks.L.attn.hook_rot_q / hook_rot_k     (B, T, H / H_kv, d_head)  after rotary positions (the model's layout)
    blocks.L.attn.hook_attn_scores        (B, H, T, T)       Q Kᵀ / sqrt(d_head), masked with -inf
    blocks.L.attn.hook_pattern            (B, H, T, T)       attention percents (rows sum to 1)
    blocks.L.attn.hook_z                  (B, T, H, d_head)  each head's output, pattern @ V
    blocks.L.ln1_post.hook_scale / ln1_post.hook_normalized  the norm after attention (sandwich_norm: Gemma's)
    blocks.L.hook_attn_out                (B, T, d_model)    after the output projection (and ln1_post)
    blocks.L.hook_resid_mid               (B, T, d_model)    resid_pre + attn_out (only with an MLP)
    blocks.L.ln2.hook_scale / ln2.hook_normalized
    blocks.L.mlp.hook_pre / mlp.hook_post (B, T, d_ff)       before / after the activation (SwiGLU: the gate's
                                                             output / silu(gate) * up)
    blocks.L.mlp.hook_pre_linear          (B, T, d_ff)       a gated MLP's up projection (SwiGLU, GeGLU)
    blocks.L.ln2_post.hook_scale / ln2_post.hook_normalized  the norm after the MLP (sandwich_norm)
    blocks.L.hook_mlp_out                 (B, T, d_model)    (after ln2_post)
    blocks.L.hook_resid_post              (B, T, d_model)    the block's output
    ln_final.hook_scale / ln_final.hook_normalized

Norm points exist only with a norm, ``hook_pos_embed`` only with learned or sinusoidal positions (rope acts
inside attention), ``hook_rot_*`` only with rope, ``hook_*_normed`` only with QK-norm, the MLP's points and
``hook_resid_mid`` only with an MLP, ``mlp.hook_pre_linear`` only with a gated MLP, ``ln1_post`` / ``ln2_post``
only with ``sandwich_norm``. With grouped-query attention (n_kv_head
< n_head) the key and value points have the n_kv_head heads the model computes and caches, as TransformerLens's;
query head j reads key/value head j // (n_head / n_kv_head). :func:`hook_names` lists a model's own.

Source: TransformerLens's hook names and shapes (``HookedTransformer``, and ``TransformerBridge`` in 4.x).
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from .checkpoint import unwrap_model
from .model import DecoderOnlyTransformer

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]

#: the shape of each point (the part of its name after ``blocks.L.``), for messages and docs
SHAPES = {
    "hook_embed": "(B, T, d_model)", "hook_pos_embed": "(B, T, d_model)", "hook_resid_pre": "(B, T, d_model)",
    "hook_attn_out": "(B, T, d_model)", "hook_resid_mid": "(B, T, d_model)", "hook_mlp_out": "(B, T, d_model)",
    "hook_resid_post": "(B, T, d_model)", "hook_scale": "(B, T, 1)", "hook_normalized": "(B, T, d_model)",
    "attn.hook_attn_scores": "(B, H, T_q, T_k)", "attn.hook_pattern": "(B, H, T_q, T_k)",
    "mlp.hook_pre": "(B, T, d_ff)", "mlp.hook_pre_linear": "(B, T, d_ff)", "mlp.hook_post": "(B, T, d_ff)",
    **{f"attn.hook_{p}": "(B, T, H, d_head)" for p in ("q", "q_normed", "rot_q", "z")},
    **{f"attn.hook_{p}": "(B, T, H_kv, d_head)" for p in ("k", "v", "k_normed", "rot_k")},
}
#: the per-head points of the key/value heads (n_kv_head of them; the others have n_head)
KV_POINTS = frozenset(("hook_k", "hook_v", "hook_k_normed", "hook_rot_k"))
#: the axis of the head index in each per-head point (ablating or patching one head)
HEAD_AXIS = {**{f"hook_{p}": 2 for p in ("q", "k", "v", "q_normed", "k_normed", "rot_q", "rot_k", "z")},
             "hook_attn_scores": 1, "hook_pattern": 1}

#: what a point needs of the modules (the model, the block): (test, words for messages). Read from the modules,
#: not the config, so that the names are the points a forward pass really reaches.
_NEEDS = {
    "positions": (lambda m, b: m.pe is not None, "learned or sinusoidal positions"),
    "norm_1": (lambda m, b: not isinstance(b.norm_1, nn.Identity), "a norm (norm='layernorm' or 'rmsnorm')"),
    "norm_2": (lambda m, b: b.has_mlp and not isinstance(b.norm_2, nn.Identity), "an MLP and a norm"),
    "norm_f": (lambda m, b: not isinstance(m.norm_f, nn.Identity), "a norm (norm='layernorm' or 'rmsnorm')"),
    "qk_norm": (lambda m, b: b.attention.qk_norm, "qk_norm=True"),
    "rope": (lambda m, b: b.attention.rope is not None, "rope positions"),
    "mlp": (lambda m, b: b.has_mlp, "an MLP"),
    "swiglu": (lambda m, b: b.has_mlp and b.mlp.gate is not None, "a gated MLP (mlp='swiglu' or 'geglu')"),
    "norm_1_post": (lambda m, b: b.norm_1_post is not None, "norms after attention (sandwich_norm=True)"),
    "norm_2_post": (lambda m, b: b.has_mlp and b.norm_2_post is not None, "an MLP and norms after it "
                                                                          "(sandwich_norm=True)"),
}
_TOP_POINTS = (("hook_embed", None), ("hook_pos_embed", "positions"))
_FINAL_POINTS = (("ln_final.hook_scale", "norm_f"), ("ln_final.hook_normalized", "norm_f"))
_BLOCK_POINTS = (
    ("hook_resid_pre", None), ("ln1.hook_scale", "norm_1"), ("ln1.hook_normalized", "norm_1"),
    ("attn.hook_q", None), ("attn.hook_k", None), ("attn.hook_v", None),
    ("attn.hook_q_normed", "qk_norm"), ("attn.hook_k_normed", "qk_norm"),
    ("attn.hook_rot_q", "rope"), ("attn.hook_rot_k", "rope"),
    ("attn.hook_attn_scores", None), ("attn.hook_pattern", None), ("attn.hook_z", None),
    ("ln1_post.hook_scale", "norm_1_post"), ("ln1_post.hook_normalized", "norm_1_post"), ("hook_attn_out", None),
    ("hook_resid_mid", "mlp"), ("ln2.hook_scale", "norm_2"), ("ln2.hook_normalized", "norm_2"),
    ("mlp.hook_pre", "mlp"), ("mlp.hook_pre_linear", "swiglu"), ("mlp.hook_post", "mlp"),
    ("ln2_post.hook_scale", "norm_2_post"), ("ln2_post.hook_normalized", "norm_2_post"), ("hook_mlp_out", "mlp"),
    ("hook_resid_post", None),
)
_NEED_OF = dict(_TOP_POINTS + _FINAL_POINTS + _BLOCK_POINTS)


def hook_model(model) -> DecoderOnlyTransformer:
    """The ``DecoderOnlyTransformer`` in ``model`` (compiled or wrapped); ``TypeError`` for anything else."""
    inner = unwrap_model(model)
    if not isinstance(inner, DecoderOnlyTransformer):
        raise TypeError(f"model must be a decoderlab DecoderOnlyTransformer, got {type(model).__name__}")
    return inner


def has_point(model: DecoderOnlyTransformer, name: str) -> bool:
    """Whether the forward pass of ``model`` reaches hook point ``name``."""
    layer, point = split_name(name)
    if layer is None:
        known = dict(_TOP_POINTS + _FINAL_POINTS)
        block = model.blocks[0]
    else:
        known = dict(_BLOCK_POINTS)
        if layer >= len(model.blocks):
            return False
        block = model.blocks[layer]
    return point in known and (known[point] is None or bool(_NEEDS[known[point]][0](model, block)))


def hook_names(model) -> list[str]:
    """Every hook point of ``model``, in the order the forward pass reaches them (see the module docstring)."""
    model = hook_model(model)
    b0 = model.blocks[0]
    names = [p for p, need in _TOP_POINTS if need is None or _NEEDS[need][0](model, b0)]
    for i, block in enumerate(model.blocks):
        names += [f"blocks.{i}.{p}" for p, need in _BLOCK_POINTS if need is None or _NEEDS[need][0](model, block)]
    return names + [p for p, need in _FINAL_POINTS if need is None or _NEEDS[need][0](model, b0)]


def split_name(name: str) -> tuple[int | None, str]:
    """``"blocks.3.attn.hook_z"`` -> ``(3, "attn.hook_z")``; ``"hook_embed"`` -> ``(None, "hook_embed")``."""
    if name.startswith("blocks."):
        layer, _, point = name[len("blocks."):].partition(".")
        if layer.isdigit():
            return int(layer), point
    return None, name


def shape_of(name: str) -> str:
    """The documented shape of hook point ``name`` ("(B, T, d_model)" ...)."""
    point = split_name(name)[1]
    return SHAPES.get(point) or SHAPES.get(point.rpartition(".")[2], "?")


def unknown_name(name, names: list[str], cfg) -> ValueError:
    """The error for a hook name the model does not have: the layer range, what the point needs, or the close
    names."""
    layer, point = split_name(str(name))
    need = _NEED_OF.get(point, "?") if (layer is None) == (point in dict(_TOP_POINTS + _FINAL_POINTS)) else "?"
    if layer is not None and layer >= cfg.n_layer and need != "?":
        why = f"layer {layer} is out of range; valid layers are 0 .. {cfg.n_layer - 1} (n_layer={cfg.n_layer})"
    elif need not in ("?", None):
        why = f"this model has no {point}: it needs {_NEEDS[need][1]}"
    else:
        close = difflib.get_close_matches(str(name), names, n=4, cutoff=0.6)
        why = f"close names: {', '.join(close)}" if close else f"names look like {names[0]!r}, {names[-1]!r}"
    return ValueError(f"unknown hook name {name!r}: {why}; decoderlab.hooks.hook_names(model) lists all "
                      f"{len(names)} of this model's")


def resolve_names(model, names_filter=None) -> list[str]:
    """The model's hook names picked by ``names_filter``: None (all), one name, a list of names, or a function
    ``name -> bool``; in forward order.

    Raises:
        ValueError: a name the model does not have (the message gives close names or what the point needs).
        TypeError: a filter of another kind.
    """
    model = hook_model(model)
    names = hook_names(model)
    if names_filter is None:
        return names
    if callable(names_filter):
        return [n for n in names if names_filter(n)]
    wanted = [names_filter] if isinstance(names_filter, str) else names_filter
    if not isinstance(wanted, Iterable):
        raise TypeError(f"names_filter must be None, a hook name, a list of names or a function, got "
                        f"{type(names_filter).__name__}")
    wanted = list(wanted)
    known = set(names)
    for n in wanted:
        if n not in known:
            raise unknown_name(n, names, model.config)
    chosen = set(wanted)
    return [n for n in names if n in chosen]


class HookDispatch:
    """The installed functions of one module's hook points; the module's ``hooks`` attribute while installed.

    ``dispatch(point, x)`` runs the functions at ``point`` (a name without the module's ``prefix``) in the
    order installed and returns ``x`` or the last replacement; ``heads(point, x)`` does the same for a
    per-head tensor the attention holds as (B, H, T, d_head), showing the hooks (B, T, H, d_head).
    """

    __slots__ = ("prefix", "fns", "needs_pattern")

    def __init__(self, prefix: str, fns: dict[str, tuple[HookFn, ...]]):
        self.prefix = prefix
        self.fns = fns
        self.needs_pattern = "hook_attn_scores" in fns or "hook_pattern" in fns

    def wants(self, point: str) -> bool:
        return point in self.fns

    def __call__(self, point: str, x: torch.Tensor) -> torch.Tensor:
        fns = self.fns.get(point)
        if fns is None:
            return x
        name = self.prefix + point
        for fn in fns:
            out = fn(x, name)
            if out is not None:
                x = _checked(out, x, name, fn)
        return x

    def heads(self, point: str, x: torch.Tensor) -> torch.Tensor:
        if point not in self.fns:
            return x
        seen = x.transpose(1, 2)
        out = self(point, seen)
        return x if out is seen else out.transpose(1, 2)


def _checked(out, x: torch.Tensor, name: str, fn) -> torch.Tensor:
    fn_name = getattr(fn, "__qualname__", None) or type(fn).__name__
    want = f"shape {tuple(x.shape)} {shape_of(name)}, dtype {x.dtype} on {x.device}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"hook {fn_name} at {name} returned a {type(out).__name__}; return None or a tensor of {want}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"hook {fn_name} at {name} returned shape {tuple(out.shape)}, dtype {out.dtype} on "
                         f"{out.device}; expected {want}")
    return out


def _modules(model: DecoderOnlyTransformer) -> dict[tuple[int | None, str], tuple[str, torch.nn.Module]]:
    """(layer, part) -> (name prefix, module) for every module with hook points."""
    out = {(None, ""): ("", model)}
    for i, block in enumerate(model.blocks):
        out[(i, "")] = (f"blocks.{i}.", block)
        out[(i, "attn.")] = (f"blocks.{i}.attn.", block.attention)
        if block.has_mlp:
            out[(i, "mlp.")] = (f"blocks.{i}.mlp.", block.mlp)
    return out


def hook_table(model, fwd_hooks) -> dict[str, list[HookFn]]:
    """``fwd_hooks`` -- pairs ``(name or filter, fn)`` -- as {hook name: [fn, ...]}, every name checked.

    Raises:
        TypeError: an item that is not a (name, fn) pair, or an fn that is not callable.
        ValueError: an unknown hook name (see :func:`resolve_names`).
    """
    if isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and callable(fwd_hooks[1]):
        fwd_hooks = [fwd_hooks]  # one pair given on its own
    table: dict[str, list[HookFn]] = {}
    for item in fwd_hooks or ():
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"each hook must be a (name, fn) pair, got {item!r:.80}")
        name, fn = item
        if not callable(fn):
            raise TypeError(f"the hook function for {name!r} is a {type(fn).__name__}, not callable")
        for n in resolve_names(model, name):
            table.setdefault(n, []).append(fn)
    return table


@contextmanager
def use_hooks(model, fwd_hooks) -> Iterator[DecoderOnlyTransformer]:
    """Install ``fwd_hooks`` (pairs ``(name or names filter, fn)``) on ``model``'s hook points for the
    ``with`` block; the points' earlier functions (an enclosing ``use_hooks``) stay and run first. Whatever
    happens inside, every module's ``hooks`` is restored on exit. Yields the unwrapped model.

    Any forward pass inside sees the hooks: ``model(ids)``, a KV-cache ``model.decode`` step, ``generate``.
    The model's mode and gradients are the caller's business.

    No hooks (an empty list): nothing is checked or installed, and the model is yielded as given.

    Raises: as :func:`hook_table`, before anything is installed.
    """
    if not fwd_hooks:
        yield model
        return
    inner = hook_model(model)
    table = hook_table(inner, fwd_hooks)
    modules = _modules(inner)
    grouped: dict[tuple[int | None, str], dict[str, list[HookFn]]] = {}
    for name, fns in table.items():
        layer, point = split_name(name)
        part = next((p for p in ("attn.", "mlp.") if layer is not None and point.startswith(p)), "")
        grouped.setdefault((layer, part), {})[point[len(part):]] = fns
    saved = []
    try:
        for key, points in grouped.items():
            prefix, module = modules[key]
            old = module.hooks
            merged = dict(old.fns) if old is not None else {}
            for point, fns in points.items():
                merged[point] = (*merged.get(point, ()), *fns)
            saved.append((module, old))
            module.hooks = HookDispatch(prefix, merged)
        yield inner
    finally:
        for module, old in reversed(saved):
            module.hooks = old
