"""The ``LightningDataModule`` over a corpus's train and validation token splits."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from ..data import CountingSampler, RandomWindowBatches, SequentialWindows, TokenSource, check_split_lengths


class TokenDataModule(L.LightningDataModule):
    """A ``LightningDataModule`` over the train and validation token splits of a corpus.

    Training batches are random windows of ``max_len + 1`` tokens (``RandomWindowBatches``): inputs and
    targets shifted by one, each (batch_size, max_len) int64. Batch number k is a pure function of
    (seed, k), and the number of batches served is the DataModule's state (``state_dict`` / Lightning
    checkpoint), so ``--resume`` continues with exactly the batches the uninterrupted run would have seen.
    Under DDP each rank serves ``batch_size`` rows of a global batch of ``batch_size * world_size`` rows: rank
    r takes its slice, so 2 processes with batch B/2 see the rows of one process with batch B.

    Validation: all non-overlapping windows of the validation split (``SequentialWindows``) in batches of
    ``val_batch_size``, at most ``val_batches`` batches (None: all), shared out across ranks.

    The token arrays may be NumPy memmaps (``corpus_tokens``): they stay memory-mapped, and DataLoader
    workers each re-open the file once.

    Raises:
        ValueError: a split shorter than max_len + 1 tokens (naming the lengths); batch_size < 1.
    """

    def __init__(self, train_tokens, val_tokens, *, max_len: int, batch_size: int, seed: int = 0,
                 val_batch_size: int = 64, val_batches: int | None = None, num_workers: int = 0):
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"val_batches must be None (all) or >= 1, got {val_batches!r}")
        self.train_source, self.val_source = TokenSource(train_tokens), TokenSource(val_tokens)
        check_split_lengths(len(self.train_source), len(self.val_source), max_len)
        self.max_len, self.batch_size, self.seed = int(max_len), int(batch_size), int(seed)
        self.val_batch_size, self.val_batches, self.num_workers = int(val_batch_size), val_batches, int(num_workers)
        #: number of training batches already consumed (the sampler's state)
        self.batches_served = 0

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self):
        rank, world = self._rank_world()
        ds = RandomWindowBatches(self.train_source, self.max_len, self.batch_size, self.seed, rank, world)
        return DataLoader(ds, batch_size=None, sampler=CountingSampler(self.batches_served),
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        rank, world = self._rank_world()
        ds = SequentialWindows(self.val_source, self.max_len, self.val_batch_size, self.val_batches, rank, world)
        return DataLoader(ds, batch_size=None, shuffle=False, num_workers=0)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self.batches_served += 1
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batches_served": self.batches_served, "batch_size": self.batch_size,
                "max_len": self.max_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("max_len", self.max_len) != self.max_len:
            raise ValueError(f"the checkpoint's data used max_len={state['max_len']}, this run uses {self.max_len}")
        self.seed = int(state["seed"])
        self.batches_served = int(state["batches_served"])
