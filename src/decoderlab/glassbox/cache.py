"""``run_with_cache`` and ``run_with_hooks``: one forward pass with the model's named hook points
(:mod:`decoderlab.hooks`) recorded or intervened on, as TransformerLens's functions of the same names.

The :class:`ActivationCache` keeps each activation under its hook name (``blocks.0.attn.hook_pattern`` ...,
or TransformerLens's short form ``cache["pattern", 0]``), with the model, the ids and the logits of the
pass; :func:`~decoderlab.glassbox.trace.trace`, the attribution functions, the detectors and patching all
read it. Nothing is recorded twice: a hook point that is not asked for costs one dictionary look-up.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from ..hooks import HEAD_AXIS, KV_POINTS, hook_model, hook_names, resolve_names, split_name, unknown_name, use_hooks
from ..model import DecoderOnlyTransformer
from ..quant import is_block_layer
from ..tokenizers import encode_with_special_tokens

#: TransformerLens's short names (``cache["pattern", 0]``): short -> the point inside ``blocks.L.``
_SHORT = {
    **{s: f"hook_{s}" for s in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")},
    **{s: f"attn.hook_{s}" for s in ("q", "k", "v", "q_normed", "k_normed", "rot_q", "rot_k", "attn_scores",
                                     "pattern", "z")},
    "pre": "mlp.hook_pre", "post": "mlp.hook_post",
}


def act_name(short: str, layer: int | None = None, sub: str | None = None) -> str:
    """The full hook name of TransformerLens's short form: ``act_name("pattern", 0)`` ->
    ``"blocks.0.attn.hook_pattern"``; ``act_name("embed")`` -> ``"hook_embed"``; ``act_name("scale")`` ->
    ``"ln_final.hook_scale"``; ``act_name("scale", 2, "ln1")`` -> ``"blocks.2.ln1.hook_scale"``.

    Raises ``ValueError`` for a short name it does not know (listing them) or a missing layer."""
    if short in ("embed", "pos_embed"):
        return f"hook_{short}"
    if short in ("scale", "normalized"):
        return f"ln_final.hook_{short}" if layer is None else f"blocks.{layer}.{sub or 'ln1'}.hook_{short}"
    if short not in _SHORT:
        raise ValueError(f"unknown short activation name {short!r}; known: embed, pos_embed, scale, normalized, "
                         f"{', '.join(_SHORT)}")
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise ValueError(f"{short!r} needs a layer index, as cache[{short!r}, 0]")
    return f"blocks.{int(layer)}.{_SHORT[short]}"


class ActivationCache(Mapping):
    """The activations of one forward pass by hook name, read-only (a ``Mapping[str, Tensor]``).

    Attributes:
        model: the ``DecoderOnlyTransformer`` that ran.
        token_ids: (B, T) int64 the input.
        logits: (B, T, num_tokens) the pass's output.
        heads: None, or the heads whose slices were kept of the per-head activations (``trace``'s choice).

    ``cache[name]`` or ``cache[short, layer]``; shapes as :mod:`decoderlab.hooks`. A missing name raises
    ``KeyError`` saying whether the model has that point at all (with close names) or the cache was run
    with a ``names_filter`` that left it out.
    """

    def __init__(self, model: DecoderOnlyTransformer, token_ids: torch.Tensor, logits: torch.Tensor,
                 store: dict[str, torch.Tensor], heads: list[int] | None = None):
        self.model = model
        self.token_ids = token_ids
        self.logits = logits
        self.heads = heads
        self._store = store

    def __getitem__(self, key) -> torch.Tensor:
        name = act_name(*key) if isinstance(key, tuple) else key
        try:
            return self._store[name]
        except KeyError:
            names = hook_names(self.model)
            if name not in names:
                raise KeyError(str(unknown_name(name, names, self.model.config))) from None
            raise KeyError(f"{name!r} was not kept in this cache ({len(self._store)} activations); run "
                           "run_with_cache with a names_filter that includes it") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations of {tuple(self.token_ids.shape)} ids)"

    def nbytes(self) -> int:
        """Bytes held by the cached activations (each storage counted once)."""
        seen, total = set(), 0
        for t in self._store.values():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def head_results(self, layer: int) -> torch.Tensor:
        """(B, T, H, d_model) what each head of ``layer`` writes into the residual stream: its ``hook_z``
        through its d_head columns of the output projection (``attn.proj``; the identity placement without
        one). ``hook_attn_out`` is their sum plus the projection's bias. With a norm after attention
        (``sandwich_norm``: Gemma's) each is taken through it with the cached scale of their sum
        (``ln1_post.hook_scale``) frozen -- linear, so they still add up to ``hook_attn_out``, as the final norm's
        parts do in :func:`~decoderlab.glassbox.attribution.frozen_final_norm`. Source: TransformerLens's
        ``compute_head_results`` (z @ W_O per head).

        Raises ``KeyError`` when ``hook_z`` (or ``ln1_post.hook_scale``) of the layer was not cached;
        ``ValueError`` for a cache of a head subset."""
        if self.heads is not None:
            raise ValueError(f"this cache kept heads {self.heads} only; head results need all of them")
        z = self[f"blocks.{layer}.attn.hook_z"]  # (B, T, H, d_head)
        out = head_results(self.model, layer, z)
        post = self.model.blocks[layer].norm_1_post
        if post is not None:
            scale = self[f"blocks.{layer}.ln1_post.hook_scale"]  # (B, T, 1)
            out = out / scale.unsqueeze(-1) * post.weight.detach().to(out.dtype)
        return out


def plain_linear(module, name: str):
    """``module`` when it is an ``nn.Linear`` whose weight is the whole map; ``ValueError`` for a layer with
    LoRA adapters (PEFT's), whose weight is not."""
    if module is not None and is_block_layer(module):
        raise ValueError(f"{name} holds {module.kind} blocks (a GGUF file loaded in its own types): the glass box "
                         "reads float weights; load it with dtype='float32'")
    if module is not None and not isinstance(module, torch.nn.Linear):
        raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear (LoRA adapters?): merge them first "
                         "(decoderlab.lora.merge_lora(model)); the glass box reads the weights")
    return module


@torch.no_grad()
def head_results(model: DecoderOnlyTransformer, layer: int, z: torch.Tensor) -> torch.Tensor:
    """(B, T, H, d_model) each head's part of the attention output from its z (B, T, H, d_head).

    Raises ``ValueError`` for an output projection with LoRA adapters (merge them first)."""
    attn = model.blocks[layer].attention
    plain_linear(attn.proj, f"blocks.{layer}.attention.proj")
    h, dh = attn.n_head, attn.d_head
    if attn.proj is None:  # the lesson: the heads are concatenated, each into its own d_head slice
        out = z.new_zeros(*z.shape[:2], h, h * dh)
        for i in range(h):
            out[:, :, i, i * dh:(i + 1) * dh] = z[:, :, i]
        return out
    w_o = attn.proj.weight.view(attn.d_model, h, dh).to(z.dtype)  # (d_model, H, d_head): column block of each head
    return torch.einsum("bthd,mhd->bthm", z, w_o)


def as_ids(model: DecoderOnlyTransformer, token_ids_or_text, tokenizer=None) -> torch.Tensor:
    """(B, T) int64 ids on the model's device, from text (needs a tokenizer), a list or a tensor. A text gets
    the start token its tokenizer puts first (:func:`~decoderlab.tokenizers.encode_with_special_tokens`: Llama's
    ``<s>``, as TransformerLens's ``prepend_bos`` does for a model that uses one; nothing for decoderlab's own
    tokenizers); ids are taken as given.

    Raises:
        ValueError: no tokens, ids out of range, T > max_len, text without a tokenizer.
        KeyError: a word the tokenizer does not know.  TypeError: another kind of input.
    """
    if isinstance(token_ids_or_text, str):
        if tokenizer is None:
            raise ValueError("a text input needs a tokenizer (pass tokenizer=...), or pass token ids instead")
        ids = encode_with_special_tokens(tokenizer, token_ids_or_text)  # KeyError naming a word
        ids = torch.tensor(ids, dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError(f"the text {token_ids_or_text!r} is empty: give at least one token of text")
    elif isinstance(token_ids_or_text, torch.Tensor):
        ids = token_ids_or_text
    elif isinstance(token_ids_or_text, (list, tuple)):
        ids = torch.tensor(token_ids_or_text, dtype=torch.long)
    else:
        raise TypeError(
            f"token_ids_or_text must be a str, a list of ids or a tensor, got {type(token_ids_or_text).__name__}"
        )
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.size(1) == 0:
        raise ValueError(f"need at least one token, as ids of shape (T,) or (B, T); got shape {tuple(ids.shape)}")
    model.check_token_ids(ids)
    if ids.size(1) > model.config.max_len:
        raise ValueError(
            f"sequence length T={ids.size(1)} is longer than max_len={model.config.max_len}; "
            f"allowed: T <= {model.config.max_len}"
        )
    return ids.to(device=model.we.weight.device, dtype=torch.long)


@contextlib.contextmanager
def _eval_no_grad(model: torch.nn.Module):
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def forward_with_hooks(model: DecoderOnlyTransformer, ids: torch.Tensor, fwd_hooks) -> torch.Tensor:
    """``model(ids)`` with ``fwd_hooks`` installed, in eval mode without gradients; the model's mode is
    restored and the hooks removed, even when the pass raises. Returns (B, T, V) logits."""
    with _eval_no_grad(model), use_hooks(model, fwd_hooks):
        return model(ids)


def record(model, ids: torch.Tensor, names: list[str], fwd_hooks=(), heads: list[int] | None = None
           ) -> ActivationCache:
    """The cache of ``names`` for one pass over checked ``ids`` (after any ``fwd_hooks``, which run first
    and so are recorded as they changed the pass); ``heads`` keeps only those heads' slices (copies) of the
    per-head activations, as the pass goes, so a big model's full (B, H, T, T) tensors never pile up -- of the
    key/value points (grouped-query attention's n_kv_head heads), the one each kept head reads, in the same
    order."""
    store: dict[str, torch.Tensor] = {}
    index = None if heads is None else torch.tensor(heads, device=ids.device)
    kv_index = None if heads is None else index // hook_model(model).blocks[0].attention.group

    def keep(x: torch.Tensor, name: str) -> None:
        point = split_name(name)[1].rpartition(".")[2]
        axis = HEAD_AXIS.get(point) if index is not None else None
        store[name] = x if axis is None else x.index_select(axis, kv_index if point in KV_POINTS else index)

    wanted = set(names)
    logits = forward_with_hooks(model, ids, [*fwd_hooks, (wanted.__contains__, keep)])
    return ActivationCache(model, ids, logits, store, heads)


def run_with_cache(model, token_ids, names_filter=None, *, tokenizer=None) -> tuple[torch.Tensor, ActivationCache]:
    """One forward pass keeping every activation ``names_filter`` picks: ``(logits, cache)``.

    Args:
        model: a ``DecoderOnlyTransformer`` (compiled or wrapped is fine).
        token_ids: ids (T,) or (B, T) (tensor or list), or a text with ``tokenizer``.
        names_filter: None (every hook point), a name, a list of names, or a function ``name -> bool``
            (``lambda n: n.startswith("blocks.3.")``).

    Returns logits (B, T, num_tokens) and an :class:`ActivationCache`. The pass runs in eval mode without
    gradients (the model's mode is restored); a layer whose pattern or scores are asked for runs the
    explicit attention kernel (the same function as sdpa, to about 1e-6 in float32), the others the
    configured one. Memory: everything at T tokens is B T (13 d_model + 2 d_ff) floats per layer plus
    2 B H T² for the scores and pattern; filter for a big model.

    Raises:
        ValueError: an unknown hook name (with close names); bad ids (as ``trace``).
        TypeError: not a DecoderOnlyTransformer; a filter of another kind.
    Source: TransformerLens ``HookedRootModule.run_with_cache``.
    """
    model = hook_model(model)
    ids = as_ids(model, token_ids, tokenizer)
    cache = record(model, ids, resolve_names(model, names_filter))
    return cache.logits, cache


def run_with_hooks(model, token_ids, fwd_hooks, *, tokenizer=None) -> torch.Tensor:
    """Logits (B, T, num_tokens) of one forward pass with ``fwd_hooks`` -- pairs ``(name, fn)``, the name
    a hook name or a function ``name -> bool`` -- where ``fn(activation, name)`` returns None or a
    replacement of the same shape and dtype (ready-made ones: :mod:`decoderlab.glassbox.patching`).

    Eval mode, no gradients; the hooks are removed afterwards, even when the pass raises.

    Raises:
        ValueError: an unknown hook name; a replacement of the wrong shape or dtype (naming the hook, the
            point and the expected shape).
        TypeError: a hook that is not a (name, fn) pair; a replacement that is not a tensor.
    Source: TransformerLens ``HookedRootModule.run_with_hooks``.
    """
    model = hook_model(model)
    ids = as_ids(model, token_ids, tokenizer)
    return forward_with_hooks(model, ids, fwd_hooks)


def check_layer(model: DecoderOnlyTransformer, layer: Any) -> int:
    """``layer`` as an int in 0 .. n_layer - 1, or ``ValueError`` naming the valid range."""
    n = model.config.n_layer
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= int(layer) < n:
        raise ValueError(f"layer {layer!r} is out of range; valid layers are 0 .. {n - 1} (n_layer={n})")
    return int(layer)


def check_head(model: DecoderOnlyTransformer, head: Any, point: str = "hook_z") -> int:
    """``head`` as an int in 0 .. n_head - 1 -- or 0 .. n_kv_head - 1 at a key/value ``point`` (``hook_k`` ...,
    grouped-query attention's heads) -- or ``ValueError`` naming the valid range."""
    kv = point.rpartition(".")[2] in KV_POINTS
    n, what = (model.config.kv_heads, "n_kv_head") if kv else (model.config.n_head, "n_head")
    if isinstance(head, bool) or not isinstance(head, numbers.Integral) or not 0 <= int(head) < n:
        raise ValueError(f"head {head!r} is out of range; valid heads are 0 .. {n - 1} ({what}={n})")
    return int(head)
