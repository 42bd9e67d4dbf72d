"""Lightning callbacks of a language-model run: loss history and tokens per second, exact validation
metrics, the NaN guard, the Ctrl-C notice, the checkpoint export, and the step-counting progress bar."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from ..checkpoint import CONFIG_FILE, WEIGHTS_FILE, read_meta, save_checkpoint

LIGHTNING_DIR = "lightning"
LAST_CKPT = "last.ckpt"


class _DropLightningTips(logging.Filter):
    """Lightning prints an advertisement ("Tip: ... litlogger") with every Trainer; keep real messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLightningTips())


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before updating the weights with it."""


def _synchronize(pl_module) -> None:
    """Wait for queued GPU work, so that a wall-clock interval measures the work done in it."""
    device = getattr(pl_module, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class LossHistory(L.Callback):
    """Records the training loss of every optimizer step (mean over its accumulated batches and, under DDP,
    over all processes), the training tokens (targets of every batch on every process) and the seconds spent
    in training steps (from the start to the end of each batch, GPU work included), and the wall-clock seconds
    of the run. Its state is saved in Lightning's checkpoints, so a resumed run keeps the whole history: its
    counts and seconds include those before the resume."""

    def __init__(self):
        self.losses: list[float] = []
        self.train_seconds = 0.0
        self.tokens = 0
        #: wall-clock seconds of the run's earlier ``fit`` calls, up to the checkpoint it resumed from
        self.wall_seconds_before = 0.0
        self._acc: list[torch.Tensor] = []
        self._t0 = 0.0
        self._fit_t0: float | None = None

    def on_fit_start(self, trainer, pl_module):
        self._fit_t0 = time.perf_counter()

    @property
    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run so far: earlier ``fit`` calls (before a resume) plus this one."""
        now = time.perf_counter()
        return self.wall_seconds_before + (now - self._fit_t0 if self._fit_t0 is not None else 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _synchronize(pl_module)
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
        _synchronize(pl_module)
        self.train_seconds += time.perf_counter() - self._t0

    def state_dict(self):
        return {"losses": list(self.losses), "train_seconds": self.train_seconds, "tokens": self.tokens,
                "wall_seconds": self.wall_seconds}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])
        self.train_seconds = float(state["train_seconds"])
        self.tokens = int(state["tokens"])
        self.wall_seconds_before = float(state.get("wall_seconds", 0.0))


class LMMetrics(L.Callback):
    """The validation metrics of a language-model run, each computed from exactly the targets it describes.

    Over one validation (all processes together): ``val_loss`` = nats summed over every validation target /
    the number of targets (labels of -100 are not targets); ``val_ppl`` = ``exp(val_loss)``; ``val_bpb`` (bits
    per byte) = those nats / (ln 2 x the UTF-8 bytes of those same targets), the bytes of target id ``i``
    being ``byte_lengths[i]`` (see :func:`decoderlab.data.token_byte_lengths`). All three are logged (on every
    process, equal); ``history`` [(step, val_loss)] and ``last`` (the latest three) are kept, the history in
    checkpoints too.

    Args:
        byte_lengths: 1-D array (vocab_size,) of UTF-8 bytes per token id; None logs no ``val_bpb``.
    """

    def __init__(self, byte_lengths=None):
        self.byte_lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.float64)
        self.history: list[tuple[int, float]] = []
        self.last: dict[str, float] = {}
        self._sums = None

    def on_validation_epoch_start(self, trainer, pl_module):
        self._sums = torch.zeros(3, dtype=torch.float64)  # nats, targets, bytes

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        y = batch[1].detach().cpu().reshape(-1)
        y = y[y != -100]
        if y.numel() == 0:
            return
        n = y.numel()
        self._sums[0] += outputs.detach().double().cpu() * n
        self._sums[1] += n
        if self.byte_lengths is not None:
            self._sums[2] += self.byte_lengths[y].sum()

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        total = self._sums.to(pl_module.device)
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(total, reduce_op="sum")
        nats, count, nbytes = (float(v) for v in total.cpu())
        if count == 0:
            raise ValueError("the validation windows held no targets")
        loss = nats / count
        self.last = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
        if self.byte_lengths is not None and nbytes > 0:
            self.last["val_bpb"] = nats / (math.log(2) * nbytes)
        for name, value in self.last.items():
            pl_module.log(name, value, prog_bar=name == "val_loss", sync_dist=False)
        self.history.append((trainer.global_step, loss))

    def state_dict(self):
        return {"history": [list(h) for h in self.history], "last": dict(self.last)}

    def load_state_dict(self, state):
        self.history = [(int(s), float(v)) for s, v in state["history"]]
        self.last = {k: float(v) for k, v in state.get("last", {}).items()}


class FinalValidation(L.Callback):
    """Validates after the last optimizer step too (not only every ``eval_every`` steps), so that the final
    model's metrics are logged and the checkpoints written at that validation describe the last step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True  # Lightning runs a validation before it stops


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

    def export(self, trainer, model) -> None:
        if not trainer.is_global_zero:
            return
        meta = {**self.meta, "step": trainer.global_step}
        if self.metrics is not None and self.metrics.history:
            meta["val_loss"] = self.metrics.history[-1][1]
        save_checkpoint(self.run_dir, model, self.tokenizer, meta=meta, inplace=True)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.export(trainer, pl_module.model)


class StepProgressBar(TQDMProgressBar):
    """Lightning's progress bar counting batches up to ``max_steps * accumulate`` (the windows are endless)."""

    def __init__(self, total_batches: int, refresh_rate: int = 10):
        super().__init__(refresh_rate=refresh_rate)
        self._total = int(total_batches)

    @property
    def total_train_batches(self):
        return self._total
