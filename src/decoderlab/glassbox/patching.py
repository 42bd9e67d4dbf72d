"""Interventions: ready-made hooks (ablations, steering) and activation patching over layers, positions and
heads -- what breaks, and what is restored, when one activation is changed.

Each ready-made hook is a pair ``(name, fn)`` for ``run_with_hooks``, ``use_hooks`` or
``generate(..., hooks=...)``; the model is passed to check the name and the head at once.

Sources: TransformerLens ``patching.py`` (``get_act_patch_resid_pre``, ``get_act_patch_attn_head_out_all_pos``,
``get_act_patch_attn_head_out_by_pos``, ``get_act_patch_mlp_out``: the corrupted run with one clean
activation patched in); Meng et al. 2022 (causal tracing); Chan et al. 2022 (resampling ablation);
Turner et al. 2023 (activation addition, a steering vector added to the residual stream).
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from ..hooks import HEAD_AXIS, hook_model, resolve_names, shape_of, split_name
from .cache import ActivationCache, as_ids, check_head, check_layer, forward_with_hooks, record

#: what ``activation_patching`` can patch (``over``) -> the hook point in each block, and the tables (``by``)
PATCH_OVER = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
              "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "attn_head": "attn.hook_z"}
PATCH_BY = {"attn_head": ("layer,head", "layer,pos,head")}
_PATCH_BY_DEFAULT = ("layer", "layer,pos")


def _point(model, name: str, head) -> tuple[str, int | None, int | None]:
    """Check ``name`` (and ``head`` for a per-head point): (name, head axis or None, head or None)."""
    name = resolve_names(model, name)[0] if isinstance(name, str) else name
    if not isinstance(name, str):
        raise TypeError(f"name must be a hook name, got {type(name).__name__}")
    axis = HEAD_AXIS.get(split_name(name)[1].rpartition(".")[2])
    if head is None:
        return name, axis, None
    if axis is None:
        raise ValueError(f"head={head!r} needs a per-head hook point (attn.hook_q/k/v/z/pattern/attn_scores ...); "
                         f"{name} is {shape_of(name)}")
    return name, axis, check_head(model, head, split_name(name)[1])


def _replacer(value: torch.Tensor, axis: int | None, head: int | None, what: str):
    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        v = value.to(dtype=x.dtype, device=x.device)
        try:
            if head is None:
                full = v.expand_as(x)
            else:  # one head's slice (a 0-d value, zero, fills it)
                full = (v if v.dim() == 0 else v.select(axis, head)).expand_as(x.select(axis, head))
        except RuntimeError:
            raise ValueError(f"{what} for {name} has shape {tuple(value.shape)}, which does not fit the run's "
                             f"{tuple(x.shape)} {shape_of(name)}") from None
        if head is None:
            return full.clone()
        out = x.clone()
        out.select(axis, head).copy_(full)
        return out
    return fn


def zero_ablation(model, name: str, head: int | None = None):
    """``(name, fn)`` setting the activation at ``name`` -- or one head's slice of a per-head point -- to zero.

    Raises ``ValueError`` for an unknown name, a head out of range, or a head on a point without heads."""
    name, axis, head = _point(hook_model(model), name, head)
    return name, _replacer(torch.zeros(()), axis, head, "zero")


def _from(source, name: str, what: str) -> torch.Tensor:
    if isinstance(source, ActivationCache):
        return source[name]
    if isinstance(source, torch.Tensor):
        return source
    raise TypeError(f"the {what} must be an ActivationCache holding {name} or a tensor, got {type(source).__name__}")


def mean_ablation(model, name: str, reference, head: int | None = None):
    """``(name, fn)`` replacing the activation by its mean over the batch of ``reference`` (an
    ``ActivationCache`` of a reference batch holding ``name``, or that activation itself), position by
    position; or only one head's slice.

    Raises as :func:`zero_ablation`; while running, ``ValueError`` when the reference's positions do not
    match the run's (naming both shapes)."""
    name, axis, head = _point(hook_model(model), name, head)
    mean = _from(reference, name, "reference").mean(0, keepdim=True)
    return name, _replacer(mean, axis, head, "the reference batch's mean")


def resample_ablation(model, name: str, source, head: int | None = None):
    """``(name, fn)`` replacing the activation by the one another input gave (``source``: its
    ``ActivationCache`` or the activation; batch 1 is used for every row); or only one head's slice.

    Raises as :func:`mean_ablation`."""
    name, axis, head = _point(hook_model(model), name, head)
    return name, _replacer(_from(source, name, "source"), axis, head, "the resampled activation")


def steering(model, layer: int, vector: torch.Tensor, *, scale: float = 1.0, point: str = "hook_resid_pre"):
    """``(name, fn)`` adding ``scale * vector`` (d_model,) to the residual stream at ``blocks.{layer}.{point}``
    at every position -- in a forward pass or at every step of ``generate(..., hooks=[...])``.

    Raises ``ValueError`` for a layer out of range, a vector that is not (d_model,), or a point that is not
    a residual point of the block (hook_resid_pre, hook_resid_mid, hook_resid_post)."""
    model = hook_model(model)
    layer = check_layer(model, layer)
    if point not in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post"):
        raise ValueError(f"steering point {point!r} is not a residual point; allowed: hook_resid_pre, "
                         "hook_resid_mid, hook_resid_post")
    name = resolve_names(model, f"blocks.{layer}.{point}")[0]
    d = model.config.d_model
    if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (d,):
        got = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise ValueError(f"the steering vector must be a tensor of shape (d_model,) = ({d},), got {got}")
    added = (float(scale) * vector.detach()).clone()

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        return x + added.to(dtype=x.dtype, device=x.device)
    return name, fn


def _row_tokens(token, what: str) -> int | torch.Tensor:
    if isinstance(token, numbers.Integral) and not isinstance(token, bool):
        return int(token)
    ids = torch.as_tensor(token, dtype=torch.long)
    if ids.dim() == 0:  # a 0-d tensor: one id
        return int(ids)
    if ids.dim() != 1:
        raise ValueError(f"{what} must be one id or one id per batch row (B,), got shape {tuple(ids.shape)}")
    return ids


def _pick(logits: torch.Tensor, position: int, token) -> torch.Tensor:
    """(B,) ``logits[b, position, token[b]]`` (or ``token`` for every row)."""
    at = logits[:, position]
    if isinstance(token, int):
        return at[:, token]
    if token.numel() != at.size(0):
        raise ValueError(f"one token per batch row: got {token.numel()} tokens for {at.size(0)} rows")
    return at.gather(-1, token.to(at.device).view(-1, 1)).squeeze(-1)


def logit_difference(token, other=None, position: int = -1) -> Callable[[torch.Tensor], torch.Tensor]:
    """A patching metric: the mean over the batch of ``logits[:, position, token]`` (minus the same for
    ``other``).

    ``token`` and ``other``: one id for every row, or one per batch row (a (B,) tensor or list) -- e.g. each
    question's own correct answer against its corrupted one. Raises ``ValueError`` for a 2-d ``token``, and
    when the metric runs, for a number of tokens that is not the batch size."""
    token = _row_tokens(token, "token")
    other = None if other is None else _row_tokens(other, "other")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        got = _pick(logits, position, token)
        return (got if other is None else got - _pick(logits, position, other)).mean()
    return metric


def _metric_value(metric, logits: torch.Tensor) -> float:
    out = metric(logits)
    if isinstance(out, torch.Tensor):
        if out.numel() != 1:
            raise ValueError(f"the metric must return one number (a float or a 0-d tensor), got shape "
                             f"{tuple(out.shape)}")
        return float(out)
    if isinstance(out, numbers.Real):
        return float(out)
    raise TypeError(f"the metric must return one number, got {type(out).__name__}")


def _cells(by: str, t: int, h: int) -> list[tuple]:
    """The (pos, head) cells of one layer's row, None meaning every position / head."""
    if by == "layer":
        return [(None, None)]
    if by == "layer,pos":
        return [(p, None) for p in range(t)]
    if by == "layer,head":
        return [(None, k) for k in range(h)]
    return [(p, k) for p in range(t) for k in range(h)]


def _patch(src: torch.Tensor, pos, head):
    def fn(x: torch.Tensor, name: str) -> torch.Tensor | None:
        if pos is None and head is None:
            return src
        index = (slice(None), slice(None) if pos is None else pos) + (() if head is None else (head,))
        x[index] = src[index]  # the corrupt run's own tensor, changed in place: nothing else moves
        return None
    return fn


def activation_patching(model, clean, corrupt, metric, over: str = "resid_pre", by: str = "layer,pos", *,
                        tokenizer=None, normalize: bool = False) -> torch.Tensor:
    """Run ``corrupt`` again and again, each time with one activation of the ``clean`` run patched in, and
    return ``metric(patched logits)`` for every patch: TransformerLens's patching tables.

    Args:
        model: a ``DecoderOnlyTransformer``.
        clean, corrupt: ids of the same shape, (T,) or (B, T) (or texts with ``tokenizer``).
        metric: ``logits (B, T, V) -> one number`` (e.g. :func:`logit_difference`).
        over: what is patched, in every layer: "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"
            (by "layer" or "layer,pos") or "attn_head" (``hook_z``; by "layer,head" or "layer,pos,head").
        by: the table's axes.
        normalize: return the fraction of the metric each patch recovers instead, (patched - corrupt) /
            (clean - corrupt) with ``metric`` of the unpatched clean and corrupt runs: 1 where the patch
            restores the clean run's metric, 0 where it changes nothing (TransformerLens's normalised patching).

    Returns a float64 tensor: (n_layer,), (n_layer, T), (n_layer, n_head) or (n_layer, T, n_head).
    Patching ``clean`` into itself gives ``metric(clean logits)`` in every cell (exactly, in float64).

    Raises:
        ValueError: clean and corrupt of different shapes; an unknown ``over`` or a ``by`` it does not
            allow (naming the allowed ones); "resid_mid"/"mlp_out" on a model without an MLP; a metric that
            does not return one number; ``normalize`` where the clean and corrupt metrics are equal (nothing
            to recover: both values named).
    Source: TransformerLens ``patching.get_act_patch_*`` (denoising: clean into corrupt).
    """
    model = hook_model(model)
    if over not in PATCH_OVER:
        raise ValueError(f"unknown over={over!r}; allowed: {', '.join(PATCH_OVER)}")
    allowed = PATCH_BY.get(over, _PATCH_BY_DEFAULT)
    if by not in allowed:
        raise ValueError(f"by={by!r} is not allowed for over={over!r}; allowed: {', '.join(allowed)}")
    clean_ids, corrupt_ids = as_ids(model, clean, tokenizer), as_ids(model, corrupt, tokenizer)
    if clean_ids.shape != corrupt_ids.shape:
        raise ValueError(f"clean and corrupt inputs must have the same shape (B, T), got {tuple(clean_ids.shape)} "
                         f"and {tuple(corrupt_ids.shape)}: each clean activation is patched in at its own position")
    cfg = model.config
    names = resolve_names(model, [f"blocks.{i}.{PATCH_OVER[over]}" for i in range(cfg.n_layer)])
    clean_cache = record(model, clean_ids, names)
    t, h = clean_ids.size(1), cfg.n_head
    cells = _cells(by, t, h)
    table = torch.empty(cfg.n_layer, len(cells), dtype=torch.float64)
    for i, name in enumerate(names):
        for j, (pos, head) in enumerate(cells):
            logits = forward_with_hooks(model, corrupt_ids, [(name, _patch(clean_cache[name], pos, head))])
            table[i, j] = _metric_value(metric, logits)
    shape = {"layer": (cfg.n_layer,), "layer,pos": (cfg.n_layer, t), "layer,head": (cfg.n_layer, h),
             "layer,pos,head": (cfg.n_layer, t, h)}[by]
    if normalize:
        table = recovered_fraction(table, _metric_value(metric, clean_cache.logits),
                                   _metric_value(metric, forward_with_hooks(model, corrupt_ids, [])))
    return table.view(shape)


def recovered_fraction(table: torch.Tensor, clean: float, corrupt: float) -> torch.Tensor:
    """``(table - corrupt) / (clean - corrupt)``: patched metrics as the fraction of the clean-corrupt gap they
    recover (1: the clean run's metric, 0: the corrupt run's). Raises ``ValueError`` when ``clean == corrupt``."""
    if clean == corrupt:
        raise ValueError(f"the clean and corrupt runs give the same metric ({clean!r} and {corrupt!r}): there is "
                         "no difference to recover; corrupt the input so that the metric changes")
    return (table - corrupt) / (clean - corrupt)


def patching_table(table: torch.Tensor, over: str, by: str) -> str:
    """The CLI's text of an :func:`activation_patching` table: one row per layer (per layer and position for
    ``layer,pos,head``), columns positions or heads."""
    if by == "layer":
        return "\n".join([f"patching {over} by layer:"] + [f"  L{i:<3}{float(v):+10.4f}" for i, v in enumerate(table)])
    grid = table if by != "layer,pos,head" else table.reshape(-1, table.size(-1))
    col = "H" if by.endswith("head") else "pos "
    rows = ([f"L{i}" for i in range(table.size(0))] if by != "layer,pos,head"
            else [f"L{i} pos {p}" for i in range(table.size(0)) for p in range(table.size(1))])
    width = max(len(r) for r in rows) + 2
    lines = [f"patching {over} by {by}:", " " * width + "".join(f"{col + str(j):>10}" for j in range(grid.size(1)))]
    lines += [f"{r:<{width}}" + "".join(f"{float(v):+10.4f}" for v in row) for r, row in zip(rows, grid)]
    return "\n".join(lines)
