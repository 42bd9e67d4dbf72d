"""``trace``: one forward pass of a ``DecoderOnlyTransformer`` with every intermediate kept (per layer and
head: q, k, v, similarities, scaled similarities, mask, attention percents, head output; per layer: the
block's input, normed input, attention output, residuals, MLP output; the logits and top-k next tokens).

A trace is a view over the pass's :class:`~decoderlab.glassbox.cache.ActivationCache`: ``trace`` records the
hook points it shows (:mod:`decoderlab.hooks`) with ``run_with_cache``'s recorder and names them as the
lessons do; the similarities are recomputed from the cached queries and keys (Q Kᵀ, the kernel's own
product). Nothing else records.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np
import torch

from ..attention import build_ignore_mask, window_mask
from ..hooks import has_point, hook_model
from .cache import ActivationCache, as_ids, record


@dataclass
class LayerTrace:
    """Everything one decoder block computed, for the kept heads ``heads`` (indices into the model's heads).

    B = batch, T = tokens, h = ``len(heads)``, d_head the head size. Masks: True marks an ignored
    similarity (a key after the query: the causal mask), as everywhere in decoderlab.

    Attributes:
        index: the layer's index in ``model.blocks``.
        heads: the model's head indices kept here; axis 1 of the per-head tensors follows this order.
        input: (B, T, d_model) the block's input (embeddings + positions for layer 0).
        normed: (B, T, d_model) norm_1(input) (the input itself when the model has no norm).
        q, k, v: (B, h, T, d_head) queries, keys and values (after QK-norm and rotary positions, if any); with
            grouped-query attention a head's keys and values are those of its group's key/value head.
        sims: (B, h, T, T) similarities Q Kᵀ, queries down, keys across, before masking.
        scaled_sims: (B, h, T, T) sims / sqrt(d_head) (Gemma's: / sqrt(query_pre_attn_scalar)), before masking.
        mask: (T, T) bool, True = ignored: a later key, or one outside a sliding layer's window (None when
            nothing is masked).
        percents: (B, h, T, T) attention percents: softmax of the masked scaled similarities; rows sum to 1.
        head_out: (B, h, T, d_head) each head's output, percents @ V.
        attn_out: (B, T, d_model) the heads concatenated (all heads) and, if the model has one, passed through
            the output projection.
        resid_1: (B, T, d_model) input + attn_out.
        normed_2, mlp_out, resid_2: (B, T, d_model) norm_2(resid_1), mlp(normed_2), resid_1 + mlp_out;
            None when the model has no MLP.
    """

    index: int
    heads: list[int]
    input: torch.Tensor
    normed: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sims: torch.Tensor
    scaled_sims: torch.Tensor
    mask: torch.Tensor | None
    percents: torch.Tensor
    head_out: torch.Tensor
    attn_out: torch.Tensor
    resid_1: torch.Tensor
    normed_2: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None
    resid_2: torch.Tensor | None = None

    @property
    def output(self) -> torch.Tensor:
        """(B, T, d_model) the block's output (resid_2, or resid_1 without an MLP)."""
        return self.resid_2 if self.resid_2 is not None else self.resid_1

    def head_slot(self, head: int) -> int:
        """Position along axis 1 of the per-head tensors of the model's head ``head``.

        Raises ``ValueError`` when that head was not kept, naming the kept ones."""
        if head not in self.heads:
            raise ValueError(f"head {head} of layer {self.index} was not kept in this trace; kept: {self.heads}")
        return self.heads.index(head)


@dataclass
class Trace:
    """One forward pass, every number kept (see :func:`trace`).

    B = batch, T = tokens, V = num_tokens (vocabulary), k = top_k.

    Attributes:
        token_ids: (B, T) int64 the input ids.
        tokens: B lists of T token strings (None without a tokenizer).
        config: the model's ``ModelConfig``.
        word_embeddings: (B, T, d_model) the word embedding rows of the ids (``we``).
        encoded: (B, T, d_model) word embeddings + position encodings (the input of layer 0; equal to
            ``word_embeddings`` for rotary or no positions, which act inside attention instead).
        layers: one :class:`LayerTrace` per kept layer, in model order.
        final_input: (B, T, d_model) the last block's output.
        final_normed: (B, T, d_model) after the final norm (equal to final_input without norms).
        logits: (B, T, V) the output of ``fc_layer``: the same numbers as ``model(token_ids)``.
        top_k_probs: (B, T, k) the k most probable next tokens' probabilities (softmax of logits), descending.
        top_k_ids: (B, T, k) int64 their ids.
        top_k_tokens: B x T lists of k token strings (None without a tokenizer).
    """

    token_ids: torch.Tensor
    tokens: list[list[str]] | None
    config: Any
    word_embeddings: torch.Tensor
    encoded: torch.Tensor
    layers: list[LayerTrace]
    final_input: torch.Tensor
    final_normed: torch.Tensor
    logits: torch.Tensor
    top_k_probs: torch.Tensor
    top_k_ids: torch.Tensor
    top_k_tokens: list[list[list[str]]] | None = None

    def layer(self, index: int) -> LayerTrace:
        """The :class:`LayerTrace` of model layer ``index``; ``ValueError`` naming the kept layers if absent."""
        for lt in self.layers:
            if lt.index == index:
                return lt
        raise ValueError(f"layer {index} was not kept in this trace; kept layers: {[lt.index for lt in self.layers]}")

    def labels(self, batch: int = 0) -> list[str]:
        """Token strings of batch row ``batch`` (the ids as strings without a tokenizer)."""
        if self.tokens is not None:
            return list(self.tokens[batch])
        return [str(int(i)) for i in self.token_ids[batch]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the trace holds, by a dotted name (``layers.0.percents`` ...)."""
        out: dict[str, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
        for lt in self.layers:
            for f in fields(lt):
                value = getattr(lt, f.name)
                if isinstance(value, torch.Tensor):
                    out[f"layers.{lt.index}.{f.name}"] = value
        return out

    def nbytes(self) -> int:
        """Bytes held by the trace's tensors (each storage counted once)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for t in self.tensors().values():
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes()) if t.device.type != "meta" else (id(t), 0)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes() if t.device.type != "meta" else t.numel() * t.element_size()
        return total


def unwrap(model):
    """The ``DecoderOnlyTransformer`` in ``model`` (compiled or wrapped); ``TypeError`` for anything else."""
    return hook_model(model)


def _select(kind: str, wanted, n: int) -> list[int]:
    """Validate ``layers``/``heads``: None = all; an int or an iterable of ints in 0 .. n-1."""
    if wanted is None:
        return list(range(n))
    if isinstance(wanted, bool) or not isinstance(wanted, (numbers.Integral, Iterable)):
        raise TypeError(f"{kind}s must be an int, a list of ints or None, got {type(wanted).__name__}")
    items = [wanted] if isinstance(wanted, numbers.Integral) else list(wanted)
    if not items:
        raise ValueError(f"{kind}s is empty; valid {kind}s are 0 .. {n - 1}")
    out = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{kind} index must be an int, got {i!r}")
        i = int(i)
        if not 0 <= i < n:
            what = "n_layer" if kind == "layer" else "n_head"
            raise ValueError(f"{kind} {i} is out of range; valid {kind}s are 0 .. {n - 1} ({what}={n})")
        if i not in out:
            out.append(i)
    return sorted(out)


def trace(model, token_ids_or_text, tokenizer=None, layers=None, heads=None, top_k: int = 5) -> Trace:
    """Run one forward pass and keep every intermediate number (see :class:`Trace`, :class:`LayerTrace`).

    Args:
        model: a ``DecoderOnlyTransformer`` (compiled or wrapped is fine).
        token_ids_or_text: ids (T,) or (B, T) (tensor or list), or a text (needs ``tokenizer``).
        tokenizer: encodes a text and gives token strings for ``tokens`` / ``top_k_tokens``.
        layers: an int or a list of layer indices to keep (None = all). Layers not kept run with the model's
            configured kernel and nothing of them is stored.
        heads: an int or a list of head indices to keep in each kept layer (None = all); only those heads'
            slices of the per-head tensors are stored.
        top_k: how many most probable next tokens to keep at every position (capped at num_tokens).

    The pass runs in eval mode (no dropout) without gradients. Kept layers use the explicit kernel (the
    same function as ``sdpa``; the logits agree with ``model(token_ids)`` to about 1e-6). The model is left
    as it was (mode, no hook points installed), even when the pass raises. ``trace_from_cache`` gives the
    same view of a cache made by ``run_with_cache``.

    Memory: a kept layer costs 3 B h T² floats (sims, scaled sims, percents) plus O(B T d_model); the
    logits B T V floats. A GPT-2 small trace of 1,024 tokens keeping one layer holds about 0.4 GB.

    Raises:
        ValueError: a layer or head index out of range (naming the valid range); T > max_len; ids out of
            range; text without a tokenizer.
        KeyError: a word the tokenizer does not know (from ``tokenizer.encode``).
        TypeError: not a DecoderOnlyTransformer; bad argument types.
    """
    model = unwrap(model)
    cfg = model.config
    keep_layers = _select("layer", layers, cfg.n_layer)
    keep_heads = _select("head", heads, cfg.n_head)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    ids = as_ids(model, token_ids_or_text, tokenizer)
    subset = None if keep_heads == list(range(cfg.n_head)) else keep_heads
    cache = record(model, ids, trace_names(model, keep_layers), heads=subset)
    return trace_from_cache(cache, keep_layers, tokenizer=tokenizer, top_k=int(top_k))


def _q_k_points(model, layer: int) -> tuple[str, str]:
    """The hook points of the queries and keys the similarities are made of (after QK-norm and rope)."""
    for q, k in (("attn.hook_rot_q", "attn.hook_rot_k"), ("attn.hook_q_normed", "attn.hook_k_normed")):
        if has_point(model, f"blocks.{layer}.{q}"):
            return q, k
    return "attn.hook_q", "attn.hook_k"


def trace_names(model, layers: list[int]) -> list[str]:
    """The hook names a trace of ``layers`` shows (the ends of the pass always, each kept layer's points)."""
    n = model.config.n_layer
    names = ["hook_embed", "blocks.0.hook_resid_pre", f"blocks.{n - 1}.hook_resid_post"]
    for i in layers:
        names += [f"blocks.{i}.{p}" for p in ("hook_resid_pre", *_q_k_points(model, i), "attn.hook_v",
                                              "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
                                              "hook_mlp_out", "hook_resid_post")]
    return [name for name in names if has_point(model, name)]


def _layer_view(cache: ActivationCache, i: int, heads: list[int]) -> LayerTrace:
    model = cache.model
    get = lambda point: cache[f"blocks.{i}.{point}"] if has_point(model, f"blocks.{i}.{point}") else None  # noqa: E731
    q_point, k_point = _q_k_points(model, i)
    q, k, v = (get(p).transpose(1, 2) for p in (q_point, k_point, "attn.hook_v"))  # (B, h, T, d_head)
    if cache.heads is None:  # (B, H_kv, T, d_head) keys and values: each query head's (a head subset has them)
        k, v = model.blocks[i].attention.expand_kv(k), model.blocks[i].attention.expand_kv(v)
    half = q.dtype in (torch.float16, torch.bfloat16)  # the kernel's similarities are float32 then
    sims = torch.matmul(q.float(), k.float().transpose(-2, -1)) if half else torch.matmul(q, k.transpose(-2, -1))
    t = q.size(2)
    x = get("hook_resid_pre")
    block = model.blocks[i]
    att = block.attention
    scaled = sims / math.sqrt(q.size(-1)) if att.scale is None else sims * att.scale
    mask = build_ignore_mask(t, t, causal=True, device=q.device)
    window = window_mask(t, t, att.sliding_window, q.device)
    resid_1 = get("hook_resid_mid") if block.has_mlp else get("hook_resid_post")
    with torch.no_grad():  # the norms' outputs, by the norms themselves (TransformerLens's points stop before the gain)
        normed, normed_2 = block.norm_1(x), block.norm_2(resid_1) if block.has_mlp else None
    return LayerTrace(
        index=i, heads=list(heads), input=x, normed=normed, q=q, k=k, v=v, sims=sims,
        scaled_sims=scaled, mask=mask if window is None else mask | window,
        percents=get("attn.hook_pattern"), head_out=get("attn.hook_z").transpose(1, 2),
        attn_out=get("hook_attn_out"), resid_1=resid_1,
        normed_2=normed_2, mlp_out=get("hook_mlp_out"), resid_2=get("hook_resid_post") if block.has_mlp else None,
    )


def trace_from_cache(cache: ActivationCache, layers: list[int], *, tokenizer=None, top_k: int = 5) -> Trace:
    """The :class:`Trace` view of ``cache`` for ``layers`` (the cache must hold :func:`trace_names`; a cache of
    a head subset shows those heads). ``KeyError`` names a missing activation."""
    model, ids, logits = cache.model, cache.token_ids, cache.logits
    cfg = model.config
    heads = cache.heads if cache.heads is not None else list(range(cfg.n_head))
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        top_vals, top_ids = logp.topk(min(top_k, cfg.num_tokens), dim=-1)
        top_probs = top_vals.exp()
        del logp
    final_input = cache[f"blocks.{cfg.n_layer - 1}.hook_resid_post"]
    with torch.no_grad():
        final_normed = model.norm_f(final_input)
    tokens = top_tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.tokens(row.tolist()) for row in ids.cpu()]
        top_tokens = [[tokenizer.tokens(pos.tolist()) for pos in row] for row in top_ids.cpu()]
    return Trace(
        token_ids=ids, tokens=tokens, config=cfg, word_embeddings=cache["hook_embed"],
        encoded=cache["blocks.0.hook_resid_pre"], layers=[_layer_view(cache, i, heads) for i in layers],
        final_input=final_input,
        final_normed=final_normed,
        logits=logits, top_k_probs=top_probs, top_k_ids=top_ids, top_k_tokens=top_tokens,
    )
