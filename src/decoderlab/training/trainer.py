"""The Lightning ``Trainer`` of a language-model run: steps, accumulation, clipping, precision, validation
cadence, loggers and checkpoints, from a :class:`TrainConfig`."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
from pathlib import Path
from typing import Sequence

import lightning as L

from ..config.names import PRECISION_ALIASES
from ..config.train import TrainConfig
from .callbacks import LIGHTNING_DIR, AdapterState, FinalValidation, RunCheckpoint
from .interrupted import TrainingInterrupted
from .precision import choose_precision, detect_machine, resolve_precision
from .progress import PlainProgress, StepProgressBar
from .random_state import RandomState
from .strategy import build_strategy, check_strategy


class _StepNumbers:
    """Logger mixin: Lightning hands loggers the 0-based index of the optimizer step (``step`` 9 for the
    validation after 10 steps, and for the 10th step's loss and learning rate); write the 1-based step number,
    the number of steps done -- the step of ``val_history``, ``meta.json`` and ``best-step{N}.ckpt``."""

    def log_metrics(self, metrics, step=None):
        return super().log_metrics(metrics, None if step is None else step + 1)


def _loggers(run_dir: Path | None):
    if run_dir is None:
        return False
    from lightning.pytorch.loggers import CSVLogger

    class CSVStepLogger(_StepNumbers, CSVLogger):
        pass

    # a new version directory per (resumed) run, so a resume never deletes the metrics logged before it
    loggers = [CSVStepLogger(str(Path(run_dir) / "logs"), name="csv")]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        from lightning.pytorch.loggers import TensorBoardLogger

        class TensorBoardStepLogger(_StepNumbers, TensorBoardLogger):
            pass

        loggers.append(TensorBoardStepLogger(str(Path(run_dir) / "logs"), name="tensorboard"))
    return loggers


def check_run_options(cfg: TrainConfig, strategy: str = "auto", accelerator: str = "auto") -> str:
    """Refuse, before anything is read or launched, what cannot run on this machine or together: the
    strategy with the optimizer, accelerator and compile settings
    (:func:`~decoderlab.training.strategy.check_strategy`), the precision for the machine
    (:func:`~decoderlab.training.precision.resolve_precision`), a fused AdamW under the mixed precision
    "auto" chose with clipping. Returns the precision the run will train at.

    Raises:
        ValueError: one line naming the option, what cannot run and the alternatives.
    """
    check_strategy(str(strategy), optimizer=cfg.optimizer, accelerator=accelerator, compile=cfg.compile)
    precision, _ = resolve_precision(cfg.precision, detect_machine(accelerator), strategy=str(strategy))
    if cfg.fused and precision.endswith("-mixed") and cfg.grad_clip > 0:
        raise ValueError(f"fused=True cannot be combined with precision {precision!r} (--precision {cfg.precision} "
                         f"on this machine) and grad_clip={cfg.grad_clip}: use fused=None or False, grad_clip=0, or "
                         f"precision='32'")
    return precision


def make_trainer(cfg: TrainConfig, run_dir: str | os.PathLike | None = None, *, devices: int | str = 1,
                 strategy: str = "auto", num_nodes: int = 1, accelerator: str = "auto",
                 callbacks: Sequence[L.Callback] = (), progress_bar: bool | str = True, logger: bool = True,
                 checkpointing: bool = True) -> L.Trainer:
    """A Lightning ``Trainer`` for language-model training with ``cfg``.

    ``max_steps``, gradient clipping (global norm), ``accumulate_grad_batches``, precision, validation every
    ``eval_every`` optimizer steps (``val_check_interval`` in batches, counted across the endless training
    windows) and after the last step (:class:`FinalValidation`), progress (``progress_bar``: True for a
    step-counting bar, "plain" for a plain line every ``log_every`` steps and one per evaluation
    (:class:`PlainProgress`), False for none), a CSV logger (and TensorBoard when installed) under
    ``run_dir/logs`` whose ``step`` is the number of optimizer steps done, and ``ModelCheckpoint`` keeping the
    best (lowest ``val_loss``) and the last Lightning checkpoint in ``run_dir/lightning``
    (``best-step{N}.ckpt``: N steps done; one file under both names when the last is the best:
    :class:`~.callbacks.RunCheckpoint`; a LoRA run's without its frozen base: :class:`~.callbacks.AdapterState`),
    both written at every validation, each with the random state of
    every process (:class:`~decoderlab.training.random_state.RandomState`: a resume with dropout is exact). ``devices``, ``num_nodes`` and
    ``accelerator`` go to Lightning unchanged, ``strategy`` too ("auto", "ddp", ...) except "fsdp":
    decoderlab's FSDP2 (:mod:`decoderlab.training.strategy`). The precision is ``cfg.precision``, "auto"
    chosen for the machine (:func:`decoderlab.training.precision.choose_precision`).

    Raises:
        ValueError: a strategy, precision or option that cannot run on this machine or together (one line,
            before any process starts).
    """
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    check_run_options(cfg, strategy, accelerator)
    precision = choose_precision(cfg.precision, accelerator, strategy=str(strategy))
    run_dir = Path(run_dir) if run_dir is not None else None
    # dropout's generators saved and restored (an exact resume); a LoRA run's checkpoints without its frozen base
    cbs = [*callbacks, FinalValidation(), RandomState(), AdapterState()]
    if progress_bar not in (True, False, "plain"):
        raise ValueError(f"progress_bar must be True (a bar), 'plain' (lines) or False, got {progress_bar!r}")
    bar = progress_bar is True
    if bar:
        cbs.append(StepProgressBar(cfg.max_steps))
    elif progress_bar == "plain":
        cbs.append(PlainProgress(cfg.max_steps, cfg.log_every))
    loggers = _loggers(run_dir) if logger else False
    if loggers:
        cbs.append(LearningRateMonitor(logging_interval="step"))
    if checkpointing and run_dir is not None:
        cbs.append(RunCheckpoint(dirpath=str(run_dir / LIGHTNING_DIR), filename="best-step{step}",
                                 auto_insert_metric_name=False, monitor="val_loss", mode="min", save_top_k=1,
                                 save_last=True, enable_version_counter=False))  # always last.ckpt, never last-v1
    return L.Trainer(
        accelerator=accelerator, devices=devices, strategy=build_strategy(strategy), num_nodes=num_nodes,
        precision=PRECISION_ALIASES[precision],
        max_steps=cfg.max_steps, max_epochs=-1,
        accumulate_grad_batches=cfg.accumulate,
        gradient_clip_val=cfg.grad_clip or None, gradient_clip_algorithm="norm",
        val_check_interval=cfg.eval_every * cfg.accumulate, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, use_distributed_sampler=False,
        # a run shorter than log_every still logs its train loss once (at its last step)
        log_every_n_steps=min(cfg.log_every, cfg.max_steps), logger=loggers,
        # a caller's own ModelCheckpoint (a run without validation, e.g. reinforcement learning) needs it on too
        enable_checkpointing=bool(checkpointing and run_dir is not None) or any(isinstance(c, ModelCheckpoint) for c in cbs),
        enable_progress_bar=bar, enable_model_summary=False,
        callbacks=cbs, default_root_dir=str(run_dir) if run_dir is not None else None,
    )


def fit(trainer: L.Trainer, *args, **kwargs) -> None:
    """``trainer.fit(*args, **kwargs)``, with Ctrl-C as an exception a caller can handle.

    Lightning handles a ``KeyboardInterrupt`` itself (the callbacks' ``on_exception``, e.g. ``InterruptNotice``,
    and teardown), then ignores SIGINT and calls ``sys.exit(1)``. Here that exit becomes
    :class:`TrainingInterrupted` (a ``KeyboardInterrupt``; ``decoderlab train`` exits 130) and the SIGINT
    handler in force before is restored. Other ``SystemExit`` are re-raised.
    """
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    try:
        trainer.fit(*args, **kwargs)
    except SystemExit:
        if not trainer.interrupted:
            raise
        raise TrainingInterrupted(f"training interrupted at step {trainer.global_step}") from None
    finally:
        if handler is not None and signal.getsignal(signal.SIGINT) is not handler:
            signal.signal(signal.SIGINT, handler)
