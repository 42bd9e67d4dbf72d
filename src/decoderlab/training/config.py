"""Hyper-parameters of a language-model run, the optimizer and its learning-rate schedule, and evaluation.

Plain torch (no Lightning): ``TrainConfig``, ``lr_at`` (warm-up then cosine, or warm-up/stable/decay),
``parameter_groups`` (every parameter in exactly one group: decay for matrices, none for the rest),
``configure_optimizers`` (AdamW, or Muon + AdamW from :mod:`.optim`, + ``LambdaLR``), ``evaluate_lm`` (mean
cross-entropy over non-overlapping windows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..checkpoint import unwrap_model
from ..data import SequentialWindows
from ..positions import LearnedPositionEncoding
from .optim import OPTIMIZERS, SCHEDULES, MuonAdamW, muon_parameter_groups, schedule_factor

PRECISIONS = ("32", "bf16-mixed")
#: the names Lightning's ``Trainer(precision=...)`` uses for ours
PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed"}


@dataclass
class TrainConfig:
    """Hyper-parameters of a language-model run (the defaults are nanoGPT's CPU "baby" recipe; ``decoderlab
    train``'s default is the recipe ``decoderlab.training.recipes.RECIPES["baby-shakespeare-speedrun"]``).

    Attributes:
        max_steps: optimizer steps (each of ``accumulate`` batches).
        batch_size: sequences (windows of max_len + 1 tokens) per batch on each process.
        lr: peak learning rate, reached after ``warmup`` steps.
        min_lr: learning rate at the end of the cosine decay (at ``max_steps``).
        warmup: steps of linear warm-up.
        weight_decay: AdamW decoupled weight decay, applied to weight matrices only.
        betas, eps: AdamW's.
        grad_clip: clip the global gradient norm to this value (0 = no clipping).
        accumulate: batches per optimizer step (gradient accumulation).
        precision: "32" or "bf16-mixed" (bfloat16 autocast; weights and optimizer state stay float32).
        compile: ``torch.compile`` the model: False, True (inductor) or a backend name (e.g. "eager").
        seed: seeds the initial weights and, with the batch number, every training window.
        eval_every: optimizer steps between validations (and checkpoints).
        val_batches: validate on at most this many batches of ``val_batch_size`` windows (None: all windows).
        val_batch_size: windows per validation batch.
        val_fraction: the last fraction of the corpus (by position) used for validation.
        log_every: optimizer steps between logged training metrics.
        num_workers: DataLoader worker processes (0: batches are cut in the training process).
        fused: fused AdamW kernel (None: use it when this PyTorch build has it, except with precision
            "bf16-mixed" and gradient clipping, which Lightning cannot combine with a fused optimizer).
        optimizer: "adamw" (every parameter) | "muon" (``torch.optim.Muon`` for the blocks' 2-D weight
            matrices, AdamW with ``lr`` for embeddings, output layer, gains and biases; see
            :mod:`decoderlab.training.optim`).
        muon_lr, muon_momentum, muon_weight_decay: Muon's peak learning rate, momentum and weight decay
            (the schedule scales ``muon_lr`` and ``lr`` alike).
        schedule: "cosine" | "wsd" (warm-up, flat, then linear decay to ``min_lr`` over the last ``cooldown``
            fraction of ``max_steps``); see :func:`decoderlab.training.optim.schedule_factor`.
        cooldown: the decay fraction of "wsd", in [0, 1].
        full_val_at_end: with ``val_batches`` set (a fixed subset of the first windows while training),
            also evaluate all validation windows once at the end; that is the reported ``val_loss``.
        full_val_below: with ``val_batches`` set, evaluate all windows whenever the subset's loss (nats per
            token) is at or below this value (None: never during training).
    """

    max_steps: int = 2000
    batch_size: int = 12
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    grad_clip: float = 1.0
    accumulate: int = 1
    precision: str = "32"
    compile: bool | str = False
    seed: int = 42
    eval_every: int = 250
    val_batches: int | None = None
    val_batch_size: int = 64
    val_fraction: float = 0.1
    log_every: int = 50
    num_workers: int = 0
    fused: bool | None = None
    optimizer: str = "adamw"
    muon_lr: float = 0.05
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    schedule: str = "cosine"
    cooldown: float = 0.4
    full_val_at_end: bool = False
    full_val_below: float | None = None

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> "TrainConfig":
        """Raise ``ValueError`` naming the offending field, its value and what is allowed."""
        for name in ("max_steps", "batch_size", "accumulate", "eval_every", "log_every", "val_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        check_train_seed(self.seed)
        for name in ("warmup", "num_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.val_batches is not None and (not isinstance(self.val_batches, int) or self.val_batches < 1):
            raise ValueError(f"val_batches must be None (all) or an integer >= 1, got {self.val_batches!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr (learning rate) must be a finite number > 0, got {self.lr!r}")
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr must be between 0 and lr={self.lr}, got {self.min_lr!r}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.precision not in PRECISION_ALIASES:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction!r}")
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ValueError(f"fused must be None (automatic), True or False, got {self.fused!r}")
        if self.fused and self.precision == "bf16-mixed" and self.grad_clip > 0:
            raise ValueError(f"fused=True cannot be combined with precision='bf16-mixed' and grad_clip={self.grad_clip}: "
                             f"Lightning does not clip the gradients of a fused optimizer under mixed precision; "
                             f"use fused=None or False, grad_clip=0, or precision='32'")
        if not (isinstance(self.compile, bool) or (isinstance(self.compile, str) and self.compile)):
            raise ValueError(f"compile must be True, False or a torch.compile backend name (e.g. 'eager'), "
                             f"got {self.compile!r}")
        _validate_speedrun_fields(self)
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


#: the largest training seed: Lightning's ``seed_everything`` seeds NumPy too, which takes 0 .. 2**32-1
MAX_TRAIN_SEED = 2**32 - 1


def check_train_seed(seed) -> int:
    """Raise ``ValueError`` unless ``seed`` is an integer in 0 .. 2**32-1 (what ``L.seed_everything`` takes);
    return it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_TRAIN_SEED:
        raise ValueError(f"seed must be an integer in 0 .. 2**32-1, got {seed!r}")
    return seed


def _validate_speedrun_fields(cfg: TrainConfig) -> None:
    """The optimizer, schedule and evaluation fields of issue 12 (see :class:`TrainConfig`)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; allowed: {', '.join(SCHEDULES)}")
    for name in ("muon_lr", "muon_momentum", "muon_weight_decay", "cooldown"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if not cfg.muon_lr > 0:
        raise ValueError(f"muon_lr must be > 0, got {cfg.muon_lr!r}")
    if not cfg.muon_momentum < 1:
        raise ValueError(f"muon_momentum must be in [0, 1), got {cfg.muon_momentum!r}")
    if not cfg.cooldown <= 1:
        raise ValueError(f"cooldown must be a fraction of max_steps in [0, 1], got {cfg.cooldown!r}")
    if not isinstance(cfg.full_val_at_end, bool):
        raise ValueError(f"full_val_at_end must be True or False, got {cfg.full_val_at_end!r}")
    if cfg.full_val_below is not None and (isinstance(cfg.full_val_below, bool)
                                           or not isinstance(cfg.full_val_below, (int, float))
                                           or not math.isfinite(cfg.full_val_below)):
        raise ValueError(f"full_val_below must be None or a loss in nats per token, got {cfg.full_val_below!r}")


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


def use_fused_adamw(cfg: TrainConfig) -> bool:
    """Whether :func:`configure_optimizers` builds the fused AdamW: ``cfg.fused``, or when None, whether this
    PyTorch build has it -- but not under ``bf16-mixed`` with gradient clipping (Lightning refuses to clip
    a fused optimizer's gradients under mixed precision)."""
    if cfg.fused is not None:
        return bool(cfg.fused)
    if cfg.precision == "bf16-mixed" and cfg.grad_clip > 0:
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


def configure_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> dict:
    """AdamW with weight decay on matrices only (see :func:`parameter_groups`), fused when available, and a
    ``LambdaLR`` following :func:`lr_at`, stepped after every optimizer step. With ``optimizer="muon"``: a
    :class:`~decoderlab.training.optim.MuonAdamW` (Muon for the blocks' 2-D matrices, AdamW for the rest; see
    :func:`~decoderlab.training.optim.muon_parameter_groups`), the same schedule scaling both. Returns
    Lightning's ``{"optimizer": ..., "lr_scheduler": {...}}`` dict."""
    if cfg.optimizer == "muon":
        muon, decay, no_decay = muon_parameter_groups(model)
        params = dict(unwrap_model(model).named_parameters())
        opt = MuonAdamW([params[n] for n in muon],
                        [{"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay, "decay": True},
                         {"params": [params[n] for n in no_decay], "weight_decay": 0.0, "decay": False}],
                        muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum,
                        muon_weight_decay=cfg.muon_weight_decay, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                        fused=use_fused_adamw(cfg))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
    decay, no_decay = parameter_groups(model)
    params = dict(unwrap_model(model).named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    fused = use_fused_adamw(cfg)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


@torch.no_grad()
def evaluation_sums(model, tokens, max_len: int | None = None, batch_size: int = 64,
                    max_batches: int | None = None, precision: str = "32", byte_lengths=None) -> dict[str, float]:
    """Sums over the validation windows of ``tokens``: ``{"nats": cross-entropy summed over every target,
    "targets": their number, "bytes": their UTF-8 bytes}`` (``bytes`` from ``byte_lengths``, an array
    (vocab_size,) of bytes per token id as :func:`decoderlab.data.token_byte_lengths` gives; 0 without it).

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows.
    """
    model = unwrap_model(model)
    max_len = max_len or model.config.max_len
    ds = SequentialWindows(tokens, max_len, batch_size, max_batches)
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.float64)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats, count, nbytes = 0.0, 0, 0.0
    try:
        for j in range(len(ds)):
            x, y = ds[j]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                logits = model(x.to(device))
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                     y.to(device).reshape(-1), reduction="sum")
            nats += float(loss)
            count += y.numel()
            if lengths is not None:
                nbytes += float(lengths[y.reshape(-1)].sum())
    finally:
        model.train(was_training)
    return {"nats": nats, "targets": count, "bytes": nbytes}


def evaluate_lm(model, tokens, max_len: int | None = None, batch_size: int = 64,
                max_batches: int | None = None, precision: str = "32") -> float:
    """Mean cross-entropy (nats per token) over the non-overlapping windows of ``tokens``.

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows (see :func:`evaluation_sums`).
    """
    sums = evaluation_sums(model, tokens, max_len, batch_size, max_batches, precision)
    return sums["nats"] / sums["targets"]
