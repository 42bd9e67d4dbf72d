"""Attention: the multi-head attention of the model, its two kernels, and the KV cache it writes into.

``MultiHeadAttention`` is what ``DecoderOnlyTransformer`` uses (the lessons' own ``SelfAttention`` and
``Attention`` classes live in :mod:`decoderlab.lesson`): one set of projections, the head split and the
masking rules are shared code (grouped-query attention's key/value heads included), and only the kernel differs:

- ``explicit``: the lessons' math, softmax(Q Kᵀ / sqrt(d_k) + mask) V, written out so that the attention
  percents can be returned;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (fused, memory linear in T).

Source: Vaswani et al. 2017, "Attention Is All You Need", eq. (1) and section 3.2.2.

Mask convention everywhere in decoderlab (as in the lesson): a boolean mask whose **True marks a similarity
to ignore**.
"""

from __future__ import annotations

import math
import torch
import torch.nn as nn
import torch.nn.functional as F

from .config.names import KERNELS
from .matvec import linear



def check_last_dim(x: torch.Tensor, d_model: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (T, d_model) or (B, T, d_model); got shape {tuple(x.shape)}")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} has last dimension {x.shape[-1]}, but d_model is {d_model}; "
            f"expected shape (T, {d_model}) or (B, T, {d_model}), got {tuple(x.shape)}"
        )


def check_mask(mask: torch.Tensor, sims_shape: torch.Size) -> torch.Tensor:
    """Check that a boolean 'True = ignore' mask broadcasts to the similarities; return it as bool."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a boolean torch.Tensor (True = ignore), got {type(mask).__name__}")
    try:
        torch.broadcast_shapes(mask.shape, sims_shape)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} cannot broadcast to the similarities of shape {tuple(sims_shape)} "
            f"(queries x keys); allowed: any shape that broadcasts to {tuple(sims_shape)}"
        ) from None
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point:
            raise ValueError(f"mask must be boolean (True = ignore), got dtype {mask.dtype}")
        mask = mask.bool()
    return mask


# ----------------------------------------------------------------------------------------------------------
# Multi-head attention used by the model
# ----------------------------------------------------------------------------------------------------------


def build_ignore_mask(
    t_q: int,
    t_k: int,
    *,
    causal: bool,
    padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Combine the masking rules into one boolean mask, True = ignore, broadcastable to (B, H, T_q, T_k).

    - ``causal``: query i (the i-th of the last T_q positions) may see keys 0 .. (T_k - T_q + i); the
      queries are aligned with the *end* of the keys, which is what a KV cache needs.
    - ``padding_mask``: (B, T_k) bool, True marks a padded key.
    - ``attn_mask``: any bool mask broadcastable to (B, H, T_q, T_k), True = ignore.

    Returns None when nothing is masked.
    """
    mask = None
    if causal:
        i = torch.arange(t_q, device=device).unsqueeze(1) + (t_k - t_q)
        j = torch.arange(t_k, device=device).unsqueeze(0)
        mask = j > i  # (T_q, T_k)
    if padding_mask is not None:
        pm = padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, T_k)
        mask = pm if mask is None else (mask | pm)
    if attn_mask is not None:
        mask = attn_mask if mask is None else (mask | attn_mask)
    return mask


def window_mask(t_q: int, t_k: int, window: int | None, device=None) -> torch.Tensor | None:
    """(T_q, T_k) bool, True where a query is ``window`` or more positions past a key (outside its sliding window;
    the queries aligned with the end of the keys, as :func:`build_ignore_mask`'s causal rule); None when no key
    is that far from any query (no window, or T_k <= window)."""
    if window is None or t_k <= window:
        return None
    i = torch.arange(t_q, device=device).unsqueeze(1) + (t_k - t_q)
    return i - torch.arange(t_k, device=device).unsqueeze(0) >= window


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
    hooks=None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lessons' math: softmax(Q Kᵀ / sqrt(d_head), masked) V, per head (Q Kᵀ times ``scale`` instead when
    given: Gemma's 1 / sqrt(query_pre_attn_scalar)).

    Shapes: q (B, H, T_q, d_head); k, v (B, H, T_k, d_head); mask bool broadcastable to (B, H, T_q, T_k),
    True = ignore. Returns (out (B, H, T_q, d_head), attention percents (B, H, T_q, T_k)). A query whose keys
    are all masked gets percents of zero and an output of zero (not NaN).

    ``hooks`` (the attention layer's hook points, see :mod:`decoderlab.hooks`) sees the masked scaled
    similarities as ``hook_attn_scores`` and the percents as ``hook_pattern``, both (B, H, T_q, T_k), and may
    replace them.

    Half precision (float16, bfloat16): Q Kᵀ is computed and softmaxed in float32 (float16 overflows past
    65504 before the division by sqrt(d_head): q and k of size 100 over 8 dimensions already give 8e4), so the
    result is finite wherever the float32 one is; the hooked scores and percents are float32, the returned
    percents and output have the input's dtype.
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half:
        q, k = q.float(), k.float()
    # scaled and masked in place: the products are this function's own (autograd saves q and k, not them)
    scaled = torch.matmul(q, k.transpose(-2, -1))
    scaled = scaled.div_(math.sqrt(q.size(-1))) if scale is None else scaled.mul_(scale)
    all_masked = None
    if mask is not None:
        # rows with no visible key are filled with 0 to keep the softmax finite, and zeroed below; done for every
        # row rather than after asking whether any is empty (asking would wait for the device)
        all_masked = mask.all(dim=-1, keepdim=True)
        scaled_masked = scaled.masked_fill_(mask, float("-inf")).masked_fill_(all_masked, 0.0)
    else:
        scaled_masked = scaled
    if hooks is not None:
        scaled_masked = hooks("hook_attn_scores", scaled_masked)
    percents = F.softmax(scaled_masked, dim=-1)
    if all_masked is not None:
        percents = percents.masked_fill(all_masked, 0.0)
    if hooks is not None:
        percents = hooks("hook_pattern", percents)
    p = F.dropout(percents, p=dropout_p) if dropout_p > 0 else percents
    out = torch.matmul(p.to(v.dtype), v)
    return out, percents.to(v.dtype) if half else percents


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with decoderlab's mask convention (True = ignore).

    Shapes as :func:`explicit_attention`; with ``enable_gqa`` k and v may have fewer heads (a divisor of q's:
    grouped-query attention, query head j reading key/value head j // group). ``is_causal`` may be set only when
    ``mask`` is None and T_q == T_k (the fused causal path). A query whose keys are all masked returns zeros (not
    NaN). ``scale``: what Q Kᵀ is multiplied by (None: 1 / sqrt(d_head)).
    """
    if _matmul_decode(q, mask, dropout_p, is_causal):
        return _decode_attention(q, k, v, mask, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=enable_gqa,
                                              scale=scale)
    # a row with no visible key lets the kernel see every key, and its output is zeroed: done for every row
    # rather than after asking whether any is empty (asking would wait for the device)
    all_masked = mask.all(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask | all_masked, dropout_p=dropout_p,
                                         enable_gqa=enable_gqa, scale=scale)
    return out.masked_fill(all_masked, 0.0)


#: from this many rows a one-token step's attention is two batched products (:func:`_decode_attention`), not
#: ``F.scaled_dot_product_attention``: its CPU kernels take 2-3x longer on a batch of short heads (256 rows, 4
#: heads of 32, 60 keys: 3.6 ms against 1.2 on an AMD EPYC Zen 4, one thread) and about as long from 8 rows
#: down (SmolLM2's heads at 1 row: 0.02 ms against 0.04) -- bench measurements, docs/generation.md
MATMUL_DECODE_ROWS = 32


def _matmul_decode(q: torch.Tensor, mask: torch.Tensor | None, dropout_p: float, is_causal: bool) -> bool:
    """Whether :func:`sdpa_attention` takes :func:`_decode_attention`: a one-token step of at least
    ``MATMUL_DECODE_ROWS`` rows, float32 or float64, on the CPU, eager, no dropout, a mask shared by the heads."""
    return (q.size(-2) == 1 and q.dim() == 4 and q.size(0) >= MATMUL_DECODE_ROWS and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and dropout_p == 0 and not is_causal
            and (mask is None or mask.dim() == 4 and mask.size(1) == 1) and not torch.compiler.is_compiling())


def _decode_attention(q, k, v, mask, scale):
    """One query per row (T_q = 1) as softmax(q Kᵀ scale) V in two batched matmuls, the query heads of a
    key/value head (GQA) stacked as rows of one product; ``mask`` (B, 1, 1|T_q, T_k), True = ignore. A row
    whose keys are all masked returns zeros, as :func:`sdpa_attention`."""
    b, h, _, d = q.shape
    hk = k.size(1)
    scores = torch.matmul(q.reshape(b, hk, h // hk, d), k.transpose(-1, -2))  # (B, H_kv, G, T_k)
    scores = scores * (d ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).reshape(b, h, 1, d)
    if mask is not None:
        out = out.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return out


class MultiHeadAttention(nn.Module):
    """Multi-head (causal) attention with one set of projections and two kernels (``sdpa`` | ``explicit``).

    The queries, keys and values come from one fused projection ``qkv`` (d_model -> (n_head + 2 n_kv_head)
    d_head; rows [query heads | key heads | value heads], each head d_head consecutive rows); the heads' outputs
    are concatenated and, if ``out_proj``, projected by ``proj`` (n_head d_head -> d_model). With n_kv_head <
    n_head (grouped-query attention, Ainslie et al. 2023) query head j reads key/value head j // (n_head /
    n_kv_head), and the KV cache holds the n_kv_head heads only. With n_head=1 and no output projection this is
    exactly the lesson's ``Attention`` (the 37-parameter StatQuest model).

    Args:
        d_model, n_head: sizes; d_model must be divisible by n_head unless ``head_dim`` is given.
        n_kv_head: key/value heads (0 = n_head; n_head must be a multiple of it).
        head_dim: values per head (0 = d_model // n_head).
        bias: biases in the projections. qkv_bias: biases in ``qkv`` only (Qwen2).
        dropout: dropout on the attention percents and on the output.
        kernel: ``"sdpa"`` or ``"explicit"``; both compute the same function (tested to 1e-5).
        out_proj: whether to apply the output projection.
        rope: an optional rotary embedding (``positions.RotaryEmbedding``) applied to queries and keys.
        qk_norm: RMS-normalise each head's queries and keys (over d_head, eps ``qk_norm_eps``) before rope
            (Henry et al. 2020); with ``qk_norm_gain`` times a learned gain (d_head,) shared by the heads,
            ``q_norm.weight`` and ``k_norm.weight`` (Qwen3), else no gain.
        sliding_window: None (every earlier position), or W: query i sees key j only when i - j < W (Mistral's
            and Gemma's local layers; transformers' ``sliding_window``). A KV cache of this layer may then hold
            the last W keys only (:class:`LayerKVCache`'s ring).
        scale: what Q Kᵀ is multiplied by (None: 1 / sqrt(d_head); Gemma's 1 / sqrt(query_pre_attn_scalar)).

    ``forward(x, kv=None, *, causal=True, padding_mask=None, attn_mask=None, positions=None, cache=None,
    return_weights=False)``:
        x: (B, T_q, d_model) queries' input (and keys'/values' input when ``kv`` is None); an unbatched
            (T_q, d_model) input gives (T_q, d_model).
        kv: (B, T_k, d_model) keys'/values' input for cross-attention.
        padding_mask: (B, T_k) bool, True = padded key. attn_mask: bool, broadcastable to (B, H, T_q, T_k),
        True = ignore. positions: (T_q,) or (B, T_q) positions of the queries, for rope (taken as given: the
        model range-checks them once per call). cache: a per-layer KV cache; new keys/values are appended and
        attention runs over all cached ones (a decode step's new token must not be padded).
    Returns (B, T_q, d_model), or (that, percents (B, H, T_q, T_k)) when ``return_weights`` (which uses the
    explicit kernel whatever the configured one).

    Hook points (:mod:`decoderlab.hooks`; ``self.hooks`` is None unless the glass box installed some, and then
    costs one test per point): ``hook_q`` (B, T, H, d_head), ``hook_k``, ``hook_v`` (B, T, n_kv_head, d_head)
    as projected, ``hook_q_normed`` / ``hook_k_normed`` after QK-norm (and its gain), ``hook_rot_q`` /
    ``hook_rot_k`` after rope (in the model's rope layout); ``hook_attn_scores`` and ``hook_pattern``
    (B, H, T_q, T_k) inside the explicit kernel (which the layer then uses); ``hook_z`` (B, T, H, d_head), the
    heads' outputs before the output projection. (TransformerLens's shapes for grouped-query attention.)
    """

    def __init__(
        self,
        d_model: int,
        n_head: int = 1,
        *,
        n_kv_head: int = 0,
        head_dim: int = 0,
        bias: bool = False,
        qkv_bias: bool = False,
        dropout: float = 0.0,
        kernel: str = "sdpa",
        out_proj: bool = True,
        rope: nn.Module | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-5,
        qk_norm_gain: bool = False,
        sliding_window: int | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        n_kv = n_kv_head or n_head
        if n_head < 1 or (not head_dim and d_model % n_head != 0):
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head}), with n_head >= 1")
        if n_kv < 1 or n_head % n_kv != 0:
            raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; allowed: {', '.join(KERNELS)}")
        self.d_model = d_model
        self.n_head = n_head
        self.n_kv_head = n_kv
        self.group = n_head // n_kv  # query heads per key/value head
        self.d_head = head_dim or d_model // n_head
        self.q_size, self.kv_size = n_head * self.d_head, n_kv * self.d_head  # the widths of q and of k (of v)
        if not out_proj and self.q_size != d_model:
            raise ValueError(f"without an output projection the heads' width {self.q_size} must be d_model ({d_model})")
        self.kernel = kernel
        self.dropout = dropout
        self.sliding_window = sliding_window or None
        self.scale = scale
        self.qkv = nn.Linear(d_model, self.q_size + 2 * self.kv_size, bias=bias or qkv_bias)
        self.proj = nn.Linear(self.q_size, d_model, bias=bias) if out_proj else None
        self.resid_dropout = nn.Dropout(dropout)
        self.rope = rope
        self.qk_norm = qk_norm
        self.qk_norm_eps = qk_norm_eps
        gains = qk_norm and qk_norm_gain
        self.q_norm = nn.RMSNorm(self.d_head, eps=qk_norm_eps) if gains else None
        self.k_norm = nn.RMSNorm(self.d_head, eps=qk_norm_eps) if gains else None
        self.hooks = None  # decoderlab.hooks installs a dispatcher here; None = no hook points, the hot path

    def project(self, x: torch.Tensor, kv: torch.Tensor | None = None):
        """The shared projections: returns q (B, H, T_q, d_head), k, v (B, n_kv_head, T_k, d_head)."""
        if kv is None:  # one matmul, then views: (B, T, (H + 2 H_kv) d_head) -> q, k, v
            b, t, _ = x.shape
            q, k, v = linear(self.qkv, x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        else:
            b, t = x.size(0), kv.size(1)
            w, bias = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[: self.q_size], None if bias is None else bias[: self.q_size])
            k, v = F.linear(kv, w[self.q_size :], None if bias is None else bias[self.q_size :]).split(
                self.kv_size, dim=-1
            )
        return (q.view(b, -1, self.n_head, self.d_head).transpose(1, 2),
                k.view(b, t, self.n_kv_head, self.d_head).transpose(1, 2),
                v.view(b, t, self.n_kv_head, self.d_head).transpose(1, 2))

    def _norm_and_rotate(self, q, k, positions, cross: bool, hooks):
        """QK-norm, then rotary positions (queries at ``positions``; self-attention keys too), on (B, H, T,
        d_head) queries and (B, H_kv, T, d_head) keys, with their hook points."""
        if self.qk_norm:
            q = F.rms_norm(q, (self.d_head,), None if self.q_norm is None else self.q_norm.weight, self.qk_norm_eps)
            k = F.rms_norm(k, (self.d_head,), None if self.k_norm is None else self.k_norm.weight, self.qk_norm_eps)
            if hooks is not None:
                q, k = hooks.heads("hook_q_normed", q), hooks.heads("hook_k_normed", k)
        if self.rope is not None:
            # the positions are the caller's, range-checked once per call by the model: a check here would wait
            # for the device in every layer of every decode step
            q = self.rope(q, positions, check=False)
            k = self.rope(k, None if cross else positions, check=False)
            if hooks is not None:
                q, k = hooks.heads("hook_rot_q", q), hooks.heads("hook_rot_k", k)
        return q, k

    def _queries_keys_values(self, x, kv, positions, cache):
        """q (B, H, T_q, d_head) and the keys and values attention reads, (B, H_kv, T_k, d_head) -- the cache's
        when there is one, after this call's are written into it -- with their hook points."""
        q, k, v = self.project(x, kv)
        hooks = self.hooks
        if hooks is not None:
            q, k, v = hooks.heads("hook_q", q), hooks.heads("hook_k", k), hooks.heads("hook_v", v)
        if self.qk_norm or self.rope is not None:
            q, k = self._norm_and_rotate(q, k, positions, kv is not None, hooks)
        if cache is not None and q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu":
            # PyTorch's CPU attention kernels in float16/bfloat16 are many times slower than in float32 for one
            # query over a cache (measured 704/362 us vs 42 us per call at d_head 64, 200 keys): a half-precision
            # model decodes with float32 attention and a float32 KV cache; its weights stay half
            q, k, v = q.float(), k.float(), v.float()
        if cache is not None:
            k, v = cache.update(k, v)
        return q, k, v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T, d) keys or values -> (B, H, T, d), each repeated for the query heads of its group
        (Hugging Face's ``repeat_kv``); the tensor itself without groups."""
        return t if self.group == 1 else t.repeat_interleave(self.group, dim=1)

    def _key_masks(self, t_q: int, t_k: int, padding_mask, cache, device):
        """``(padding mask over the keys attention reads, the sliding window's ignore mask or None)``.

        The keys are a KV cache's (:class:`LayerKVCache`: all of them from column 0, the ones from a later column,
        or a wrapped ring's unordered last W) or this call's own; ``padding_mask`` (B, T) covers every column of
        the sequence. The window: for keys in order, (T_q, T_k) True where a query is W or more columns past a
        key, when T_k > W (else nothing is out of it); in a static step (one query at the cache's device-side
        ``column``) the columns W or more before it, (T_k,); a wrapped ring holds only keys inside it."""
        window, mask = self.sliding_window, None
        if cache is not None and cache.owner.static and t_q == 1:  # the step's query sits at column, not at the end
            if window is not None:
                mask = cache.owner._columns[:t_k] <= cache.owner.column - window
            return padding_mask, mask
        if cache is not None and cache.key_start is None:  # a wrapped ring: the columns of its slots
            if padding_mask is not None:
                padding_mask = padding_mask.index_select(1, cache.slot_columns(device))
            return padding_mask, None
        start = cache.key_start if cache is not None else 0
        if padding_mask is not None and start:
            padding_mask = padding_mask[:, start:]
        return padding_mask, window_mask(t_q, t_k, window, device)

    def _attend(self, q, k, v, *, causal, padding_mask, attn_mask, p_drop, return_weights, cache):
        """The kernel: (B, H, T_q, d_head) head outputs and the percents (B, H, T_q, T_k) or None. ``cache``: the
        layer's KV cache k and v come from, or None (a one-query step over a cache then sees every key but the
        padded ones and those outside the sliding window)."""
        hooks = self.hooks
        t_q, t_k = q.size(2), k.size(2)
        if attn_mask is not None:
            attn_mask = check_mask(attn_mask, torch.Size((q.size(0), self.n_head, t_q, t_k)))
        padding_mask, window = self._key_masks(t_q, t_k, padding_mask, cache, q.device)
        if padding_mask is not None and tuple(padding_mask.shape) != (q.size(0), t_k):
            raise ValueError(
                f"padding_mask must have shape (B, T_k) = {(q.size(0), t_k)}; got {tuple(padding_mask.shape)}"
            )
        if window is not None and window.dim() == 1:  # a static step's hidden columns: one key mask for every row
            padding_mask = window.expand(q.size(0), t_k) if padding_mask is None else padding_mask | window
        elif window is not None:
            attn_mask = window if attn_mask is None else attn_mask | window
        if (self.kernel == "explicit" or return_weights
                or (hooks is not None and hooks.needs_pattern)):  # the pattern exists only there
            mask = build_ignore_mask(
                t_q, t_k, causal=causal, padding_mask=padding_mask, attn_mask=attn_mask, device=q.device
            )
            return explicit_attention(q, self.expand_kv(k), self.expand_kv(v), mask, p_drop, hooks=hooks,
                                      scale=self.scale)
        # sdpa reads grouped keys and values as they are (enable_gqa): a decode step over a cache of 128-2048 keys
        # took 0.1-0.5x the time of repeating them per query head first (bench/attention.py --gqa-decode)
        gqa, scale = self.group > 1, self.scale
        if causal and padding_mask is None and attn_mask is None and (t_q == t_k or t_q == 1):  # fused causal
            return sdpa_attention(q, k, v, None, is_causal=t_q > 1, dropout_p=p_drop, enable_gqa=gqa,
                                  scale=scale), None
        if cache is not None and causal and t_q == 1 and attn_mask is None and padding_mask is not None:
            # a decode step's one query sees every cached key but the padded ones; the new token is never
            # padded, so no row is empty: the kernel alone, (B, 1, 1, T_k) True = attend
            mask = ~padding_mask[:, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop, enable_gqa=gqa,
                                                  scale=scale), None
        mask = build_ignore_mask(
            t_q, t_k, causal=causal, padding_mask=padding_mask, attn_mask=attn_mask, device=q.device
        )
        return sdpa_attention(q, k, v, mask, dropout_p=p_drop, enable_gqa=gqa, scale=scale), None

    def forward(
        self,
        x: torch.Tensor,
        kv: torch.Tensor | None = None,
        *,
        causal: bool = True,
        padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: "LayerKVCache | None" = None,
        return_weights: bool = False,
    ):
        if x.dim() == 2 and (kv is None or kv.dim() == 2):  # unbatched (T, d_model), as the lesson's blocks
            out = self.forward(
                x[None], None if kv is None else kv[None], causal=causal,
                padding_mask=None if padding_mask is None else padding_mask.reshape(1, -1),
                attn_mask=attn_mask, positions=positions, cache=cache, return_weights=return_weights,
            )
            return (out[0][0], out[1][0]) if return_weights else out[0]
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, T, {self.d_model}) or (T, {self.d_model}); got {tuple(x.shape)}")
        if kv is not None and (kv.dim() != 3 or kv.shape[-1] != self.d_model):
            raise ValueError(f"kv must have shape (B, T_k, {self.d_model}); got {tuple(kv.shape)}")
        q, k, v = self._queries_keys_values(x, kv, positions, cache)
        p_drop = self.dropout if self.training else 0.0
        y, weights = self._attend(q, k, v, causal=causal, padding_mask=padding_mask, attn_mask=attn_mask,
                                  p_drop=p_drop, return_weights=return_weights, cache=cache)
        if self.hooks is not None:
            y = self.hooks.heads("hook_z", y)
        y = y.transpose(1, 2).reshape(y.size(0), q.size(2), self.q_size).to(x.dtype)  # (a no-op unless upcast)
        if self.proj is not None:
            y = linear(self.proj, y)
        if p_drop:
            y = self.resid_dropout(y)
        if return_weights:
            return y, weights
        return y


# ----------------------------------------------------------------------------------------------------------
# The KV cache the attention layers write into while decoding
# ----------------------------------------------------------------------------------------------------------


class LayerKVCache:
    """Keys and values of one layer, preallocated once: k, v of shape (B, H_kv, capacity, d_head), H_kv the
    layer's key/value heads (n_kv_head: grouped-query attention caches only those) (a static cache: capacity + 1,
    one spare column, see ``_allocate``).

    ``update(k_new, v_new)`` writes the new keys/values (B, H_kv, T_new, d_head) after the ones already held and
    returns views of all of them, (B, H_kv, length + T_new, d_head). The owning :class:`KVCache` advances the
    shared length once per forward pass.

    In a static cache (``KVCache(..., static=True)``) a one-token step writes at the owner's ``column`` (a
    device tensor) and returns the whole buffers, (B, H, capacity, d_head): the same shapes at every token,
    and no Python number that changes, so a compiled decode step runs one graph for the whole context
    (:meth:`KVCache.step_mask` hides the columns not written yet) -- or, with the owner's ``window`` set (the
    AOT step's symbolic length), the first ``window`` columns. Prefills (T_new > 1) write as above.

    ``ring``: W for a sliding-window layer in a cache that is not static: the buffers hold W columns, column c in
    slot c mod W, so the cache keeps only the keys a later query can see. A step before the ring wraps reads
    slots 0 .. length in order; a one-token step after writes over the key W columns back (outside every later
    query's window) and reads the whole ring, unordered (``key_start`` None; :meth:`slot_columns` gives each
    slot's column, for the padding); a prefill reads the held keys in order, then its own, and keeps the last W.
    ``key_start``: the column of the first key the last ``update`` returned, when they are in order.
    """

    def __init__(self, owner: "KVCache", ring: int | None = None):
        self.owner = owner
        self.ring = ring
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.key_start: int | None = 0

    def _allocate(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        b, h, _, d = k_new.shape
        # a static cache's unwritten columns are read (under a mask): zeros, never NaN (0 x NaN would leak). It
        # keeps one spare column past its capacity, never read, so that a window of any length up to the
        # capacity is a strict prefix of the buffer: torch.export would otherwise specialise a symbolic window
        # away from the full length (the prefix's contiguity differs there)
        make = torch.zeros if self.owner.static and self.owner.zero_unwritten else torch.empty
        cols = self.owner.capacity + (1 if self.owner.static else 0)
        if self.ring is not None:
            cols = min(self.ring, self.owner.capacity)
        self.k = make(b, h, cols, d, dtype=k_new.dtype, device=k_new.device)
        self.v = make(b, h, cols, d, dtype=v_new.dtype, device=v_new.device)
        if self.owner.static:  # fixed addresses, so that CUDA graphs can replay over them
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        if self.k is None or self.k.size(0) != k_new.size(0) or self.k.dtype != k_new.dtype:
            self._allocate(k_new, v_new)
        if self.ring is not None and o.length + k_new.size(2) > self.ring:
            return self._ring_update(k_new, v_new)
        self.key_start = 0
        if o.static and k_new.size(2) == 1:  # a static step (the model masks the unwritten columns)
            self.k.index_copy_(2, o.column, k_new)
            self.v.index_copy_(2, o.column, v_new)
            w = o.step_columns()
            return self.k[:, :, :w], self.v[:, :, :w]
        start = o.length
        end = start + k_new.size(2)
        if end > o.capacity:
            raise ValueError(f"KV cache is full: {end} tokens would exceed its capacity of {o.capacity}")
        self.k[:, :, start:end] = k_new
        self.v[:, :, start:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]

    def _ring_update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The update of a ring past its W columns (see the class docstring)."""
        w, start, t = self.ring, self.owner.length, k_new.size(2)
        if start + t > self.owner.capacity:
            raise ValueError(f"KV cache is full: {start + t} tokens would exceed its capacity of {self.owner.capacity}")
        if t == 1 and start >= w:  # a step: the new key over the one W back, the whole ring read
            self.k[:, :, start % w] = k_new[:, :, 0]
            self.v[:, :, start % w] = v_new[:, :, 0]
            self.key_start = None
            return self.k, self.v
        held = min(start, w)  # columns start - held .. start - 1, in order, then this call's
        order = torch.arange(start - held, start, device=k_new.device) % w
        k = torch.cat((self.k.index_select(2, order), k_new), dim=2)
        v = torch.cat((self.v.index_select(2, order), v_new), dim=2)
        kept = min(w, held + t)
        slots = torch.arange(start + t - kept, start + t, device=k_new.device) % w
        self.k.index_copy_(2, slots, k[:, :, -kept:])
        self.v.index_copy_(2, slots, v[:, :, -kept:])
        self.key_start = start - held
        return k, v

    def slot_columns(self, device) -> torch.Tensor:
        """(W,) the column each slot of a wrapped ring holds after the last step (the newest at column length)."""
        w, last = self.ring, self.owner.length
        return last - (last - torch.arange(w, device=device)) % w


class KVCache:
    """A per-layer key/value cache for a ``DecoderOnlyTransformer``, allocated once per generation call.

    Args:
        n_layer: number of decoder blocks.
        capacity: most tokens it holds (the model's max_len).
        static: keep the shapes of a one-token step fixed (see :class:`LayerKVCache`), for a compiled decode
            step (``DecoderOnlyTransformer.compile_decode``); an eager step is faster without (it attends to
            the columns written so far only). ``window``: None, or how many leading columns a static step
            reads (the rest are not written yet) -- set by a step compiled for a symbolic window (the AOT step,
            :mod:`decoderlab.aot`), so that attention reads the written columns only.
        zero_unwritten: a static cache starts as zeros, since a step over its whole capacity reads the unwritten
            columns (masked: zeros, never NaN, as 0 x NaN would leak); False for a step that reads the written
            ones only (the AOT step's window), which then skips zeroing the buffers at every call (at GPT-2's
            shape 75 MB, 6% of a 64-token generation).
        device: where a static cache keeps ``column`` (the model's device).
        windows: each layer's sliding window (None: full attention), for a cache that is not static: such a
            layer keeps its last W keys only (a ring, :class:`LayerKVCache`). None: every layer keeps every key.

    ``length`` is the number of positions already cached; the model's forward pass reads it (new tokens get
    positions length .. length+T-1) and then calls ``advance(T)``; ``model.decode`` leaves the advance to its
    caller. A static cache also holds ``length`` on the device, as ``column`` (1,) int64, the column the next
    step writes. ``reset()`` empties it for reuse.
    """

    def __init__(self, n_layer: int, capacity: int, *, static: bool = False,
                 device: torch.device | str | None = None, zero_unwritten: bool = True, windows=None):
        self.capacity = capacity
        self.zero_unwritten = zero_unwritten
        self.length = 0
        self.static = static
        rings = windows if windows is not None and not static else [None] * n_layer
        self.layers = [LayerKVCache(self, ring) for ring in rings]
        self.window = None
        if static:
            self.column = torch.zeros(1, dtype=torch.long, device=device)
            self._columns = torch.arange(capacity, device=device)
            torch._dynamo.mark_static_address(self.column)

    @classmethod
    def for_model(cls, model, *, static: bool = False, zero_unwritten: bool = True) -> "KVCache":
        p = next(model.parameters(), None)
        cfg = model.config
        return cls(cfg.n_layer, cfg.max_len, static=static, device=p.device if p is not None else None,
                   zero_unwritten=zero_unwritten, windows=[cfg.window_of(i) for i in range(cfg.n_layer)])

    def step_columns(self):
        """How many leading columns a static one-token step reads: the ``window`` when one is set (symbolic in
        the AOT step); else, over a cache not zeroed, the written ones (``length`` + 1, a host number: an eager
        step, such as a one-token prefill); else the whole capacity (the compiled step's fixed shape)."""
        if self.window is not None:
            return self.window
        return self.capacity if self.zero_unwritten else self.length + 1

    def step_mask(self, padding_mask: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The (B, W) key mask of a static step over the W columns it reads (:meth:`step_columns`),
        True = ignore: the columns after ``column`` (not written yet) and, where ``padding_mask`` (B, T_k <=
        capacity, True = padded) says so, the padded ones."""
        w = self.step_columns()
        columns = self._columns[:w]
        hidden = (columns > self.column).expand(batch, w)
        if padding_mask is None:
            return hidden
        pm = padding_mask.to(torch.bool)
        if self.window is not None or not self.zero_unwritten:  # fewer columns than the capacity: gathered,
            # not sliced (a slice would specialise a symbolic window, as in LayerKVCache._allocate)
            return hidden | pm.index_select(1, columns)
        if pm.size(1) < w:  # the columns past the mask are hidden already
            pm = F.pad(pm, (0, w - pm.size(1)))
        return hidden | pm

    def advance(self, t: int) -> None:
        self.length += t
        if self.static:
            if self.length > self.capacity:  # (a static step writes where it is told: checked here, on the host)
                raise ValueError(f"KV cache is full: {self.length} tokens exceed its capacity of {self.capacity}")
            self.column.fill_(self.length)

    def reset(self) -> None:
        self.length = 0
        if self.static:
            self.column.zero_()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (indices, (B',) int64) of every layer, e.g. the rows of a batch still
        generating; an index may repeat (that row copied: a prompt's samples sharing its prefill). Only the columns
        written are copied: a cache spans the whole context (SmolLM2's 8,192
        columns) and the pages never written are never touched, so copying them would make resident what never
        was (GBs for a batch of 128).

        Raises:
            ValueError: on a static cache, whose shapes a compiled step holds fixed.
        """
        if self.static:
            raise ValueError("a static KV cache keeps its batch rows (a compiled step's shapes are fixed)")
        for layer in self.layers:
            if layer.k is not None:
                w = min(self.length, layer.k.size(2))
                layer.k, layer.v = (_rows_written(t, rows, w) for t in (layer.k, layer.v))


def _rows_written(buffer: torch.Tensor, rows: torch.Tensor, written: int) -> torch.Tensor:
    """Rows ``rows`` of a cache buffer (B, H, C, D) in a new (B', H, C, D) buffer, its first ``written`` columns
    copied, the rest unwritten."""
    out = buffer.new_empty(len(rows), *buffer.shape[1:])
    out[:, :, :written] = buffer[:, :, :written].index_select(0, rows)
    return out
