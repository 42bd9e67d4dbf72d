"""Attribution that adds up: the logit lens, and a logit decomposed into the parts of the residual stream.

The residual stream before the final norm is a sum: word embeddings + positions + every head's output +
each attention output's bias + every MLP's output (:func:`residual_parts`). The final norm is not linear,
but with its scale frozen from the clean run (TransformerLens's convention, ``ln_final.hook_scale``) it is:
layernorm sends each part to (part - mean(part)) / scale * gain, RMSNorm to part / scale * gain, no norm to
the part itself; the norm's bias and the output layer's bias are parts of their own. So the logit of token
``v`` at position ``t`` is exactly the sum of its parts' contributions (:func:`decompose`; the tests hold
it to 1e-9 in float64 for every model variant, and ``reference.numpy_decompose`` recomputes it apart).

Sources: nostalgebraist 2020, "interpreting GPT: the logit lens"; Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits" (direct logit attribution); TransformerLens ``ActivationCache``
(``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``logit_attrs``, ``apply_ln_to_stack``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..hooks import has_point
from ..model import DecoderOnlyTransformer
from .cache import ActivationCache

#: TransformerLens's labels of the logit lens's entries: layer L's input, then the last block's output
FINAL_LABEL = "final_post"


def lens_names(model: DecoderOnlyTransformer) -> list[str]:
    """The hook names :func:`logit_lens` reads (a ``names_filter`` for ``run_with_cache``)."""
    n = model.config.n_layer
    return [f"blocks.{i}.hook_resid_pre" for i in range(n)] + [f"blocks.{n - 1}.hook_resid_post"]


def decompose_names(model: DecoderOnlyTransformer) -> list[str]:
    """The hook names :func:`residual_parts` and :func:`decompose` read (a ``names_filter``)."""
    names = ["hook_embed", "hook_pos_embed"]
    for i in range(model.config.n_layer):
        names += [f"blocks.{i}.attn.hook_z", f"blocks.{i}.ln1_post.hook_scale", f"blocks.{i}.hook_mlp_out"]
    return [name for name in names + ["ln_final.hook_scale"] if has_point(model, name)]


def _positions(cache: ActivationCache, positions) -> list[int]:
    t = cache.token_ids.size(1)
    if positions is None:
        return list(range(t))
    items = [positions] if isinstance(positions, numbers.Integral) else list(positions)
    out = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or not -t <= int(p) < t:
            raise ValueError(f"position {p!r} is outside the sequence; valid positions are 0 .. {t - 1} "
                             f"(or -{t} .. -1 from the end)")
        out.append(int(p) % t)
    return out


@dataclass
class LogitLens:
    """The next-token logits read from every layer's residual stream.

    Attributes:
        labels: "0_pre" .. "{n_layer - 1}_pre" (the input of each layer), then "final_post".
        positions: the positions read (indices into the sequence).
        logits: (n_layer + 1, B, P, num_tokens); the last entry is the model's own logits.
    """

    labels: list[str]
    positions: list[int]
    logits: torch.Tensor

    def probs(self) -> torch.Tensor:
        """(n_layer + 1, B, P, num_tokens) softmax of the logits (computed in float32 at least)."""
        return torch.softmax(self.logits.to(torch.promote_types(self.logits.dtype, torch.float32)), dim=-1)

    def top(self, position: int = -1, k: int = 5, batch: int = 0) -> list[list[tuple[int, float]]]:
        """For each entry, the ``k`` most probable next tokens at ``self.positions[position]`` as
        (id, probability), most probable first."""
        probs = self.probs()[:, batch, position]
        vals, ids = probs.topk(min(k, probs.size(-1)), dim=-1)
        return [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]

    def _token_index(self, tokens) -> torch.Tensor:
        """``tokens`` as (B, P) ids: one id for every cell, or a tensor/list of (B, P) ids (or (P,) for B=1)."""
        _, b, p, v = self.logits.shape
        if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool):
            tokens = torch.full((b, p), int(tokens), dtype=torch.long)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.logits.device)
        ids = ids.view(1, -1) if ids.dim() == 1 and b == 1 else ids
        if tuple(ids.shape) != (b, p):
            raise ValueError(f"tokens must be one id or (B, P) = ({b}, {p}) ids (one per batch row and position "
                             f"read), got shape {tuple(ids.shape)}")
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < v:
            raise ValueError(f"token ids must be in 0 .. {v - 1} (num_tokens={v}); got {ids.min()} .. {ids.max()}")
        return ids.to(self.logits.device)

    def token_probs(self, tokens) -> torch.Tensor:
        """(n_layer + 1, B, P) each entry's probability of ``tokens`` -- one id, or (B, P) ids, one per batch
        row and position read (e.g. the correct next token of each). Raises ``ValueError`` for another shape
        or an id outside the vocabulary."""
        ids = self._token_index(tokens)
        index = ids.unsqueeze(0).unsqueeze(-1).expand(self.logits.size(0), -1, -1, 1)
        return self.probs().gather(-1, index).squeeze(-1)

    def ranks(self, tokens) -> torch.Tensor:
        """(n_layer + 1, B, P) int64 the rank of ``tokens`` (as :meth:`token_probs`) in each entry: how many
        tokens have a strictly larger logit (0: on top; a tie for the top counts as on top)."""
        ids = self._token_index(tokens)
        index = ids.unsqueeze(0).unsqueeze(-1).expand(self.logits.size(0), -1, -1, 1)
        mine = self.logits.gather(-1, index)
        return (self.logits > mine).sum(-1)

    def first_on_top(self, tokens, stay: bool = False) -> torch.Tensor:
        """(B, P) int64 the first entry (an index into :attr:`labels`: 0 is the embeddings' reading, n_layer
        the model's output) whose most probable token is ``tokens`` (as :meth:`token_probs`), or -1 where no
        entry puts it on top. "First" is first: a later entry may lose it again (see :meth:`ranks`); with
        ``stay``, the first entry from which every later one keeps it on top, the output included (-1 where
        the output does not)."""
        top = self.ranks(tokens) == 0  # (L + 1, B, P)
        if stay:  # on top here and in every later entry
            top = top.flip(0).to(torch.int64).cumprod(0).flip(0).bool()
        first = top.to(torch.int64).argmax(0)
        return torch.where(top.any(0), first, torch.full_like(first, -1))

    def table(self, position: int = -1, k: int = 3, batch: int = 0, tokenizer=None) -> str:
        """One line per entry: its label and its top ``k`` tokens with probabilities (the CLI's table)."""
        name = (lambda i: repr(tokenizer.decode([i]))) if tokenizer is not None else str
        width = max(len(s) for s in self.labels)
        lines = [f"logit lens at position {self.positions[position]}:"]
        for label, row in zip(self.labels, self.top(position, k, batch)):
            lines.append(f"  {label:<{width}}  " + "  ".join(f"{name(i)} {p:.3f}" for i, p in row))
        return "\n".join(lines)


@torch.no_grad()
def logit_lens(cache: ActivationCache, positions=None) -> LogitLens:
    """The logit lens: each layer's input residual (``blocks.L.hook_resid_pre``) and the last block's output
    through the final norm -- its statistics recomputed for that residual, as the model would if it stopped
    there -- and the output layer ``fc_layer`` (with its bias).

    Args:
        cache: from ``run_with_cache`` (holding :func:`lens_names`).
        positions: None (all), one position or a list (negative counts from the end).

    Returns a :class:`LogitLens`; its last entry equals ``cache.logits`` at those positions.

    Raises:
        ValueError: a position outside the sequence.  KeyError: a residual the cache did not keep.
    Source: nostalgebraist 2020; TransformerLens ``accumulated_resid(apply_ln=True)`` then ``W_U``, ``b_U``.
    """
    model = cache.model
    pos = _positions(cache, positions)
    stack = torch.stack([cache[name][:, pos] for name in lens_names(model)])  # (L + 1, B, P, d_model)
    logits = model.fc_layer(model.norm_f(stack))
    labels = [f"{i}_pre" for i in range(model.config.n_layer)] + [FINAL_LABEL]
    return LogitLens(labels=labels, positions=pos, logits=logits)


@torch.no_grad()
def residual_parts(cache: ActivationCache) -> tuple[list[str], torch.Tensor]:
    """The final residual stream split into what wrote it: ``(labels, parts)``, parts (n_parts, B, T, d_model)
    summing to ``blocks.{n_layer-1}.hook_resid_post``.

    Labels: "embed", "pos_embed" (learned or sinusoidal positions), then per layer L "L{L}H{h}" for each head
    (its ``hook_z`` through its columns of the output projection; a value bias travels inside), "L{L} attn
    bias" (the output projection's bias, when it has one) and "L{L} mlp" (the MLP's output, with an MLP).

    Raises ``KeyError`` for an activation the cache did not keep (see :func:`decompose_names`).
    Source: TransformerLens ``decompose_resid`` and ``stack_head_results``.
    """
    model = cache.model
    labels, parts = ["embed"], [cache["hook_embed"]]
    if has_point(model, "hook_pos_embed"):
        labels.append("pos_embed")
        parts.append(cache["hook_pos_embed"])
    for i, block in enumerate(model.blocks):
        heads = cache.head_results(i)  # (B, T, H, d_model)
        labels += [f"L{i}H{h}" for h in range(heads.size(2))]
        parts += list(heads.unbind(2))
        proj = block.attention.proj
        if proj is not None and proj.bias is not None:
            labels.append(f"L{i} attn bias")
            parts.append(proj.bias.to(heads.dtype).expand_as(parts[0]))
        if block.has_mlp:
            labels.append(f"L{i} mlp")
            parts.append(cache[f"blocks.{i}.hook_mlp_out"])
    return labels, torch.stack(parts)


@torch.no_grad()
def frozen_final_norm(cache: ActivationCache, stack: torch.Tensor) -> torch.Tensor:
    """The final norm applied to each part of ``stack`` (n, B, T, d_model) with the scale frozen from the
    cached pass (``ln_final.hook_scale``), without the norm's bias: linear, so the parts add up.

    Source: TransformerLens ``apply_ln_to_stack`` (centre for layernorm, divide by the cached scale)."""
    norm = cache.model.norm_f
    if isinstance(norm, nn.Identity):
        return stack
    if isinstance(norm, nn.LayerNorm):
        stack = stack - stack.mean(-1, keepdim=True)
    return stack / cache["ln_final.hook_scale"] * norm.weight.to(stack.dtype)


@torch.no_grad()
def logit_attrs(cache: ActivationCache, stack: torch.Tensor, tokens) -> torch.Tensor:
    """(n, B, T) each part's direct contribution to the logit of ``tokens``: the part through the frozen
    final norm (:func:`frozen_final_norm`), dotted with that token's row of ``fc_layer.weight``.

    ``tokens``: one id for every position, or (B, T) ids, one per position.
    Source: TransformerLens ``logit_attrs``."""
    weight = cache.model.fc_layer.weight.to(stack.dtype)  # (V, d_model)
    direction = weight[tokens] if isinstance(tokens, torch.Tensor) else weight[int(tokens)]
    return (frozen_final_norm(cache, stack) * direction).sum(-1)


@dataclass
class Decomposition:
    """The logit of ``token`` at ``position`` (batch row ``batch``) split into its parts.

    Attributes:
        labels: the parts (:func:`residual_parts`'s labels, then "final norm bias" for a layernorm with a
            bias and "unembed bias" for an output layer with one).
        values: (n_parts,) each part's contribution, in nats of logit, in the model's dtype.
        logit: the model's logit (0-d tensor); ``values.sum()`` equals it up to rounding.
    """

    labels: list[str]
    values: torch.Tensor
    logit: torch.Tensor
    position: int
    token: int
    batch: int = 0

    def total(self) -> torch.Tensor:
        """The sum of the parts (0-d tensor)."""
        return self.values.sum()

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.labels, self.values.tolist()))

    def table(self, tokenizer=None) -> str:
        """One line per part, largest first by size, then the sum and the model's logit (the CLI's table)."""
        tok = repr(tokenizer.decode([self.token])) if tokenizer is not None else str(self.token)
        width = max(len(s) for s in self.labels)
        order = sorted(range(len(self.labels)), key=lambda i: -abs(float(self.values[i])))
        lines = [f"logit of {tok} at position {self.position}, by part:"]
        lines += [f"  {self.labels[i]:<{width}}  {float(self.values[i]):+.6f}" for i in order]
        lines.append(f"  {'sum':<{width}}  {float(self.total()):+.6f}   (model's logit {float(self.logit):+.6f})")
        return "\n".join(lines)


@torch.no_grad()
def decompose(cache: ActivationCache, position: int, token: int, batch: int = 0) -> Decomposition:
    """The logit of ``token`` at ``position`` as the sum of its direct parts (embeddings, positions, each head
    of each layer, each MLP, the biases), the final norm's scale frozen from the cached pass.

    Args:
        cache: from ``run_with_cache`` (holding :func:`decompose_names`).
        position: a position of the sequence (negative counts from the end); token: a vocabulary id;
        batch: the batch row.

    Raises:
        ValueError: a position outside the sequence, a token outside the vocabulary, a batch row out of
            range (each naming the valid range).
        KeyError: an activation the cache did not keep.
    """
    model = cache.model
    b, t = cache.token_ids.shape
    pos = _positions(cache, position)[0]
    v = model.config.num_tokens
    if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= int(token) < v:
        raise ValueError(f"token {token!r} is outside the vocabulary; valid ids are 0 .. {v - 1} (num_tokens={v})")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or not 0 <= int(batch) < b:
        raise ValueError(f"batch row {batch!r} is out of range; valid rows are 0 .. {b - 1}")
    token, batch = int(token), int(batch)
    labels, stack = residual_parts(cache)
    values = logit_attrs(cache, stack, token)[:, batch, pos]
    extra, norm, head = [], model.norm_f, model.fc_layer
    if isinstance(norm, nn.LayerNorm) and norm.bias is not None:
        extra.append(("final norm bias", norm.bias.to(values.dtype) @ head.weight[token].to(values.dtype)))
    if head.bias is not None:
        extra.append(("unembed bias", head.bias[token].to(values.dtype)))
    values = torch.cat([values, torch.stack([x for _, x in extra])]) if extra else values
    return Decomposition(labels=labels + [name for name, _ in extra], values=values,
                         logit=cache.logits[batch, pos, token], position=pos, token=token, batch=batch)
