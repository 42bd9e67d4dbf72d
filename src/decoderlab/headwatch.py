"""Watching the heads while a model trains: a Lightning callback that records every head's detector scores
and the training loss every N steps into the run directory (``decoderlab train --watch-heads N``).

It sits above both ``training`` and ``glassbox`` (which never import each other): it reads the model the
way the glass box does and writes the records ``decoderlab.glassbox.watching`` defines and reads back
(``head_scores.jsonl``; drawn by ``decoderlab.glassbox.plotting.save_head_scores_png``).

Source: Olsson et al. 2022, "In-context Learning and Induction Heads" (induction heads form in a phase
change, visible in the loss at the same steps).
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

import lightning as L
import torch

from .checkpoint import unwrap_model
from .glassbox.watching import WATCH_FILE, append_record, probe_tokens, score_record

__all__ = ["HeadWatch", "WATCH_FILE"]


class HeadWatch(L.Callback):
    """Every ``every`` optimizer steps (and at step 0 of a fresh run), append one record to
    ``run_dir/head_scores.jsonl``: the step, the mean training loss since the last record (nats per token)
    and every head's previous-token, duplicate-token and induction scores on a fixed probe.

    Args:
        run_dir: the run directory (created if missing); None: the trainer's ``default_root_dir`` (the run
            directory of ``train_lm``, whose default ``runs/<timestamp>`` is only named when the run starts).
        every: record every this many steps (>= 1).
        probe: (B, T) ids to score on; default :func:`~decoderlab.glassbox.watching.probe_tokens` (4 rows of
            min(max_len // 2, 64) random tokens repeated twice, seed ``seed``).

    The scores are taken on rank 0 in eval mode without gradients (the model's mode is restored), eagerly
    (a compiled block is not recompiled for the hooks): with a probe of 4 x 128 tokens that is one small
    forward pass per record. Under FSDP (sharded weights) rank 0 cannot run the model alone: refused.

    Raises:
        ValueError: ``every`` below 1; a probe that is not (B, T) ids the model accepts; FSDP.
    """

    def __init__(self, run_dir: str | os.PathLike | None, every: int = 50, *, probe: torch.Tensor | None = None,
                 seed: int = 0):
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (steps between records), got {every!r}")
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.every = int(every)
        self.probe = probe
        self.seed = seed
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._last_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        if "fsdp" in type(trainer.strategy).__name__.lower():
            raise ValueError("HeadWatch runs the model on rank 0 alone, which sharded (FSDP) weights do not allow; "
                             "watch heads with a single device or DDP")
        if self.run_dir is None:
            self.run_dir = Path(trainer.default_root_dir)
        model = unwrap_model(pl_module.model)
        if self.probe is None:
            self.probe = probe_tokens(model, seed=self.seed)
        model.check_token_ids(self.probe)
        if self.probe.dim() != 2:
            raise ValueError(f"the probe must be (B, T) token ids, got shape {tuple(self.probe.shape)}")
        if trainer.is_global_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if trainer.global_step == 0:
                self._record(model, 0, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):  # summed on the device: no host sync until a record is written
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        step = trainer.global_step
        if step % self.every or step == self._last_step or not trainer.is_global_zero:
            return
        mean = None if not self._loss_count else float(self._loss_sum) / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        self._record(unwrap_model(pl_module.model), step, mean)

    def _record(self, model, step: int, loss: float | None) -> None:
        self._last_step = step
        append_record(self.run_dir, torch.compiler.disable(score_record)(model, self.probe, step, loss))
