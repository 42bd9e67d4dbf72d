"""The lesson's training: a model on prompt/response pairs, ``L.Trainer(max_epochs=30)``, Adam(lr=0.1)."""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import lightning as L

from ..checkpoint import check_output_dir, save_checkpoint
from ..lesson import LESSON_PAIRS, pair_dataloader, tokenizer_for_pairs
from ..model import DecoderOnlyTransformer, preset
from .config import check_train_seed
from .module import LitModel
from .trainer import fit


def train_pairs(
    pairs: Sequence[tuple[str, str]] = LESSON_PAIRS,
    out: str | os.PathLike | None = None,
    *,
    preset_name: str = "statquest",
    max_epochs: int = 30,
    seed: int = 42,
    lr: float = 0.1,
    batch_size: int = 1,
    progress_bar: bool = False,
):
    """Train a model on prompt/response pairs exactly as the lesson does and return ``(model, tokenizer)``.

    ``L.seed_everything(seed)``, a ``WordTokenizer`` over the pairs' words (the lesson's 5 tokens for its
    pairs), ``DecoderOnlyTransformer`` of the preset with ``num_tokens`` = vocabulary size, Adam(lr), and
    ``L.Trainer(max_epochs)`` over a ``DataLoader`` of the pairs (batch size 1, no shuffling). If ``out`` is
    given, a checkpoint directory is written there (``meta.json`` records ``"task": "pairs"``).

    Raises:
        ValueError: bad pairs, max_epochs < 1, lr <= 0, batch_size < 1, seed outside 0 .. 2**32-1.
    """
    check_train_seed(seed)
    if max_epochs < 1:
        raise ValueError(f"max_epochs must be >= 1, got {max_epochs}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokenizer = tokenizer_for_pairs(pairs)
    if out is not None:
        check_output_dir(out, new_run=True)  # before training, so a bad --out loses no work
    L.seed_everything(seed, verbose=False)
    model = DecoderOnlyTransformer(preset(preset_name, num_tokens=tokenizer.vocab_size), lr=lr)
    longest = max(len(p.split()) + len(r.split()) + 1 for p, r in pairs)
    if longest > model.config.max_len:
        raise ValueError(f"a pair has {longest} tokens, more than the model's max_len={model.config.max_len}")
    loader = pair_dataloader(pairs, tokenizer, batch_size=batch_size)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(no `val_dataloader`|does not have many workers|LeafSpec).*")
        fit(trainer, LitModel(model), train_dataloaders=loader)
    model.eval()
    if out is not None:
        save_checkpoint(out, model, tokenizer, meta={"task": "pairs"})
    return model, tokenizer
