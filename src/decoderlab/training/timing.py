"""Wall-clock log of the validations of a training run, with cheap subset evaluation while training and a
full evaluation when it matters (evaluation counts in a speedrun's wall time).

While training, Lightning validates every ``eval_every`` steps on a fixed subset (``val_batches`` batches of
the first validation windows). :class:`ValidationClock` records each of those with its wall-clock time and,
when the subset's loss is at or below ``full_val_below``, evaluates all validation windows at that step too.
``train_lm`` adds the final full evaluation (``full_val_at_end``), reusing one already made at the last step. Every entry is a dict ``{"step", "seconds"
(since training started), "unix_time", "val_loss" (nats per token), "windows" ("subset" | "all")}``.
"""

from __future__ import annotations

import time

import lightning as L

from .evaluation import evaluation_sums
from .strategy import evaluation_model


class ValidationClock(L.Callback):
    """Records every validation's loss with its wall-clock time; see the module docstring.

    Args:
        val_tokens: the validation split (1-D token array) for full evaluations.
        max_len, batch_size, precision: as for :func:`~decoderlab.training.evaluation.evaluation_sums`.
        metrics: the run's :class:`~decoderlab.training.callbacks.LMMetrics` (its last history entry is the
            loss just computed).
        full_val_below: evaluate all windows when the subset loss is <= this (None: never).
        subset: whether Lightning's validations cover only a subset (False: they are full already).
        byte_lengths: UTF-8 bytes per token id, for the bits per byte of a full evaluation (None: none).
    """

    def __init__(self, val_tokens, max_len: int, batch_size: int, metrics, *, full_val_below: float | None = None,
                 subset: bool = True, precision: str = "32", byte_lengths=None):
        self.val_tokens, self.max_len, self.batch_size = val_tokens, int(max_len), int(batch_size)
        self.metrics, self.full_val_below, self.subset, self.precision = metrics, full_val_below, subset, precision
        self.byte_lengths = byte_lengths
        self.entries: list[dict] = []
        self.last_full: tuple[int, dict] | None = None  # (step, evaluation_sums) of the latest full evaluation
        self.t0 = time.perf_counter()
        self.unix0 = time.time()

    def on_fit_start(self, trainer, pl_module):
        self.t0, self.unix0 = time.perf_counter(), time.time()

    def record(self, step: int, loss: float, windows: str) -> dict:
        """Append ``{"step", "seconds", "unix_time", "val_loss", "windows"}`` and return it."""
        entry = {"step": int(step), "seconds": time.perf_counter() - self.t0, "unix_time": time.time(),
                 "val_loss": float(loss), "windows": windows}
        self.entries.append(entry)
        return entry

    def full_sums(self, model, step: int) -> dict:
        """:func:`~decoderlab.training.evaluation.evaluation_sums` over all validation windows of ``model`` (a
        ``DecoderOnlyTransformer``) after ``step`` optimizer steps, recorded; the one already made at
        ``step`` is reused."""
        if self.last_full is not None and self.last_full[0] == step:
            return self.last_full[1]
        sums = evaluation_sums(model, self.val_tokens, self.max_len, self.batch_size, None, self.precision,
                               self.byte_lengths)
        self.record(step, sums["nats"] / sums["targets"], "all")
        self.last_full = (int(step), sums)
        return sums

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or not self.metrics.history:
            return
        step, loss = self.metrics.history[-1]  # (the same on every process)
        if trainer.is_global_zero:
            self.record(step, loss, "subset" if self.subset else "all")
        if self.subset and self.full_val_below is not None and loss <= self.full_val_below:
            model, _ = evaluation_model(trainer, pl_module.model)  # gathered on rank 0 under FSDP (a collective)
            if model is not None:
                self.full_sums(model, trainer.global_step)

    def state_dict(self):
        return {"entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state):
        self.entries = [dict(e) for e in state.get("entries", [])]
