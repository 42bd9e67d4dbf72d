"""The lesson's training: a model on prompt/response pairs, ``L.Trainer(max_epochs=30)``, Adam(lr=0.1); the
checkpoint stores the lesson's pair scheme as its chat template, so it answers through the one chat path."""

from __future__ import annotations

import os
from typing import Sequence

import lightning as L

from ..checkpoint import CHAT_TEMPLATE_KEY, save_checkpoint
from ..config.defaults import PAIR_TRAIN
from ..lesson import LESSON_PAIRS, LESSON_TEMPLATE, pair_dataloader, tokenizer_for_pairs
from ..model import DecoderOnlyTransformer, preset
from ..config.train import check_train_seed
from .module import LitModel
from .run import check_new_run_dir, fit_run


def train_pairs(
    pairs: Sequence[tuple[str, str]] = LESSON_PAIRS,
    out: str | os.PathLike | None = None,
    *,
    preset_name: str = "statquest",
    max_epochs: int = PAIR_TRAIN["max_epochs"],
    seed: int = PAIR_TRAIN["seed"],
    lr: float = PAIR_TRAIN["lr"],
    batch_size: int = PAIR_TRAIN["batch_size"],
    progress_bar: bool = False,
):
    """Train a model on prompt/response pairs exactly as the lesson does and return ``(model, tokenizer)``.

    ``L.seed_everything(seed)``, a ``WordTokenizer`` over the pairs' words (the lesson's 5 tokens for its
    pairs), ``DecoderOnlyTransformer`` of the preset with ``num_tokens`` = vocabulary size, Adam(lr), and
    ``L.Trainer(max_epochs)`` over a ``DataLoader`` of the pairs (batch size 1, no shuffling). If ``out`` is
    given (a new directory: one that holds files is refused before training), a checkpoint directory is
    written there; its ``meta.json`` stores the lesson's template (``"chat_template"``: ``prompt <EOS>
    response <EOS>``, :data:`decoderlab.lesson.LESSON_TEMPLATE`), with which chat, generate and the server
    answer its prompts.

    Raises:
        ValueError: bad pairs, max_epochs < 1, lr <= 0, batch_size < 1, seed outside 0 .. 2**32-1.
        FileExistsError: ``out`` holds files.
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
        check_new_run_dir(out)  # before training, so a bad --out loses no work
    L.seed_everything(seed, verbose=False)
    model = DecoderOnlyTransformer(preset(preset_name, num_tokens=tokenizer.vocab_size), lr=lr)
    longest = max(len(p.split()) + len(r.split()) + 1 for p, r in pairs)
    if longest > model.config.max_len:
        raise ValueError(f"a pair has {longest} tokens, more than the model's max_len={model.config.max_len}")
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=progress_bar, enable_model_summary=False, deterministic=True)
    fit_run(trainer, LitModel(model), None, train_dataloaders=pair_dataloader(pairs, tokenizer, batch_size=batch_size))
    model.eval()
    if out is not None:
        save_checkpoint(out, model, tokenizer, meta={"task": "chat", CHAT_TEMPLATE_KEY: dict(LESSON_TEMPLATE)})
    return model, tokenizer
