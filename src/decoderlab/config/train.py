"""``TrainConfig``: the hyper-parameters of a language-model run (no torch). Its defaults, and those that
fine-tuning and the lesson's pair training start from, are plain data in :mod:`.defaults` (re-exported here).

The optimizer, schedule and evaluation that read these fields live in ``decoderlab.training``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .defaults import FINETUNE_TRAIN, PAIR_TRAIN, TRAIN_DEFAULTS
from .names import OPTIMIZERS, PRECISION_ALIASES, PRECISIONS, SCHEDULES
from .settings import Settings

__all__ = ["FINETUNE_TRAIN", "MAX_TRAIN_SEED", "PAIR_TRAIN", "TrainConfig", "check_train_seed"]

_D = TRAIN_DEFAULTS


@dataclass
class TrainConfig(Settings):
    """Hyper-parameters of a language-model run (the defaults, ``config.defaults.TRAIN_DEFAULTS``, are nanoGPT's
    CPU "baby" recipe; ``decoderlab train``'s default is the recipe ``RECIPES["baby-shakespeare-speedrun"]``).

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
        precision: "auto" (the machine's: bf16-mixed on a CUDA GPU with bfloat16, 16-mixed with a gradient
            scaler on older GPUs, 32 on the CPU and Apple MPS; see ``decoderlab.training.precision``), "32",
            "bf16-mixed" (bfloat16 autocast; weights and optimizer state stay float32) or "16-mixed"
            (float16 autocast with a gradient scaler; CUDA GPUs).
        compile: ``torch.compile`` the model: False, True (inductor) or a backend name (e.g. "eager").
        seed: seeds the initial weights and, with the batch number, every training window.
        eval_every: optimizer steps between validations (and checkpoints).
        val_batches: validate on at most this many batches of ``val_batch_size`` windows (None: all windows).
        val_batch_size: windows per validation batch.
        val_fraction: the last fraction of the corpus (by position) used for validation.
        log_every: optimizer steps between logged training metrics.
        num_workers: DataLoader worker processes (0: batches are cut in the training process).
        fused: fused AdamW kernel (None: use it when this PyTorch build has it, except with a mixed precision
            and gradient clipping, which Lightning cannot combine with a fused optimizer).
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
        group_by_length: fine-tuning only: batch rows of nearly one length (Hugging Face's name; see
            :class:`decoderlab.training.rows.StepBatches`), so little of a step is padding.
    """

    max_steps: int = _D["max_steps"]
    batch_size: int = _D["batch_size"]
    lr: float = _D["lr"]
    min_lr: float = _D["min_lr"]
    warmup: int = _D["warmup"]
    weight_decay: float = _D["weight_decay"]
    betas: tuple[float, float] = _D["betas"]
    eps: float = _D["eps"]
    grad_clip: float = _D["grad_clip"]
    accumulate: int = _D["accumulate"]
    precision: str = _D["precision"]
    compile: bool | str = _D["compile"]
    seed: int = _D["seed"]
    eval_every: int = _D["eval_every"]
    val_batches: int | None = _D["val_batches"]
    val_batch_size: int = _D["val_batch_size"]
    val_fraction: float = _D["val_fraction"]
    log_every: int = _D["log_every"]
    num_workers: int = _D["num_workers"]
    fused: bool | None = _D["fused"]
    optimizer: str = _D["optimizer"]
    muon_lr: float = _D["muon_lr"]
    muon_momentum: float = _D["muon_momentum"]
    muon_weight_decay: float = _D["muon_weight_decay"]
    schedule: str = _D["schedule"]
    cooldown: float = _D["cooldown"]
    full_val_at_end: bool = _D["full_val_at_end"]
    full_val_below: float | None = _D["full_val_below"]
    group_by_length: bool = _D["group_by_length"]

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> "TrainConfig":
        """Raise ``ValueError`` naming the offending field, its value and what is allowed."""
        for name in ("max_steps", "batch_size", "accumulate", "eval_every", "log_every", "val_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        check_steps(self)
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
        if self.fused and self.precision.endswith("-mixed") and self.grad_clip > 0:
            raise ValueError(f"fused=True cannot be combined with precision={self.precision!r} and "
                             f"grad_clip={self.grad_clip}: Lightning does not clip the gradients of a fused optimizer "
                             f"under mixed precision; use fused=None or False, grad_clip=0, or precision='32'")
        if not (isinstance(self.compile, bool) or (isinstance(self.compile, str) and self.compile)):
            raise ValueError(f"compile must be True, False or a torch.compile backend name (e.g. 'eager'), "
                             f"got {self.compile!r}")
        _validate_speedrun_fields(self)
        return self



#: the largest training seed: Lightning's ``seed_everything`` seeds NumPy too, which takes 0 .. 2**32-1
MAX_TRAIN_SEED = 2**32 - 1
#: the most steps (or epochs, or steps between evaluations...) a run may ask for: a billion, years of training
#: at any speed; beyond it a typo (20 digits) would print an ETA of millions of millennia and a schedule that
#: never decays
MAX_STEPS = 10**9
#: the step-like settings :data:`MAX_STEPS` bounds
STEP_FIELDS = ("max_steps", "accumulate", "eval_every", "log_every", "warmup", "val_batches")


def check_steps(cfg) -> None:
    """Each of :data:`STEP_FIELDS` at most :data:`MAX_STEPS`; a ``ValueError`` naming the field and the bound."""
    for name in STEP_FIELDS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_STEPS:
            raise ValueError(f"{name} must be <= {MAX_STEPS:,} (MAX_STEPS, the most a run may ask for), got {v:,}")


def check_train_seed(seed) -> int:
    """Raise ``ValueError`` unless ``seed`` is an integer in 0 .. 2**32-1 (what ``L.seed_everything`` takes);
    return it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_TRAIN_SEED:
        raise ValueError(f"seed must be an integer in 0 .. 2**32-1, got {seed!r}")
    return seed


def _validate_speedrun_fields(cfg: TrainConfig) -> None:
    """The optimizer, schedule and evaluation fields (see :class:`TrainConfig`)."""
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
    for name in ("full_val_at_end", "group_by_length"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    if cfg.full_val_below is not None and (isinstance(cfg.full_val_below, bool)
                                           or not isinstance(cfg.full_val_below, (int, float))
                                           or not math.isfinite(cfg.full_val_below)):
        raise ValueError(f"full_val_below must be None or a loss in nats per token, got {cfg.full_val_below!r}")
