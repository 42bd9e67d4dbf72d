"""Progress of a run on the terminal: Lightning's bar counting optimizer steps (:class:`StepProgressBar`), or
plain lines for logs and terminals without a bar (:class:`PlainProgress`). Both read the losses the metric
callbacks keep (:class:`~decoderlab.training.callbacks.LossHistory`, :class:`~decoderlab.training.callbacks.LMMetrics`),
never the device's tensors."""

from __future__ import annotations

import math
import sys
import time

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from ..output import print_line
from ..waiting import clock
from .callbacks import LMMetrics, LossHistory


class StepProgressBar(TQDMProgressBar):
    """Lightning's progress bar counting optimizer steps up to ``max_steps`` ("train 120/2000 [00:31<08:05,
    3.83step/s, train_loss=2.31]"). The windows are endless, so there are no epochs: the bar says "train", not
    "Epoch 0", and shows no logger version (``v_num``). After a resume it starts at the resumed step, and its
    rate and ETA count only the steps of this session."""

    def __init__(self, total_steps: int, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        self._total = int(total_steps)

    @property
    def total_train_batches(self):
        return self._total

    @property
    def train_description(self) -> str:
        return "train"

    def init_train_tqdm(self):
        """Lightning's training bar, counting steps from the (resumed) step to ``max_steps``."""
        step = min(self.trainer.global_step, self._total)
        return Tqdm(desc=self.train_description, total=self._total, initial=step, unit="step",
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT)

    def on_train_epoch_start(self, trainer, *_):
        # one endless epoch: Lightning's would reset the bar to "Epoch 0" and count its batches from 0
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        n = trainer.global_step
        if bar is not None and n != bar.n and self._should_update(n, bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        history = next((cb for cb in trainer.callbacks if isinstance(cb, LossHistory)), None)
        if history is not None and history.losses:  # (read at logging steps, not from the device every step)
            items["train_loss"] = f"{history.losses[-1]:.3f}"
        return items


class PlainProgress(L.Callback):
    """Progress as plain lines on standard output, for logs and terminals without a bar (no carriage returns):
    every ``log_every`` optimizer steps (and at the last step)::

        step   50/2000  train loss 2.4532  lr 5.00e-04  6,208 tokens/s  elapsed 0:21  ETA 13:25

    (the train loss is the mean over the steps since the previous line -- a module with a ``progress_fields()``
    method, as reinforcement learning's and DPO's, gives its own fields instead; tokens per second over the time spent
    in those training steps; the ETA extrapolates this session's time per step), and after each evaluation::

        step  250/2000  val loss 2.0312  perplexity 7.62  2.930 bits per byte

    Only the first process prints. The losses come from :class:`LossHistory` and :class:`LMMetrics` when the
    run has them (as ``train_lm``'s does). ``windows``: a label for the evaluations in ``fit`` ("first 256
    windows"), set by a run that also evaluates all windows at the end (whose line says "all N windows").
    """

    def __init__(self, max_steps: int, log_every: int = 50, stream=None):
        self.max_steps, self.log_every = int(max_steps), max(1, int(log_every))
        self.stream = stream
        self._t0 = 0.0
        self._step0 = 0
        self._last_step = -1
        self._mark = (0, 0, 0.0)  # (loss count, tokens, train seconds) of LossHistory at the previous line
        self._own: list[float] = []  # losses seen here when the run has no LossHistory
        self.windows: str | None = None

    def _print(self, line: str) -> None:
        # a closed pipe (`decoderlab train | head -4`) must not stop the run before its checkpoint: the
        # lines after the reader left are discarded and training goes on
        print_line(line, self.stream)

    def _step(self, step: int) -> str:
        width = len(str(self.max_steps))
        return f"step {step:>{width}}/{self.max_steps}"

    @staticmethod
    def _find(trainer, cls):
        return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()
        self._step0 = self._last_step = trainer.global_step
        history = self._find(trainer, LossHistory)
        if history is not None:
            self._mark = (len(history.losses), history.tokens, history.train_seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._last_step:
            return  # an accumulation batch: the step is not done yet
        self._last_step = step
        history = self._find(trainer, LossHistory)
        if history is None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self._own.append(float(loss.detach()))
        if not (step % self.log_every == 0 or step >= self.max_steps) or not trainer.is_global_zero:
            return
        if history is not None:
            n0, tok0, sec0 = self._mark
            losses = history.losses[n0:]
            tokens, seconds = history.tokens - tok0, history.train_seconds - sec0
            self._mark = (len(history.losses), history.tokens, history.train_seconds)
        else:
            losses, self._own = self._own, []
            tokens, seconds = 0, 0.0
        elapsed = time.perf_counter() - self._t0
        done = step - self._step0
        eta = elapsed / done * (self.max_steps - step) if done > 0 else 0.0
        parts = [self._step(step)]
        own = getattr(pl_module, "progress_fields", None)  # a module with metrics of its own (RL, DPO)
        if callable(own):
            parts += own()
        elif losses:
            parts.append(f"train loss {sum(losses) / len(losses):.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        if seconds > 0:
            parts.append(f"{tokens / seconds:,.0f} tokens/s")
        parts += [f"elapsed {clock(elapsed)}", f"ETA {clock(eta)}"]
        self._print("  ".join(parts))

    def validation_line(self, step: int, loss: float, bpb: float | None = None, windows: str | None = None) -> None:
        """Print the line of an evaluation at ``step``: mean loss ``loss`` (nats per token), its perplexity and
        ``bpb`` (bits per byte of the same targets) when known, and which ``windows`` it covered when given."""
        parts = [self._step(step), f"val loss {loss:.4f}", f"perplexity {math.exp(min(loss, 700.0)):.2f}"]
        if bpb:
            parts.append(f"{bpb:.3f} bits per byte")
        if windows:
            parts.append(f"({windows})")
        self._print("  ".join(parts))

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = self._find(trainer, LMMetrics)
        own = getattr(pl_module, "validation_fields", None)  # a loss that is not nats per token (DPO)
        if callable(own):
            self._print("  ".join([self._step(trainer.global_step), *own()]))
        elif metrics is not None and metrics.history:
            step, loss = metrics.history[-1]
            self.validation_line(step, loss, metrics.last.get("val_bpb"), self.windows)
        elif "val_loss" in trainer.callback_metrics:
            self.validation_line(trainer.global_step, float(trainer.callback_metrics["val_loss"]))
