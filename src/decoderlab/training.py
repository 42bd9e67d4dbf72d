"""Training with Lightning: the lesson's pair training, and (for language modelling) optimizer groups,
schedule, Trainer factory and callbacks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from .checkpoint import (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, atomic_write_text, check_output_dir, read_meta,
                         save_checkpoint, unwrap_model)
from .data import (LESSON_PAIRS, SequentialWindows, TokenDataModule, check_split_lengths, corpus_tokens,
                   pair_dataloader, read_corpus, split_tokens, tokenizer_for_pairs)
from .model import DecoderOnlyTransformer, preset
from .positions import LearnedPositionEncoding
from .tokenizers import Tokenizer, build_tokenizer


class _DropLightningTips(logging.Filter):
    """Lightning prints an advertisement ("Tip: ... litlogger") with every Trainer; keep real messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLightningTips())


def train_pairs(
    pairs: Sequence[tuple[str, str]] = LESSON_PAIRS,
    out: str | os.PathLike | None = None,
    *,
    preset_name: str = "statquest",
    max_epochs: int = 30,
    seed: int = 42,
    lr: float = 0.1,
    batch_size: int = 1,
    progress_bar: bool = False,
):
    """Train a model on prompt/response pairs exactly as the lesson does and return ``(model, tokenizer)``.

    ``L.seed_everything(seed)``, a ``WordTokenizer`` over the pairs' words (the lesson's 5 tokens for its
    pairs), ``DecoderOnlyTransformer`` of the preset with ``num_tokens`` = vocabulary size, Adam(lr), and
    ``L.Trainer(max_epochs)`` over a ``DataLoader`` of the pairs (batch size 1, no shuffling). If ``out`` is
    given, a checkpoint directory is written there (``meta.json`` records ``"task": "pairs"``).

    Raises:
        ValueError: bad pairs, max_epochs < 1, lr <= 0, batch_size < 1.
    """
    if max_epochs < 1:
        raise ValueError(f"max_epochs must be >= 1, got {max_epochs}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokenizer = tokenizer_for_pairs(pairs)
    if out is not None:
        check_output_dir(out)  # before training, so a bad --out loses no work
    L.seed_everything(seed, verbose=False)
    model = DecoderOnlyTransformer(preset(preset_name, num_tokens=tokenizer.vocab_size), lr=lr)
    longest = max(len(p.split()) + len(r.split()) + 1 for p, r in pairs)
    if longest > model.config.max_len:
        raise ValueError(f"a pair has {longest} tokens, more than the model's max_len={model.config.max_len}")
    loader = pair_dataloader(pairs, tokenizer, batch_size=batch_size)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(no `val_dataloader`|does not have many workers|LeafSpec).*")
        trainer.fit(model, train_dataloaders=loader)
    model.eval()
    if out is not None:
        save_checkpoint(out, model, tokenizer, meta={"task": "pairs"})
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------
# Language-model training: configuration, optimizer groups, schedule, Trainer factory, callbacks, train_lm
# ---------------------------------------------------------------------------------------------------------

PRECISIONS = ("32", "bf16-mixed")
_PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed"}
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
LIGHTNING_DIR = "lightning"
LAST_CKPT = "last.ckpt"


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before updating the weights with it."""


@dataclass
class TrainConfig:
    """Hyper-parameters of a language-model run (the defaults are ``decoderlab train``'s).

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
        fused: fused AdamW kernel (None: use it when this PyTorch build has it).
        optimizer: "adamw" (every parameter) | "muon" (``torch.optim.Muon`` for the blocks' 2-D weight
            matrices, AdamW with ``lr`` for embeddings, output layer, gains and biases; see
            ``decoderlab.optim``).
        muon_lr, muon_momentum, muon_weight_decay: Muon's peak learning rate, momentum and weight decay
            (the schedule scales ``muon_lr`` and ``lr`` alike).
        schedule: "cosine" | "wsd" (warm-up, flat, then linear decay to ``min_lr`` over the last ``cooldown``
            fraction of ``max_steps``); see ``decoderlab.optim.schedule_factor``.
        cooldown: the decay fraction of "wsd", in [0, 1].
        full_val_at_end: with ``val_batches`` set (a fixed subset of the first windows while training),
            also evaluate all validation windows once at the end; that is the reported ``val_loss``.
        full_val_below: with ``val_batches`` set, evaluate all windows whenever the subset's loss is at or
            below this value (None: never during training).

    The defaults are the nanoGPT CPU "baby" recipe; ``decoderlab train``'s default recipe is
    ``decoderlab.recipes.RECIPES["baby-shakespeare-speedrun"]``.
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
        for name in ("warmup", "num_workers", "seed"):
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
        if self.precision not in _PRECISION_ALIASES:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction!r}")
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


def _validate_speedrun_fields(cfg: TrainConfig) -> None:
    from .optim import OPTIMIZERS, SCHEDULES

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
                                           or not isinstance(cfg.full_val_below, (int, float))):
        raise ValueError(f"full_val_below must be None or a loss in nats, got {cfg.full_val_below!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up ``lr * (step + 1) / warmup`` for
    ``step < warmup``, then cosine decay from ``lr`` to ``min_lr``, reaching ``min_lr`` at ``step = max_steps``
    (and staying there). ``schedule="wsd"``: see ``decoderlab.optim.schedule_factor``."""
    if cfg.schedule != "cosine":
        from .optim import schedule_factor

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


def configure_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> dict:
    """AdamW with weight decay on matrices only (see :func:`parameter_groups`), fused when available, and a
    ``LambdaLR`` following :func:`lr_at`, stepped after every optimizer step. With ``optimizer="muon"``: a
    ``decoderlab.optim.MuonAdamW`` (Muon for the blocks' 2-D matrices, AdamW for the rest; see
    ``muon_parameter_groups``), the same schedule scaling both. Returns Lightning's
    ``{"optimizer": ..., "lr_scheduler": {...}}`` dict."""
    if cfg.optimizer == "muon":
        from .optim import MuonAdamW, muon_parameter_groups

        muon, decay, no_decay = muon_parameter_groups(model)
        params = dict(unwrap_model(model).named_parameters())
        opt = MuonAdamW([params[n] for n in muon],
                        [{"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
                         {"params": [params[n] for n in no_decay], "weight_decay": 0.0}],
                        muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum,
                        muon_weight_decay=cfg.muon_weight_decay, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                        fused=bool(_fused_adamw_available() if cfg.fused is None else cfg.fused))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
    decay, no_decay = parameter_groups(model)
    params = dict(unwrap_model(model).named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    fused = _fused_adamw_available() if cfg.fused is None else cfg.fused
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


@torch.no_grad()
def evaluate_lm(model, tokens, max_len: int | None = None, batch_size: int = 64,
                max_batches: int | None = None, precision: str = "32") -> float:
    """Mean cross-entropy (nats per token) over the non-overlapping windows of ``tokens``.

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows.
    """
    model = unwrap_model(model)
    max_len = max_len or model.config.max_len
    ds = SequentialWindows(tokens, max_len, batch_size, max_batches)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for j in range(len(ds)):
            x, y = ds[j]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += y.numel()
    finally:
        model.train(was_training)
    return total / count


class LossHistory(L.Callback):
    """Records the training loss of every optimizer step (mean over its accumulated batches and, under DDP,
    over all processes) and the time spent in training steps (tokens per second). Its state is saved in
    Lightning's checkpoints, so a resumed run keeps the whole history."""

    def __init__(self):
        self.losses: list[float] = []
        self.train_seconds = 0.0
        self.tokens = 0
        self._acc: list[torch.Tensor] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._acc.append(loss.detach().float() * trainer.accumulate_grad_batches)
        self.tokens += batch[1].numel() * trainer.world_size
        if len(self._acc) >= trainer.accumulate_grad_batches:
            mean = torch.stack(self._acc).mean()
            self._acc = []
            if trainer.world_size > 1:
                mean = trainer.strategy.reduce(mean, reduce_op="mean")
            self.losses.append(float(mean))
        self.train_seconds += time.perf_counter() - self._t0

    def state_dict(self):
        return {"losses": list(self.losses), "train_seconds": self.train_seconds, "tokens": self.tokens}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])
        self.train_seconds = float(state["train_seconds"])
        self.tokens = int(state["tokens"])


class LMMetrics(L.Callback):
    """After each validation: the exact mean validation loss over all windows (summed over processes), its
    perplexity ``exp(loss)`` and bits per byte ``loss / (bytes_per_token * ln 2)``, logged as ``val_ppl`` and
    ``val_bpb``; the history [(step, val_loss)] is kept (and saved in checkpoints)."""

    def __init__(self, bytes_per_token: float):
        self.bytes_per_token = float(bytes_per_token)
        self.history: list[tuple[int, float]] = []
        self._sum = self._count = None

    def on_validation_epoch_start(self, trainer, pl_module):
        self._sum = torch.zeros((), dtype=torch.float64)
        self._count = torch.zeros((), dtype=torch.float64)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        n = batch[1].numel()
        self._sum += outputs.detach().double().cpu() * n
        self._count += n

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        total = torch.stack([self._sum, self._count]).to(pl_module.device)
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(total, reduce_op="sum")
        loss = float(total[0] / total[1])
        pl_module.log("val_ppl", math.exp(min(loss, 700.0)), sync_dist=False, rank_zero_only=True)
        pl_module.log("val_bpb", loss / (self.bytes_per_token * math.log(2)), sync_dist=False, rank_zero_only=True)
        self.history.append((trainer.global_step, loss))

    def state_dict(self):
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state):
        self.history = [(int(s), float(v)) for s, v in state["history"]]


class NonFiniteLossGuard(L.Callback):
    """Stops the run with :class:`NonFiniteLossError` as soon as a training loss is NaN or infinite, before
    its backward pass and update, so the weights and every checkpoint already written stay as they were."""

    def __init__(self, run_dir: str | os.PathLike | None = None):
        self.run_dir = run_dir

    def on_before_backward(self, trainer, pl_module, loss):
        if not bool(torch.isfinite(loss)):
            where = ""
            if self.run_dir is not None and (Path(self.run_dir) / WEIGHTS_FILE).is_file():
                where = (f"; the last good checkpoint is kept in {self.run_dir} (weights) and "
                         f"{Path(self.run_dir) / LIGHTNING_DIR / LAST_CKPT} (for --resume)")
            elif self.run_dir is not None:
                where = "; no checkpoint had been written yet (the first is written at the first evaluation)"
            raise NonFiniteLossError(
                f"the training loss became {float(loss.detach())} at step {trainer.global_step + 1}: training stopped "
                f"before this update{where}. Try a lower --lr, --grad-clip 1.0 or --precision 32."
            )


class InterruptNotice(L.Callback):
    """On Ctrl-C, says what was kept: the step of the last written checkpoint and how to continue."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:
            step = read_meta(self.run_dir).get("step") if (self.run_dir / CONFIG_FILE).is_file() else None
            kept = (f"the checkpoint in {self.run_dir} (step {step}) is loadable" if step is not None
                    else "no checkpoint was written yet")
            print(f"\ndecoderlab: interrupted at step {trainer.global_step}; {kept}. Continue with: "
                  f"decoderlab train --resume {self.run_dir}", file=sys.stderr)


class ExportCheckpoint(L.Callback):
    """After each validation, (rank 0) writes the decoderlab checkpoint files of the run directory in place
    (``model.safetensors``, ``config.json``, ``tokenizer.json``, ``meta.json``), each atomically."""

    def __init__(self, run_dir, tokenizer, meta: dict, metrics: LMMetrics | None = None):
        self.run_dir, self.tokenizer, self.meta, self.metrics = Path(run_dir), tokenizer, dict(meta), metrics

    def export(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        meta = {**self.meta, "step": trainer.global_step}
        if self.metrics is not None and self.metrics.history:
            meta["val_loss"] = self.metrics.history[-1][1]
        save_checkpoint(self.run_dir, pl_module, self.tokenizer, meta=meta, inplace=True)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.export(trainer, pl_module)


class StepProgressBar(TQDMProgressBar):
    """Lightning's progress bar counting batches up to ``max_steps * accumulate`` (the windows are endless)."""

    def __init__(self, total_batches: int, refresh_rate: int = 10):
        super().__init__(refresh_rate=refresh_rate)
        self._total = int(total_batches)

    @property
    def total_train_batches(self):
        return self._total


def _loggers(run_dir: Path | None):
    if run_dir is None:
        return False
    from lightning.pytorch.loggers import CSVLogger

    # a new version directory per (resumed) run, so a resume never deletes the metrics logged before it
    loggers = [CSVLogger(str(Path(run_dir) / "logs"), name="csv")]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(str(Path(run_dir) / "logs"), name="tensorboard"))
    return loggers


def make_trainer(cfg: TrainConfig, run_dir: str | os.PathLike | None = None, *, devices: int | str = 1,
                 strategy: str = "auto", num_nodes: int = 1, accelerator: str = "auto",
                 callbacks: Sequence[L.Callback] = (), progress_bar: bool = True, logger: bool = True,
                 checkpointing: bool = True) -> L.Trainer:
    """A Lightning ``Trainer`` for language-model training with ``cfg``.

    ``max_steps``, gradient clipping (global norm), ``accumulate_grad_batches``, precision, validation every
    ``eval_every`` optimizer steps (``val_check_interval`` in batches, counted across the endless training
    windows), a step-counting progress bar, a CSV logger (and TensorBoard when installed) under
    ``run_dir/logs``, and ``ModelCheckpoint`` keeping the best (lowest ``val_loss``) and the last Lightning
    checkpoint in ``run_dir/lightning``. ``devices``, ``strategy`` ("auto", "ddp", "fsdp", ...),
    ``num_nodes`` and ``accelerator`` go to Lightning unchanged.
    """
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    run_dir = Path(run_dir) if run_dir is not None else None
    cbs = list(callbacks)
    if progress_bar:
        cbs.append(StepProgressBar(cfg.max_steps * cfg.accumulate, refresh_rate=max(1, min(25, cfg.eval_every))))
    loggers = _loggers(run_dir) if logger else False
    if loggers:
        cbs.append(LearningRateMonitor(logging_interval="step"))
    if checkpointing and run_dir is not None:
        cbs.append(ModelCheckpoint(dirpath=str(run_dir / LIGHTNING_DIR), filename="best-step{step}",
                                   auto_insert_metric_name=False, monitor="val_loss", mode="min", save_top_k=1,
                                   save_last=True))
    return L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, num_nodes=num_nodes,
        precision=_PRECISION_ALIASES[cfg.precision],
        max_steps=cfg.max_steps, max_epochs=-1,
        accumulate_grad_batches=cfg.accumulate,
        gradient_clip_val=cfg.grad_clip or None, gradient_clip_algorithm="norm",
        val_check_interval=cfg.eval_every * cfg.accumulate, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, use_distributed_sampler=False,
        log_every_n_steps=cfg.log_every, logger=loggers,
        enable_checkpointing=bool(checkpointing and run_dir is not None),
        enable_progress_bar=progress_bar, enable_model_summary=False,
        callbacks=cbs, default_root_dir=str(run_dir) if run_dir is not None else None,
    )


@dataclass
class TrainSummary:
    """What ``train_lm`` reports. Losses are nats per token.

    Attributes:
        steps: optimizer steps done (in total, including those before a resume).
        train_loss: mean training loss of the last min(50, steps) steps.
        val_loss: validation loss of the final model over all (or ``val_batches``) validation windows.
        val_ppl: ``exp(val_loss)``; val_bpb: bits per byte.
        tokens_per_second: training tokens (all processes) per second spent in training steps.
        train_seconds: seconds spent in training steps; wall_seconds: of the whole ``trainer.fit``.
        train_losses: loss of every optimizer step; val_history: [(step, val_loss)] at each evaluation.
        eval_log: every evaluation with its wall-clock time and whether it covered all windows or the
            subset (see ``decoderlab.timing``).
        run_dir: the run directory (decoderlab checkpoint + ``lightning/`` + ``logs/``).
    """

    steps: int
    train_loss: float
    val_loss: float | None
    val_ppl: float | None
    val_bpb: float | None
    tokens_per_second: float
    train_seconds: float
    wall_seconds: float
    num_parameters: int
    train_losses: list[float]
    val_history: list[tuple[int, float]]
    run_dir: str | None
    is_global_zero: bool = True
    eval_log: list = dataclasses.field(default_factory=list)  # timing.ValidationClock's entries

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>`` (shared by all processes of a multi-process run on one machine)."""
    env = os.environ.get("DECODERLAB_RUN_DIR")
    if env:
        return Path(env)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def resolve_resume(resume: str | os.PathLike | bool | None, run_dir: Path | None) -> tuple[Path, Path] | None:
    """``(run_dir, last.ckpt)`` for ``resume`` = a run directory, a Lightning ``.ckpt`` file, or True (the
    ``run_dir``). Raises ``FileNotFoundError`` naming where it looked when there is no checkpoint."""
    if resume is None or resume is False:
        return None
    if resume is True:
        if run_dir is None:
            raise ValueError("resume without a directory needs the run directory to resume from (--out / out=)")
        resume = run_dir
    path = Path(resume)
    if path.suffix == ".ckpt":
        if not path.is_file():
            raise FileNotFoundError(f"cannot resume: no checkpoint file {path}")
        rdir = path.parent.parent if path.parent.name == LIGHTNING_DIR else path.parent
        return rdir, path
    ckpt = path / LIGHTNING_DIR / LAST_CKPT
    if not ckpt.is_file():
        raise FileNotFoundError(
            f"cannot resume: no training checkpoint {ckpt} (a run directory written by `decoderlab train` holds "
            f"one after its first evaluation)"
        )
    return path, ckpt


def _corpus_text(corpus, text):
    if text is not None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"the corpus text is empty: it has {len(text)} characters and none but whitespace")
        return text
    return read_corpus(corpus)


def train_lm(
    corpus: str | os.PathLike | None = None,
    *,
    text: str | None = None,
    preset: str = "baby-shakespeare-speedrun",
    tokenizer: str | Tokenizer = "char",
    vocab_size: int | None = None,
    out: str | os.PathLike | None = None,
    train_config: TrainConfig | None = None,
    config_overrides: dict | None = None,
    model_overrides: dict | None = None,
    resume: str | os.PathLike | bool | None = None,
    devices: int | str = 1,
    strategy: str = "auto",
    num_nodes: int = 1,
    accelerator: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    callbacks: Sequence[L.Callback] = (),
    progress_bar: bool = True,
    logger: bool = True,
):
    """Train a GPT-style language model on a corpus with Lightning; return ``(model, tokenizer, summary)``.

    The corpus (``corpus`` path: a text file or a folder of .txt files; None = the embedded tinyshakespeare;
    or ``text``) is tokenized once (``corpus_tokens``, cached memmap), split by position (last
    ``val_fraction`` for validation) and served as random windows (``TokenDataModule``). The model is the
    ``preset`` with ``num_tokens`` = the tokenizer's vocabulary (plus ``model_overrides``), trained with
    AdamW + warm-up/cosine (``configure_optimizers``) for ``train_config.max_steps`` steps. ``preset`` may
    also name a recipe (``decoderlab.recipes.RECIPES``: a model preset and its TrainConfig, used when
    ``train_config`` is None); the default is the "baby-shakespeare-speedrun" recipe.

    The run directory ``out`` (default ``runs/<timestamp>``) receives, each written atomically:
    ``config.json``, ``tokenizer.json``, ``model.safetensors``, ``meta.json`` (``"task": "lm"``) -- a
    decoderlab checkpoint, refreshed at every evaluation and at the end -- plus ``run.json`` (the run's
    settings), ``summary.json``, ``lightning/last.ckpt`` and ``lightning/best-step*.ckpt`` (for ``resume``),
    and ``logs/`` (CSV; TensorBoard when installed).

    ``resume`` (a run directory, a ``.ckpt`` file, or True for ``out``) continues that run: model config,
    tokenizer and (unless given) train config and corpus come from the run directory; optimizer, schedule,
    step, data-sampler position and loss history from the Lightning checkpoint. ``config_overrides``
    (field -> value) are applied on top of ``train_config`` (or of the resumed run's, or the defaults).

    ``devices``, ``strategy`` ("ddp", "fsdp", ...), ``num_nodes``: passed to Lightning; ``batch_size`` is
    per process (global batch = batch_size * processes).

    Raises:
        FileNotFoundError: missing corpus path; ``resume`` without a checkpoint there.
        ValueError: bad config values; an empty corpus or a split shorter than max_len + 1 tokens; a
            non-UTF-8 file (named, with the byte offset); a resumed corpus that differs from the run's.
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
    """
    from .model import ModelConfig
    from .model import preset as preset_config

    run_dir = Path(out) if out is not None else None
    resumed = resolve_resume(resume, run_dir)
    run_info: dict = {}
    if resumed is not None:
        run_dir, ckpt_path = resumed
        run_file = run_dir / RUN_FILE
        if not run_file.is_file() or not (run_dir / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"cannot resume: {run_dir} lacks {RUN_FILE} or {CONFIG_FILE} of a training run")
        run_info = json.loads(run_file.read_text(encoding="utf-8"))
        if train_config is None:
            train_config = TrainConfig.from_dict(run_info["train_config"])
        if corpus is None and text is None and run_info.get("corpus") is not None:
            corpus = run_info["corpus"]
    else:
        ckpt_path = None
        if run_dir is None:
            run_dir = default_run_dir()
        if (run_dir / LIGHTNING_DIR / LAST_CKPT).is_file() and not os.environ.get("LOCAL_RANK"):
            raise ValueError(f"{run_dir} already holds a training run ({LIGHTNING_DIR}/{LAST_CKPT}); continue it "
                             f"with --resume {run_dir}, or train into another --out directory")
    from .recipes import resolve as resolve_recipe

    model_preset, recipe_config = resolve_recipe(preset)
    if train_config is None:
        train_config = recipe_config
    cfg = train_config if train_config is not None else TrainConfig()
    if config_overrides:
        cfg = cfg.replace(**config_overrides)  # validates
    cfg.validate()

    corpus_text = _corpus_text(corpus, text)
    corpus_sha = hashlib.sha256(corpus_text.encode("utf-8")).hexdigest()
    if resumed is not None:
        if run_info.get("corpus_sha256") not in (None, corpus_sha):
            raise ValueError(f"cannot resume {run_dir}: the corpus differs from the one the run was trained on "
                             f"({run_info.get('corpus')!r}, sha256 {run_info['corpus_sha256'][:12]}...)")
        tok = Tokenizer.load(run_dir / TOKENIZER_FILE)
        model_cfg = ModelConfig.from_json((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        if tok.vocab_size != model_cfg.num_tokens:
            raise ValueError(f"cannot resume {run_dir}: tokenizer vocabulary size {tok.vocab_size} does not match "
                             f"config num_tokens {model_cfg.num_tokens}")
    else:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer, corpus_text, vocab_size)
        model_cfg = preset_config(model_preset, **{"num_tokens": tok.vocab_size, **(model_overrides or {})})
        if model_cfg.num_tokens != tok.vocab_size:
            raise ValueError(f"model num_tokens {model_cfg.num_tokens} does not match the tokenizer's vocabulary "
                             f"size {tok.vocab_size}")

    tokens = corpus_tokens(corpus_text, tok, cache_dir)
    train_tokens, val_tokens = split_tokens(tokens, cfg.val_fraction)
    check_split_lengths(len(train_tokens), len(val_tokens), model_cfg.max_len)
    bytes_per_token = len(corpus_text.encode("utf-8")) / len(tokens)
    dm = TokenDataModule(train_tokens, val_tokens, max_len=model_cfg.max_len, batch_size=cfg.batch_size,
                         seed=cfg.seed, val_batch_size=cfg.val_batch_size, val_batches=cfg.val_batches,
                         num_workers=cfg.num_workers)

    L.seed_everything(cfg.seed, verbose=False)
    model = DecoderOnlyTransformer(model_cfg)
    model.train_config = cfg

    meta = {"task": "lm", "preset": None if resumed else preset, "tokenizer": getattr(tok, "kind", None),
            "bytes_per_token": bytes_per_token}
    history, metrics, guard = LossHistory(), LMMetrics(bytes_per_token), NonFiniteLossGuard(run_dir)
    exporter = ExportCheckpoint(run_dir, tok, meta, metrics)
    from .timing import ValidationClock

    clock = ValidationClock(val_tokens, model_cfg.max_len, cfg.val_batch_size, metrics,
                            full_val_below=cfg.full_val_below, subset=cfg.val_batches is not None,
                            precision=cfg.precision)
    trainer = make_trainer(cfg, run_dir, devices=devices, strategy=strategy, num_nodes=num_nodes,
                           accelerator=accelerator,
                           callbacks=[history, metrics, guard, exporter, clock, InterruptNotice(run_dir), *callbacks],
                           progress_bar=progress_bar, logger=logger)
    if trainer.is_global_zero and resumed is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / CONFIG_FILE, model_cfg.to_json())
        tok.save(run_dir / TOKENIZER_FILE)
        run_info = {"corpus": None if corpus is None else str(Path(corpus).resolve()),
                    "corpus_sha256": corpus_sha, "preset": preset, "tokenizer": getattr(tok, "kind", None),
                    "train_config": cfg.to_dict(), "devices": devices, "strategy": strategy,
                    "num_nodes": num_nodes}
        if text is not None:
            run_info["corpus"] = None
        atomic_write_text(run_dir / RUN_FILE, json.dumps(run_info, indent=2))

    if cfg.compile:  # each decoder block in place (Module.compile): state-dict keys stay plain
        for block in model.blocks:
            block.compile(backend="inductor" if cfg.compile is True else str(cfg.compile))
    env_set = "DECODERLAB_RUN_DIR" not in os.environ
    if env_set:  # processes launched by Lightning (DDP) write to the same run directory
        os.environ["DECODERLAB_RUN_DIR"] = str(run_dir)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(does not have many workers|resuming from a checkpoint "
                                                      r"that ended|`training_step` returned|exists and is not "
                                                      r"empty|LeafSpec).*")
            trainer.fit(model, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None,
                        weights_only=False)
    finally:
        if env_set:
            os.environ.pop("DECODERLAB_RUN_DIR", None)
    wall = time.perf_counter() - t0
    model = unwrap_model(model)
    model.eval()

    val_loss = None
    if trainer.is_global_zero:
        if cfg.full_val_at_end and cfg.val_batches is not None:  # the subset served while training only
            done = [e for e in clock.entries if e["windows"] == "all" and e["step"] == trainer.global_step]
            val_loss = done[-1]["val_loss"] if done else clock.full(trainer, model)
            metrics.history.append((trainer.global_step, val_loss))
        elif metrics.history and metrics.history[-1][0] == trainer.global_step:
            val_loss = metrics.history[-1][1]
        else:
            val_loss = evaluate_lm(model, val_tokens, model_cfg.max_len, cfg.val_batch_size, cfg.val_batches,
                                   cfg.precision)
            metrics.history.append((trainer.global_step, val_loss))
            clock.record(trainer.global_step, val_loss, "subset" if cfg.val_batches is not None else "all")
        exporter.export(trainer, model)
    last = history.losses[-50:]
    summary = TrainSummary(
        steps=trainer.global_step,
        train_loss=sum(last) / len(last) if last else float("nan"),
        val_loss=val_loss,
        val_ppl=math.exp(min(val_loss, 700.0)) if val_loss is not None else None,
        val_bpb=val_loss / (bytes_per_token * math.log(2)) if val_loss is not None else None,
        tokens_per_second=history.tokens / history.train_seconds if history.train_seconds else 0.0,
        train_seconds=history.train_seconds, wall_seconds=wall,
        num_parameters=model.num_parameters(),
        train_losses=list(history.losses), val_history=list(metrics.history),
        run_dir=str(run_dir), is_global_zero=trainer.is_global_zero, eval_log=list(clock.entries),
    )
    if trainer.is_global_zero:
        atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return model, tok, summary
