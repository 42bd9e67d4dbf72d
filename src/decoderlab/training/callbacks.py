"""Lightning callbacks of a language-model run: loss history and tokens per second, exact validation
metrics, the NaN guard, the checkpoint export, a LoRA run's checkpoints without its base, and the Lightning
checkpoints whose ``last.ckpt`` is never a copy of the best. (The progress display that reads them is
:mod:`.progress`; the Ctrl-C notice, :mod:`.interrupted`.)"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ..checkpoint import MERGED_DIR, META_FILE, save_adapter_checkpoint, save_checkpoint
from ..lora import has_lora, merge_lora
from .strategy import full_model
from .sums import host_column_sums, sum_over_ranks

LIGHTNING_DIR = "lightning"
LAST_CKPT = "last.ckpt"


class _DropLightningTips(logging.Filter):
    """Lightning prints an advertisement ("Tip: ... litlogger") with every Trainer, and banners that tell a
    user nothing ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores", "`Trainer.fit`
    stopped: `max_steps=...` reached", the end of every run; "Restoring states from the checkpoint path at
    ...", said by decoderlab's own resume line; "Detected KeyboardInterrupt, attempting graceful shutdown ...",
    said by :class:`InterruptNotice` with what was kept); keep real messages (a GPU that is available, a run
    stopped early)."""

    _NOISE = re.compile(r"litlogger|^(GPU|TPU|HPU|IPU) available: False|^`Trainer\.fit` stopped: `max_(steps|epochs)="
                        r"|^Restor(ing|ed all) states from the checkpoint|^\s*Detected KeyboardInterrupt, attempting")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._NOISE.search(record.getMessage())


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLightningTips())


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before updating the weights with it."""


def _synchronize(pl_module) -> None:
    """Wait for queued GPU work, so that a wall-clock interval measures the work done in it."""
    device = getattr(pl_module, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def is_logging_step(trainer, step: int | None = None) -> bool:
    """Whether optimizer step ``step`` (1-based; default ``trainer.global_step``, the one just done) is one
    where training metrics reach the host: every ``trainer.log_every_n_steps`` steps and the last step. The
    other steps wait for nothing on the device."""
    step = trainer.global_step if step is None else step
    every = max(1, int(trainer.log_every_n_steps or 1))
    return step % every == 0 or 0 < trainer.max_steps <= step


class LossHistory(L.Callback):
    """Records the training loss of every optimizer step (mean over its accumulated batches and, under DDP,
    over all processes), the training tokens (targets of every batch on every process) and the seconds spent
    in training steps (from the start to the end of each batch), and the wall-clock seconds of the run. Its
    state is saved in Lightning's checkpoints, so a resumed run keeps the whole history: its counts and
    seconds include those before the resume.

    The step losses stay on the device until a logging step (:func:`is_logging_step`), a validation, a
    checkpoint or the end of training, where they are averaged over processes and copied to the host at once
    (:meth:`flush`, on every process): a steady step waits for nothing. On a GPU the clock waits for the
    queued work at those same points only, so the work of the steps before is counted there.
    """

    def __init__(self):
        self.losses: list[float] = []
        self.train_seconds = 0.0
        self.tokens = 0
        #: wall-clock seconds of the run's earlier ``fit`` calls, up to the checkpoint it resumed from
        self.wall_seconds_before = 0.0
        self._acc: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []  # step means on the device, not yet on the host
        self._t0 = 0.0
        self._fit_t0: float | None = None
        self._trainer = None

    def on_fit_start(self, trainer, pl_module):
        self._fit_t0 = time.perf_counter()
        self._trainer = trainer

    @property
    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run so far: earlier ``fit`` calls (before a resume) plus this one."""
        now = time.perf_counter()
        return self.wall_seconds_before + (now - self._fit_t0 if self._fit_t0 is not None else 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._acc.append(loss.detach().float() * trainer.accumulate_grad_batches)
        self.tokens += batch[1].numel() * trainer.world_size
        if len(self._acc) >= trainer.accumulate_grad_batches:
            self._pending.append(torch.stack(self._acc).mean())
            self._acc = []
            if is_logging_step(trainer):
                _synchronize(pl_module)
                self.flush(trainer)
        self.train_seconds += time.perf_counter() - self._t0

    def flush(self, trainer=None) -> None:
        """Move the pending step losses to ``losses`` (averaged over processes first: a collective, so every
        process calls it at the same point)."""
        trainer = trainer if trainer is not None else self._trainer
        pending, self._pending = self._pending, []
        if not pending:
            return
        means = torch.stack(pending)
        if trainer is not None and trainer.world_size > 1:
            means = trainer.strategy.reduce(means, reduce_op="mean")
        self.losses.extend(means.cpu().tolist())

    def on_validation_start(self, trainer, pl_module):
        self.flush(trainer)

    def on_train_end(self, trainer, pl_module):
        self.flush(trainer)

    def state_dict(self):
        self.flush()  # (Lightning collects callback states on every process)
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
    checkpoints too. Each batch's sums stay on the device (float32 nats, int64 counts); the totals are made
    in float64 on the host once per validation (:mod:`decoderlab.training.sums`).

    Args:
        byte_lengths: 1-D array (vocab_size,) of UTF-8 bytes per token id; None logs no ``val_bpb``.
    """

    def __init__(self, byte_lengths=None):
        self.byte_lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64)
        self._lengths = self.byte_lengths  # on the device of the batches
        self.history: list[tuple[int, float]] = []
        self.last: dict[str, float] = {}
        self._rows: list[list[torch.Tensor]] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        self._rows = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        y = batch[1].detach().reshape(-1)
        real = y != -100
        n = real.sum()
        nats = torch.where(n > 0, outputs.detach().float() * n, 0.0)  # a batch without targets adds nothing
        row = [nats, n]
        if self.byte_lengths is not None:
            if self._lengths.device != y.device:
                self._lengths = self.byte_lengths.to(y.device)
            row.append((self._lengths[y.clamp_min(0)] * real).sum())
        self._rows.append(row)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        totals = (host_column_sums(self._rows) + [0.0, 0.0, 0.0])[:3]
        nats, count, nbytes = sum_over_ranks(trainer.strategy, totals)
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
    """Stops the run with :class:`NonFiniteLossError` once a training loss was NaN or infinite, before any
    checkpoint is written from weights it touched, on every process together.

    Each loss is checked on the device without waiting for it (the first non-finite step and its loss are
    kept there). The host reads that record -- combined over all processes first, so that every process
    stops at the same point instead of one raising while the others wait in a collective -- before the
    optimizer update of every logging step (:func:`is_logging_step`), before each validation and checkpoint,
    and at the end of training. With ``log_every`` 1 a bad loss therefore stops the run before its update;
    otherwise at the next logging step, its weights discarded.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None):
        self.run_dir = run_dir
        #: on the device: (first non-finite step (1-based; 0 = none), its loss); float32 holds steps exactly
        #: up to 2**24
        self._record: torch.Tensor | None = None
        self._unchecked = False  # a loss was recorded since the last check

    def on_before_backward(self, trainer, pl_module, loss):
        loss = loss.detach().float().reshape(())
        if self._record is None or self._record.device != loss.device:
            self._record = torch.zeros(2, dtype=torch.float32, device=loss.device)
        first = ~torch.isfinite(loss) & (self._record[0] == 0)
        self._record = torch.where(first, torch.stack([loss.new_tensor(trainer.global_step + 1), loss]),
                                   self._record)
        self._unchecked = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if is_logging_step(trainer, trainer.global_step + 1):  # the step about to be made
            self.check(trainer)

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.check(trainer)

    def on_train_end(self, trainer, pl_module):
        self.check(trainer)

    def check(self, trainer) -> None:
        """Raise :class:`NonFiniteLossError` on every process when a loss of any process was not finite (a
        collective: every process calls it at the same point; nothing to do when no loss came since the
        last check, alike on every process)."""
        if not self._unchecked:
            return
        self._unchecked = False
        records = self._record.reshape(1, 2)
        if trainer.world_size > 1:
            records = trainer.strategy.all_gather(self._record).reshape(-1, 2)
        bad = [(int(step), loss) for step, loss in records.cpu().tolist() if step]
        if bad:
            self.raise_error(*min(bad), trainer)

    def raise_error(self, step: int, loss: float, trainer) -> None:
        where = ""
        if self.run_dir is not None and (Path(self.run_dir) / META_FILE).is_file():
            where = (f"; the last good checkpoint is kept in {self.run_dir} (weights) and "
                     f"{Path(self.run_dir) / LIGHTNING_DIR / LAST_CKPT} (for --resume)")
        elif self.run_dir is not None:
            where = "; no checkpoint had been written yet (the first is written at the first evaluation)"
        stopped = ("before this update" if step == trainer.global_step + 1
                   else f"at step {trainer.global_step}, the weights since then discarded")
        raise NonFiniteLossError(f"the training loss became {loss} at step {step}: training stopped {stopped}"
                                 f"{where}. Try a lower --lr, --grad-clip 1.0 or --precision 32.")


class ExportCheckpoint(L.Callback):
    """After each validation, global rank 0 writes the decoderlab checkpoint files of the run directory in
    place (``model.safetensors``, ``config.json``, ``tokenizer.json``, ``meta.json``), each atomically, from the
    whole weights (gathered from every process first under FSDP).

    A model with LoRA adapters is written as its adapter alone (:func:`decoderlab.checkpoint.save_adapter_checkpoint`:
    ``adapter/`` beside config, tokenizer and meta, whose ``"base"`` and ``"base_sha256"`` -- in ``meta`` -- point
    to the frozen base): no copy of the base. With ``merged_dtype`` the final export (``export(..., final=True)``)
    also writes the merged model (:func:`decoderlab.lora.merge_lora`) in that dtype -- the base's -- as an ordinary
    checkpoint in ``RUN_DIR/merged``. ``every_n_steps``: also export after every that many optimizer steps and
    after the last, the last one final (a run without validation, as reinforcement learning)."""

    def __init__(self, run_dir, tokenizer, meta: dict, metrics: LMMetrics | None = None, *,
                 merged_dtype: torch.dtype | None = None, every_n_steps: int | None = None):
        self.run_dir, self.tokenizer, self.meta, self.metrics = Path(run_dir), tokenizer, dict(meta), metrics
        self.merged_dtype = merged_dtype
        self.every_n_steps = every_n_steps
        self._exported = -1  # the step last exported by on_train_batch_end

    def export(self, trainer, model, *, final: bool = False) -> None:
        """Write the checkpoint of ``model`` (with its whole weights, :func:`~.strategy.full_model`) on
        global rank 0; nothing elsewhere. ``final``: the run's last export (the merged model, when asked)."""
        if not trainer.is_global_zero or model is None:
            return
        meta = {**self.meta, "step": trainer.global_step}
        if self.metrics is not None and self.metrics.history:
            meta["val_loss"] = self.metrics.history[-1][1]
        if not (has_lora(model) and meta.get("base_sha256")):  # (a LoRA run of an earlier version: merged)
            save_checkpoint(self.run_dir, merge_lora(model) if has_lora(model) else model, self.tokenizer, meta=meta,
                            inplace=True)
            return
        save_adapter_checkpoint(self.run_dir, model, self.tokenizer, meta=meta)
        if final and self.merged_dtype is not None:
            merged = merge_lora(model).to(self.merged_dtype)
            ordinary = {k: v for k, v in meta.items() if k not in ("base_sha256",)}
            save_checkpoint(self.run_dir / MERGED_DIR, merged, self.tokenizer,
                            meta={**ordinary, "merged": str(self.merged_dtype).removeprefix("torch.")})

    def on_train_start(self, trainer, pl_module):
        self._exported = trainer.global_step  # (a resumed run: its checkpoint is that step's)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step  # the steps done; unchanged over a step's accumulation batches
        if not self.every_n_steps or step <= self._exported or not (
                step % self.every_n_steps == 0 or step >= trainer.max_steps):
            return
        self._exported = step
        self.export(trainer, full_model(trainer, pl_module.model), final=step >= trainer.max_steps)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.export(trainer, full_model(trainer, pl_module.model))  # a collective under FSDP


class AdapterState(L.Callback):
    """A LoRA run's Lightning checkpoints hold what trains -- the adapters, and the optimizer's state, which is
    theirs alone -- and not the frozen base (the run's base checkpoint, put back before a resume restores them):
    the ``state_dict`` is cut to the trainable parameters, and loaded without requiring the rest. A model without
    adapters is left as it is."""

    def setup(self, trainer, pl_module, stage):
        if has_lora(pl_module):
            pl_module.strict_loading = False  # (the frozen weights come from the base, not the checkpoint)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if has_lora(pl_module):
            trained = {n for n, p in pl_module.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trained}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        if has_lora(pl_module):
            missing = [n for n, p in pl_module.named_parameters()
                       if p.requires_grad and n not in checkpoint["state_dict"]]
            if missing:
                raise ValueError(f"the checkpoint holds no weights for the adapters {missing[:3]}: it is not this "
                                 f"LoRA run's")


def _hard_link(source: str, target: str) -> None:
    """``target`` becomes another name of ``source``'s file, atomically (a copy where links are not allowed)."""
    tmp = f"{target}.link.tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is never a second copy of ``best-step{N}.ckpt``: when the
    top-k checkpoint was written at this very step, ``last.ckpt`` becomes a hard link to it (one file on the disk
    under two names); at a step that is not the best it is its own file, written under a name of its own (a link
    is dropped first, so the best file is never written through it)."""

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        if not self.save_last:
            return
        last = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        now = self.format_checkpoint_name(monitor_candidates)  # the top-k file of this step
        if self.best_model_path == now and self._last_global_step_saved == trainer.global_step:
            self.last_model_path = last
            if trainer.is_global_zero:
                _hard_link(now, last)
            trainer.strategy.barrier()
            return
        if trainer.is_global_zero and os.path.isfile(last) and os.stat(last).st_nlink > 1:
            os.remove(last)  # a link to an older best: the new last.ckpt is a file of its own
        trainer.strategy.barrier()
        super()._save_last_checkpoint(trainer, monitor_candidates)
