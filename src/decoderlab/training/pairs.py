"""The lesson's training: a model on prompt/response pairs, ``L.Trainer(max_epochs=30)``, Adam(lr=0.1); the
checkpoint stores the lesson's pair scheme as its chat template, so it answers through the one chat path, and
its run directory keeps ``lightning/last.ckpt`` and ``run.json``, so that a resume continues it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import lightning as L
import torch

from ..checkpoint import CHAT_TEMPLATE_KEY, save_checkpoint
from ..files import atomic_write_text
from ..config.defaults import PAIR_TRAIN
from ..config.train import MAX_STEPS
from ..lesson import LESSON_PAIRS, LESSON_TEMPLATE, pair_dataloader, tokenizer_for_pairs
from ..model import DecoderOnlyTransformer, preset
from ..config.train import TrainConfig, check_train_seed
from .callbacks import LIGHTNING_DIR
from .module import LitModel
from .random_state import RandomState
from .run import RUN_FILE, Run, check_new_run_dir, check_run_kind, fit_run, resolve_resume


#: the settings a resumed pair run keeps (they define its model, batches and optimizer); max_epochs may grow
PAIR_FIXED = ("preset", "pairs", "seed", "lr", "batch_size")


def train_pairs(
    pairs: Sequence[tuple[str, str]] | None = None,
    out: str | os.PathLike | None = None,
    *,
    preset_name: str | None = None,
    max_epochs: int | None = None,
    seed: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    progress_bar: bool = False,
    resume: str | os.PathLike | bool | None = None,
):
    """Train a model on prompt/response pairs exactly as the lesson does and return ``(model, tokenizer)``.

    ``L.seed_everything(seed)``, a ``WordTokenizer`` over the pairs' words (the lesson's 5 tokens for its
    pairs), ``DecoderOnlyTransformer`` of the preset with ``num_tokens`` = vocabulary size, Adam(lr), and
    ``L.Trainer(max_epochs)`` over a ``DataLoader`` of the pairs (batch size 1, no shuffling). Defaults:
    :data:`decoderlab.lesson.LESSON_PAIRS`, preset "statquest" and ``decoderlab.config.PAIR_TRAIN`` (30 epochs,
    seed 42, lr 0.1, batch 1). If ``out`` is given (a new directory: one that holds files is refused before
    training), a checkpoint directory is written there; its ``meta.json`` stores the lesson's template
    (``"chat_template"``: ``prompt <EOS> response <EOS>``, :data:`decoderlab.lesson.LESSON_TEMPLATE`), with
    which chat, generate and the server answer its prompts; beside it ``run.json`` (the pairs and settings) and
    ``lightning/last.ckpt`` (written after every epoch), so that ``resume`` (the run directory, its ``.ckpt``,
    or True for ``out``) continues it: the run's own pairs and settings, ``max_epochs`` more if given larger.

    Raises:
        ValueError: bad pairs, max_epochs < 1, lr <= 0, batch_size < 1, seed outside 0 .. 2**32-1; on a resume
            another preset, pairs, seed, lr or batch size, or max_epochs not above the epochs done.
        FileExistsError: ``out`` holds files. FileNotFoundError: no run to resume there.
    """
    given = {"preset": preset_name, "pairs": None if pairs is None else [list(p) for p in pairs], "seed": seed,
             "lr": lr, "batch_size": batch_size, "max_epochs": max_epochs}
    run_dir, ckpt_path, settings = plan_pair_run(out, resume, given)
    pairs = [tuple(p) for p in settings["pairs"]]
    check_train_seed(settings["seed"])
    if not 1 <= settings["max_epochs"] <= MAX_STEPS:
        raise ValueError(f"max_epochs must be >= 1 and <= {MAX_STEPS:,} (MAX_STEPS), got {settings['max_epochs']:,}")
    if not settings["lr"] > 0:
        raise ValueError(f"lr must be > 0, got {settings['lr']}")
    if settings["batch_size"] < 1:
        raise ValueError(f"batch_size must be >= 1, got {settings['batch_size']}")
    tokenizer = tokenizer_for_pairs(pairs)
    if run_dir is not None and ckpt_path is None:
        check_new_run_dir(run_dir)  # before training, so a bad --out loses no work
    L.seed_everything(settings["seed"], verbose=False)
    model = DecoderOnlyTransformer(preset(settings["preset"], num_tokens=tokenizer.vocab_size), lr=settings["lr"])
    longest = max(len(p.split()) + len(r.split()) + 1 for p, r in pairs)
    if longest > model.config.max_len:
        raise ValueError(f"a pair has {longest} tokens, more than the model's max_len={model.config.max_len}")
    trainer = L.Trainer(max_epochs=settings["max_epochs"], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=run_dir is not None, callbacks=_pair_callbacks(run_dir),
                        enable_progress_bar=progress_bar, enable_model_summary=False, deterministic=True)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / RUN_FILE, json.dumps({"task": "pairs", **settings}, indent=2))
    run = None if ckpt_path is None else Run(run_dir, ckpt_path, TrainConfig())
    fit_run(trainer, LitModel(model), run, train_dataloaders=pair_dataloader(pairs, tokenizer,
                                                                              batch_size=settings["batch_size"]))
    model.eval()
    if run_dir is not None:
        save_checkpoint(run_dir, model, tokenizer, meta={"task": "chat", CHAT_TEMPLATE_KEY: dict(LESSON_TEMPLATE),
                                                         "epochs": settings["max_epochs"]}, inplace=True)
    return model, tokenizer


def _pair_callbacks(run_dir: Path | None) -> list:
    """``lightning/last.ckpt`` after every epoch (a run with a directory), and the random state with it."""
    if run_dir is None:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [ModelCheckpoint(dirpath=str(run_dir / LIGHTNING_DIR), save_top_k=0, save_last=True,
                            every_n_epochs=1, enable_version_counter=False), RandomState()]


def plan_pair_run(out, resume, given: dict) -> tuple[Path | None, Path | None, dict]:
    """``(run directory or None, checkpoint to resume or None, settings)``: a new run's settings are ``given``
    over the lesson's (``PAIR_TRAIN``, its pairs and preset); a resume's are its ``run.json``'s, with a larger
    ``max_epochs`` if given, another of :data:`PAIR_FIXED` refused naming it."""
    resumed = resolve_resume(resume, Path(out) if out is not None else None)
    if resumed is None:
        base = {"preset": "statquest", "pairs": [list(p) for p in LESSON_PAIRS], **PAIR_TRAIN}
        return (None if out is None else Path(out)), None, {k: base[k] if v is None else v for k, v in given.items()}
    run_dir, ckpt_path = resumed
    try:
        info = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    check_run_kind(run_dir, info, "pairs")
    if info.get("task") != "pairs":
        raise ValueError(f"cannot resume {run_dir} as the lesson's pair training: its {RUN_FILE} is not one")
    changed = {k: (info[k], given[k]) for k in PAIR_FIXED if given[k] is not None and given[k] != info[k]}
    if changed:
        raise ValueError(f"cannot resume {run_dir} with {', '.join(f'{k}={new!r}' for k, (_, new) in changed.items())}"
                         f": the run was trained with {', '.join(f'{k}={old!r}' for k, (old, _) in changed.items())}"
                         f"; resume with the run's own, or start a new run")
    done = int(torch.load(ckpt_path, map_location="cpu", weights_only=False)["epoch"])  # saved at an epoch end
    epochs = info["max_epochs"] if given["max_epochs"] is None else given["max_epochs"]
    if epochs <= done:
        raise ValueError(f"{run_dir} has trained {done} epochs already; to continue it, give more epochs "
                         f"(--epochs {2 * done})")
    return run_dir, ckpt_path, {**{k: info[k] for k in PAIR_FIXED}, "max_epochs": epochs}
