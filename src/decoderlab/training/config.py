"""Hyper-parameters of a language-model run, the optimizer and its learning-rate schedule, and evaluation.

Plain torch (no Lightning): ``TrainConfig``, ``lr_at`` (warm-up then cosine, or warm-up/stable/decay),
``parameter_groups`` (every parameter in exactly one group: decay for matrices, none for the rest),
``group_names`` (those groups, named once on the unwrapped model before any strategy wraps or shards it),
``configure_optimizers`` (AdamW, or Muon + AdamW from :mod:`.optim`, + ``LambdaLR``), ``evaluate_lm`` (mean
cross-entropy over non-overlapping windows).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..checkpoint import unwrap_model
from ..data import SequentialWindows
from ..config.names import PRECISION_ALIASES, PRECISIONS
from ..config.train import MAX_TRAIN_SEED, TrainConfig, check_train_seed
from ..positions import LearnedPositionEncoding
from .optim import MuonAdamW, muon_parameter_groups, schedule_factor
from .precision import autocast_dtype, detect_machine, resolve_precision
from .sums import host_column_sums

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up ``lr * (step + 1) / warmup`` for
    ``step < warmup``, then cosine decay from ``lr`` to ``min_lr``, reaching ``min_lr`` at ``step = max_steps``
    (and staying there). ``schedule="wsd"``: see :func:`decoderlab.training.optim.schedule_factor`."""
    if cfg.schedule != "cosine":
        return cfg.lr * schedule_factor(step, warmup=cfg.warmup, max_steps=cfg.max_steps, lr=cfg.lr,
                                        min_lr=cfg.min_lr, schedule=cfg.schedule, cooldown=cfg.cooldown)
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.max_steps - cfg.warmup)
    ratio = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def parameter_groups(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters that get weight decay and of those that do not.

    Decayed: weight matrices of linear layers (attention projections, MLP). Not decayed: biases, norm
    weights, token and learned position embeddings (and ``fc_layer.weight`` when it is tied to the token
    embedding: each shared tensor is listed once, under its first name).
    """
    model = unwrap_model(model)
    embedding_ids = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, LearnedPositionEncoding)):
            embedding_ids.add(id(module.weight))
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():  # named_parameters lists a shared tensor once
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(name)
    return decay, no_decay


def _fused_adamw_available() -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):  # pragma: no cover - older builds
        return False


def use_fused_adamw(cfg: TrainConfig, precision: str | None = None) -> bool:
    """Whether :func:`configure_optimizers` builds the fused AdamW: ``cfg.fused``, or when None, whether this
    PyTorch build has it -- but not under a mixed precision (``precision``: the one the run trains at,
    Lightning's name or decoderlab's; default ``cfg.precision``) with gradient clipping (Lightning refuses to
    clip a fused optimizer's gradients under mixed precision)."""
    if cfg.fused is not None:
        return bool(cfg.fused)
    if str(precision or cfg.precision).endswith("-mixed") and cfg.grad_clip > 0:
        return False
    return _fused_adamw_available()


def apply_train_config(optimizer: torch.optim.Optimizer, scheduler, cfg: TrainConfig, step: int) -> None:
    """Make an optimizer and schedule restored from a checkpoint follow ``cfg`` from optimizer step ``step``
    (0-based, the next step to run) on.

    Restoring a checkpoint brings back the saved learning rate, betas, eps and weight decay of each group
    and the schedule's base rate; after this, the groups made by :func:`configure_optimizers` (decayed
    first) hold ``cfg``'s values, the next step runs at ``lr_at(step, cfg)`` and every later one follows
    ``lr_at`` of ``cfg`` (warm-up and cosine recomputed for its ``max_steps``). A no-op for an unchanged
    config. A :class:`~decoderlab.training.optim.MuonAdamW`'s Muon groups take ``muon_lr`` (scaled by the same
    schedule), ``muon_momentum`` and ``muon_weight_decay``; its AdamW groups as above.
    """
    factor = lr_at(step, cfg) / cfg.lr
    muon = optimizer.muon if isinstance(optimizer, MuonAdamW) else None
    adamw = optimizer.adamw if isinstance(optimizer, MuonAdamW) else optimizer
    muon_ids = {id(g) for g in muon.param_groups} if muon is not None else set()
    fused = adamw.defaults.get("fused") if adamw is not None else None
    base_lrs = []
    k = 0  # index among the AdamW groups: the first is the decayed one (unless tagged)
    for group in optimizer.param_groups:
        if id(group) in muon_ids:
            group.update(initial_lr=cfg.muon_lr, lr=cfg.muon_lr * factor, momentum=cfg.muon_momentum,
                         weight_decay=cfg.muon_weight_decay)
            base_lrs.append(cfg.muon_lr)
            continue
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["betas"] = tuple(cfg.betas)
        group["eps"] = cfg.eps
        if group.get("decay", k == 0):
            group["weight_decay"] = cfg.weight_decay
        if fused is not None:
            group["fused"] = fused
        base_lrs.append(cfg.lr)
        k += 1
    if scheduler is not None:
        scheduler.base_lrs = base_lrs
        scheduler.last_epoch = step
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def group_names(model: torch.nn.Module, optimizer: str = "adamw") -> dict[str, list[str]]:
    """The parameter groups of ``optimizer`` ("adamw" or "muon") by name, decided on the plain model:
    ``{"decay", "no_decay"}`` (:func:`parameter_groups`), plus ``"muon"`` for Muon
    (:func:`~decoderlab.training.optim.muon_parameter_groups`). Call it before a strategy wraps or shards the
    model (FSDP's flat 1-D shards would put every parameter in no-decay); parameters keep these names under
    DDP and FSDP2."""
    if optimizer == "muon":
        muon, decay, no_decay = muon_parameter_groups(model)
        return {"muon": muon, "decay": decay, "no_decay": no_decay}
    decay, no_decay = parameter_groups(model)
    return {"decay": decay, "no_decay": no_decay}


def _named(model: torch.nn.Module, names: dict[str, list[str]]) -> dict[str, list]:
    """``names``' groups as the parameters of ``model`` now (wrapped or sharded, under the same names).

    Raises:
        ValueError: a named parameter the model no longer has, or a trainable one in no group (a wrapper
            that renames parameters): naming it."""
    params = dict(unwrap_model(model).named_parameters())
    grouped = {n for group in names.values() for n in group}
    missing = sorted(grouped - set(params))
    stray = sorted(n for n, p in params.items() if p.requires_grad and n not in grouped)
    if missing or stray:
        raise ValueError(f"the model's parameters changed names after the optimizer groups were chosen "
                         f"(missing {missing[:3]}, ungrouped {stray[:3]}): a strategy that renames parameters "
                         f"cannot train this model; use --strategy ddp or fsdp")
    return {k: [params[n] for n in group] for k, group in names.items()}


def configure_optimizers(model: torch.nn.Module, cfg: TrainConfig, names: dict[str, list[str]] | None = None,
                         precision: str | None = None) -> dict:
    """AdamW with weight decay on matrices only (see :func:`parameter_groups`), fused when available, and a
    ``LambdaLR`` following :func:`lr_at`, stepped after every optimizer step. With ``optimizer="muon"``: a
    :class:`~decoderlab.training.optim.MuonAdamW` (Muon for the blocks' 2-D matrices, AdamW for the rest; see
    :func:`~decoderlab.training.optim.muon_parameter_groups`), the same schedule scaling both. ``names``: the
    groups by name (:func:`group_names`, chosen before wrapping; default: chosen now from ``model``);
    ``precision``: the precision the run trains at (for :func:`use_fused_adamw`). Returns Lightning's
    ``{"optimizer": ..., "lr_scheduler": {...}}`` dict."""
    groups = _named(model, names if names is not None else group_names(model, cfg.optimizer))
    fused = use_fused_adamw(cfg, precision)
    adamw = [{"params": groups["decay"], "weight_decay": cfg.weight_decay},
             {"params": groups["no_decay"], "weight_decay": 0.0}]
    if cfg.optimizer == "muon":
        adamw[0]["decay"], adamw[1]["decay"] = True, False
        opt = MuonAdamW(groups["muon"], adamw, muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum,
                        muon_weight_decay=cfg.muon_weight_decay, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                        fused=fused)
    else:
        opt = torch.optim.AdamW(adamw, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def _check_ids(tokens, num_tokens: int) -> None:
    """The range check of the ids, once on the host for all windows (the forward passes then skip theirs)."""
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= num_tokens:
        raise ValueError(f"token id {lo if lo < 0 else hi} is out of range; allowed ids are 0 .. {num_tokens - 1} "
                         f"(num_tokens={num_tokens})")


@torch.no_grad()
def evaluation_sums(model, tokens, max_len: int | None = None, batch_size: int = 64,
                    max_batches: int | None = None, precision: str = "32", byte_lengths=None) -> dict[str, float]:
    """Sums over the validation windows of ``tokens``: ``{"nats": cross-entropy summed over every target,
    "targets": their number, "bytes": their UTF-8 bytes}`` (``bytes`` from ``byte_lengths``, an array
    (vocab_size,) of bytes per token id as :func:`decoderlab.data.token_byte_lengths` gives; 0 without it).

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows, run on the model's device at
    ``precision`` (decoderlab's or Lightning's name; "auto" resolved for that device). The per-batch sums
    stay on the device and are added in float64 on the host at the end
    (:func:`~decoderlab.training.sums.host_column_sums`).

    Raises:
        ValueError: a token id outside the model's vocabulary (checked once, on the host).
    """
    model = unwrap_model(model)
    max_len = max_len or model.config.max_len
    ds = SequentialWindows(tokens, max_len, batch_size, max_batches)
    _check_ids(np.asarray(tokens), model.config.num_tokens)
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64)
    device = next(model.parameters()).device
    if precision == "auto":
        precision = resolve_precision("auto", detect_machine(device.type))[0]
    dtype = autocast_dtype(precision)
    was_training = model.training
    model.eval()
    losses, count, nbytes = [], 0, 0
    try:
        for j in range(len(ds)):
            x, y = ds[j]
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = model(x.to(device), check_ids=False)
            losses.append(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                            y.to(device).reshape(-1), reduction="sum"))
            count += y.numel()
            if lengths is not None:
                nbytes += int(lengths[y.reshape(-1)].sum())
    finally:
        model.train(was_training)
    nats = host_column_sums([[loss] for loss in losses])
    return {"nats": nats[0] if nats else 0.0, "targets": count, "bytes": float(nbytes)}


def evaluate_lm(model, tokens, max_len: int | None = None, batch_size: int = 64,
                max_batches: int | None = None, precision: str = "32") -> float:
    """Mean cross-entropy (nats per token) over the non-overlapping windows of ``tokens``.

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows (see :func:`evaluation_sums`).
    """
    sums = evaluation_sums(model, tokens, max_len, batch_size, max_batches, precision)
    return sums["nats"] / sums["targets"]
