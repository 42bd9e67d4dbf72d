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
