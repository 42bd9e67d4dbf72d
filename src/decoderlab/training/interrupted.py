"""Ctrl-C during training: :class:`InterruptNotice` says what was kept and how to continue, and a run stopped
before its first checkpoint keeps one (``lightning/last.ckpt`` at the steps done, :func:`keep_interrupted`), so
``--resume`` continues it and the directory is never left half-written (a new run refuses a directory holding
a run's files; a resume needs a checkpoint)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning as L

from ..checkpoint import META_FILE, read_meta
from .callbacks import LAST_CKPT, LIGHTNING_DIR


def keep_interrupted(trainer, run_dir: str | os.PathLike) -> Path | None:
    """Save ``run_dir/lightning/last.ckpt`` when a Ctrl-C came before any training checkpoint was written (one
    process: a save on several processes would wait for the others, which may be gone). Returns the file, or
    None when one already existed, several processes ran, or the run had not started (nothing to save)."""
    path = Path(run_dir) / LIGHTNING_DIR / LAST_CKPT
    if path.is_file() or trainer.world_size != 1 or trainer.lightning_module is None:
        return None
    if not (Path(run_dir) / "run.json").is_file():
        return None  # the run wrote nothing yet: its directory is as it found it
    try:
        with warnings.catch_warnings():  # Lightning's notes about a save from an interrupted loop
            warnings.simplefilter("ignore")
            trainer.save_checkpoint(str(path), weights_only=False)  # (None logs a line saying so)
    except Exception:  # interrupted while Lightning was still setting up: nothing that could resume
        return None
    return path


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training (raised by ``train_lm``, ``finetune``, ``train_pairs`` instead of Lightning's
    ``sys.exit(1)``); :class:`InterruptNotice` has already said what was kept and how to continue."""


class InterruptNotice(L.Callback):
    """On Ctrl-C, says what was kept: the step of the last written checkpoint and how to continue
    (``decoderlab {command} --resume RUN_DIR``)."""

    def __init__(self, run_dir: str | os.PathLike, command: str = "train"):
        self.run_dir, self.command = Path(run_dir), command

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:
            saved = keep_interrupted(trainer, self.run_dir)  # before the first evaluation: a resumable one now
            step = read_meta(self.run_dir).get("step") if (self.run_dir / META_FILE).is_file() else None
            kept = (f"the checkpoint in {self.run_dir} (step {step}) is loadable" if step is not None
                    else f"a training checkpoint at step {trainer.global_step} was kept ({saved})" if saved is not None
                    else "no checkpoint was written yet")
            end_bar = "\n" if sys.stderr.isatty() else ""  # a progress bar's line is not ended on a terminal
            print(f"{end_bar}decoderlab: interrupted at step {trainer.global_step}; {kept}. Continue with: "
                  f"decoderlab {self.command} --resume {self.run_dir}", file=sys.stderr, flush=True)
