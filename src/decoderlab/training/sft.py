"""Masked supervised fine-tuning (SFT) in Lightning: the label shift, step-exact batches, and the loss.

The training half of :func:`decoderlab.finetuning.finetune` (which renders conversations with a chat template
and calls these with the resulting ``(ids, mask)`` rows):

1. :func:`shift_for_training` -- the only place where the label shift happens: inputs = ids[:-1], labels =
   ids[1:] where the mask of ids[1:] is True, else -100 (so only assistant tokens and the end of turn after
   them are targets), after truncating to max_len + 1 tokens;
2. :class:`SFTBatches` -- optimizer step s uses a fixed set of ``batch_size * accumulate * world_size`` rows
   (seeded shuffles, epoch after epoch); every micro-batch carries the number of supervised tokens of its
   whole step (all micro-batches, all processes), padded with a pad id that is never the end of turn
   (labels -100 there);
3. :class:`SFTModule.training_step` -- ``sum of per-token cross-entropy / supervised tokens of the step``, so
   the loss (and gradient) of an optimizer step is the mean over every supervised token of the step, not a
   mean of per-batch means (scaled by accumulate * world_size only to undo Lightning's division by
   accumulate and DDP's gradient averaging).

Sources: the masked-loss SFT recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer``
(prompt tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face
transformers' gradient-accumulation fix (2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..data import CountingSampler
from .config import TrainConfig
from .module import LitModel
from .sums import host_column_sums, sum_over_ranks

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------------
# Examples: render, shift (once), truncate, drop
# ---------------------------------------------------------------------------------------------------------


def shift_for_training(ids: Sequence[int], mask: Sequence[bool], max_len: int) -> tuple[list[int], list[int]]:
    """``(inputs, labels)`` of one rendered conversation: the one place where labels are shifted.

    The first ``max_len + 1`` tokens are kept; ``inputs = ids[:-1]`` and ``labels[t] = ids[t + 1]`` where
    ``mask[t + 1]`` is True, else -100. Both lists have length ``min(len(ids), max_len + 1) - 1``.
    """
    ids, mask = list(ids[: max_len + 1]), list(mask[: max_len + 1])
    return ids[:-1], [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]


@dataclass
class Examples:
    """Training rows of a set of conversations. ``rows``: [(inputs, labels)]; ``truncated``: conversations
    longer than max_len + 1 tokens (cut); ``dropped``: conversations with no supervised token left after
    the cut (not in ``rows``); ``bytes``: UTF-8 bytes of the assistant text the supervised targets stand for
    (end-of-turn tokens count 0)."""

    rows: list[tuple[list[int], list[int]]]
    conversations: list[int]
    truncated: int
    dropped: int
    bytes: int

    @property
    def supervised(self) -> int:
        return sum(sum(1 for t in y if t != IGNORE_INDEX) for _, y in self.rows)


def collate(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows to the longest: inputs with ``pad_id``, labels with -100. Returns two (B, T) int64.
    (Right padding needs no attention mask: causal attention never lets a real token see a later pad.)"""
    t = max(len(x) for x, _ in rows)
    xs = torch.full((len(rows), t), pad_id, dtype=torch.long)
    ys = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        xs[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        ys[i, : len(y)] = torch.tensor(y, dtype=torch.long)
    return xs, ys


class SFTBatches(torch.utils.data.Dataset):
    """Micro-batch number k -> ``(inputs, labels, step_supervised)`` for one process.

    Optimizer step ``s = k // accumulate`` takes ``G = batch_size * accumulate * world_size`` consecutive rows
    of an endless stream of seeded permutations of the rows (one per epoch); micro-batch ``m = k %
    accumulate`` of rank r takes rows ``[(m * world_size + r) * batch_size, ... + batch_size)`` of them.
    ``step_supervised`` (a 0-d int64 tensor) counts the supervised labels of all G rows, so each process
    knows the normaliser of the whole step without communicating. 1 process x accumulate 4 x batch 2, 1 x 1 x
    8 and 2 processes x 1 x 4 therefore see the same rows in the same step.
    """

    def __init__(self, rows, batch_size: int, accumulate: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True):
        self.rows, self.b, self.acc, self.seed = rows, int(batch_size), int(accumulate), int(seed)
        self.pad_id, self.rank, self.world, self.shuffle = int(pad_id), int(rank), int(world_size), shuffle
        self.counts = np.array([sum(1 for t in y if t != IGNORE_INDEX) for _, y in rows], dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = len(self.rows)
            self._perms = {epoch: (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                   else np.arange(n))}
        return self._perms[epoch]

    def step_rows(self, step: int) -> np.ndarray:
        """Row indices of optimizer step ``step`` (all micro-batches, all processes)."""
        g = self.b * self.acc * self.world
        n = len(self.rows)
        pos = np.arange(step * g, (step + 1) * g)
        return np.array([self._perm(int(p // n))[p % n] for p in pos], dtype=np.int64)

    def __getitem__(self, k: int):
        step, m = divmod(int(k), self.acc)
        rows = self.step_rows(step)
        start = (m * self.world + self.rank) * self.b
        mine = rows[start : start + self.b]
        x, y = collate([self.rows[i] for i in mine], self.pad_id)
        return x, y, torch.tensor(int(self.counts[rows].sum()), dtype=torch.long)

    def __len__(self) -> int:
        return 2**62


class SFTDataModule(L.LightningDataModule):
    """Training micro-batches (:class:`SFTBatches`) and validation batches (held-out rows, shared out across
    processes). The number of micro-batches served is saved in Lightning checkpoints, so a resumed run
    continues with the batches the uninterrupted run would have seen."""

    def __init__(self, train: Examples, val: Examples | None, *, batch_size: int, accumulate: int, seed: int,
                 pad_id: int, val_batch_size: int = 64):
        super().__init__()
        self.train, self.val = train, val
        self.batch_size, self.accumulate, self.seed, self.pad_id = batch_size, accumulate, seed, pad_id
        self.val_batch_size = val_batch_size
        self.batches_served = 0

    def _rank_world(self):
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def train_dataloader(self):
        rank, world = self._rank_world()
        ds = SFTBatches(self.train.rows, self.batch_size, self.accumulate, self.seed, self.pad_id, rank, world)
        return DataLoader(ds, batch_size=None, sampler=CountingSampler(self.batches_served))

    def val_dataloader(self):
        rank, world = self._rank_world()
        rows = self.val.rows if self.val is not None and self.val.rows else self.train.rows
        mine = rows[rank::world]
        batches = [collate(mine[i : i + self.val_batch_size], self.pad_id)
                   for i in range(0, len(mine), self.val_batch_size)]
        return DataLoader(batches, batch_size=None, shuffle=False)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self.batches_served += 1
        return batch

    def state_dict(self):
        return {"batches_served": self.batches_served, "seed": self.seed}

    def load_state_dict(self, state):
        self.batches_served = int(state["batches_served"])
        self.seed = int(state["seed"])


# ---------------------------------------------------------------------------------------------------------
# The Lightning module
# ---------------------------------------------------------------------------------------------------------


def masked_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token cross-entropy in nats, number of supervised tokens)`` over the labels != -100.
    logits: (B, T, V); labels: (B, T), already shifted (:func:`shift_for_training`). Float32 sum."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (labels != IGNORE_INDEX).sum()


class SFTModule(LitModel):
    """:class:`~decoderlab.training.LitModel` for supervised fine-tuning: the model is ``self.model`` (no copy),
    the optimizer AdamW + warm-up/cosine from ``cfg`` (``LitModel.configure_optimizers``); the steps below
    replace the language-model loss with the masked, step-normalised one.

    ``training_step`` returns ``sum_ce * accumulate * world_size / max(step_supervised, 1)``: after Lightning's
    division by ``accumulate`` and DDP's averaging over processes, the gradient of an optimizer step is that of
    ``(sum of CE over all supervised tokens of the step) / (their count)``. ``losses`` records that exact
    step loss (summed over micro-batches and processes) for every optimizer step; validation logs the exact
    mean ``val_loss`` over all held-out supervised tokens.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig):
        super().__init__(model, cfg)
        self.losses: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        self._step_ce: list[torch.Tensor] = []  # the micro-batch sums of this step, on the device
        self._val: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y, step_count = batch
        ce, _ = masked_ce_sum(self.model(x, check_ids=False), y)  # (the ids come from the tokenizer)
        # a step whose every target is masked has a loss of 0 (and no gradient), not 0 / 0
        n = step_count.clamp(min=1).to(ce.dtype)
        self._step_ce.append(ce.detach())
        acc, world = self.trainer.accumulate_grad_batches, self.trainer.world_size
        if (batch_idx + 1) % acc == 0:
            # the exact step loss, summed in float64 on the host (over micro-batches, then processes)
            (total,) = sum_over_ranks(self.trainer.strategy, host_column_sums([[c] for c in self._step_ce]))
            step_loss = total / max(int(step_count), 1)
            self.losses.append(step_loss)
            self._step_ce = []
            self.log("train_loss", step_loss, prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True,
                     batch_size=x.size(0))
        return ce * (acc * world) / n

    def on_validation_epoch_start(self):
        self._val = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        ce, n = masked_ce_sum(self.model(x, check_ids=False), y)
        self._val.append([ce.detach(), n])

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        nats, count = sum_over_ranks(self.trainer.strategy, (host_column_sums(self._val) + [0.0, 0.0])[:2])
        loss = nats / count if count else float("nan")
        self.log("val_loss", loss, prog_bar=True, sync_dist=False)
        self.val_history.append((self.trainer.global_step, loss))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["sft_losses"] = list(self.losses)
        checkpoint["sft_val_history"] = [list(h) for h in self.val_history]

    def on_load_checkpoint(self, checkpoint):
        self.losses = list(checkpoint.get("sft_losses", []))
        self.val_history = [(int(s), float(v)) for s, v in checkpoint.get("sft_val_history", [])]
