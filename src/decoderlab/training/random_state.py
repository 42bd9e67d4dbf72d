"""The random state of a run, saved with its training checkpoint and put back on a resume, so that a resumed
run with dropout (``--dropout``, ``--lora-dropout``) draws the same masks as the uninterrupted run.

Lightning's checkpoint keeps the model, the optimizer, the loops and the callbacks' own states, not the
generators dropout draws from (``torch.nn.functional.dropout`` uses torch's default generator on the CPU, and
the device's default generator on CUDA or MPS). :class:`RandomState` is a callback whose state is these
generators -- torch's CPU generator, every CUDA device's (or MPS's) when that backend is in use, Python's
``random`` and NumPy's global state -- of every process (DDP, FSDP: each rank draws its own masks), gathered
to the checkpoint that global rank 0 writes. On a resume, each process puts its own back at the start of the
first step (after the data loaders have been built and their first batch fetched, which is where the
uninterrupted run stood when it saved). The order of the data is the samplers' own state (their seeds and
positions), as before.
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch


def collect_states() -> dict:
    """This process's generator states: ``torch`` (CPU), ``cuda`` (one per device, when CUDA is initialised),
    ``mps`` (when available), ``python`` and ``numpy``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # plain lists and numbers, so that a checkpoint read with torch.load(weights_only=True) -- as FSDP's resume
    # reads it -- takes them (a NumPy array is refused there)
    numpy_state = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def restore_states(states: dict) -> None:
    """Put back what :func:`collect_states` returned (a backend absent now is skipped)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["mps"])


def _gathered(trainer) -> list[dict]:
    """Every process's states, in rank order (one process: a list of one)."""
    mine = collect_states()
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    return out


class RandomState(L.Callback):
    """Saves every process's random state with the training checkpoint and restores it on a resume (see the
    module docstring). Part of every run's trainer (:func:`decoderlab.training.trainer.make_trainer`)."""

    def __init__(self):
        self._trainer = None
        self._pending: list[dict] | None = None

    def setup(self, trainer, pl_module, stage):
        self._trainer = trainer

    def state_dict(self) -> dict:
        # called on every process while the checkpoint is assembled (global rank 0 writes it)
        return {"ranks": _gathered(self._trainer) if self._trainer is not None else [collect_states()]}

    def load_state_dict(self, state: dict) -> None:
        self._pending = state.get("ranks")

    def restore(self, world_size: int, rank: int) -> None:
        """Put this process's saved state back; a checkpoint of another number of processes draws anew (its
        masks cannot be those of this run's processes)."""
        pending, self._pending = self._pending, None
        if pending and len(pending) == world_size:
            restore_states(pending[rank])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._pending is not None:
            self.restore(trainer.world_size, trainer.global_rank)
