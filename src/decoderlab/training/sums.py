"""Exact sums of losses and counts, made on the host: float64 only ever on CPU copies.

Validation and fine-tuning report exact means (nats summed over every target / the number of targets), so
their sums are float64. Apple's MPS has no float64 and a GPU runs it slowly, so the parts stay where they
were computed (float32 losses, int64 counts, on the model's device, without waiting for them) and are copied
to the CPU once, when the total is needed: :func:`host_column_sums`. Across processes,
:func:`sum_over_ranks` gathers each process's float64 totals bit for bit (as int64, the one dtype every
backend moves exactly) and adds them on the host in rank order, so every process gets the same total and
one process gets the total of one process.

These two are the only functions of training that touch float64 (the test-side float64 guard allows them by
name).
"""

from __future__ import annotations

from typing import Sequence

import torch


def host_column_sums(rows: Sequence[Sequence[torch.Tensor | int | float]]) -> list[float]:
    """Column sums of ``rows`` (equal-length rows of 0-d tensors, on any device, or Python numbers), in
    float64 on the CPU: each column is stacked where it lies and copied to the host once. An empty
    ``rows`` has no columns and gives []."""
    if not rows:
        return []
    sums = []
    for k in range(len(rows[0])):
        column = [r[k] if isinstance(r[k], torch.Tensor) else torch.tensor(r[k]) for r in rows]
        devices = {c.device for c in column}
        stacked = (torch.stack([c.detach().reshape(()) for c in column]) if len(devices) == 1
                   else torch.stack([c.detach().reshape(()).cpu() for c in column]))
        sums.append(float(stacked.cpu().double().sum()))
    return sums


def sum_over_ranks(strategy, values: Sequence[float]) -> list[float]:
    """``values`` (this process's float totals) summed over all processes of ``strategy`` (a Lightning
    strategy; one process: ``values`` unchanged). A collective: every process calls it, at the same point.
    The float64 values travel as their int64 bit patterns on the strategy's device (exact on gloo and NCCL)
    and are added on the CPU in rank order."""
    values = [float(v) for v in values]
    world = getattr(strategy, "world_size", 1)
    if world <= 1:
        return values
    bits = torch.tensor(values, dtype=torch.float64).view(torch.int64).to(strategy.root_device)
    gathered = strategy.all_gather(bits)  # (world, K) int64
    return gathered.cpu().view(torch.float64).sum(0).tolist()
