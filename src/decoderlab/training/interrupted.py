"""A run stopped by Ctrl-C before its first checkpoint keeps one: ``lightning/last.ckpt`` at the steps done, so
``--resume`` continues it and the directory is never left half-written (a new run refuses a directory holding
a run's files; a resume needs a checkpoint)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

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
