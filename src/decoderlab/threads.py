"""How many intra-op threads PyTorch should use, given the cores and how busy they are.

On a small shared machine, OpenMP threads that each need a whole core wait on one another when another
process holds a core: two threads under a load of ~2 on two cores ran a training step many times slower than
one thread. :func:`choose_threads` therefore counts the cores that the 1-minute load average leaves idle
(``os.getloadavg``) and uses that many, at least one and at most ``cap``.
"""

from __future__ import annotations

import math
import os

import torch

#: intra-op threads used at most when choosing automatically (more do not speed up the small models here)
DEFAULT_CAP = 2


def available_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity`` where it exists, else ``os.cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def choose_threads(requested: int | None = None, *, cores: int | None = None, load: float | None = None,
                   cap: int = DEFAULT_CAP) -> int:
    """The number of intra-op threads to use.

    ``requested`` (e.g. ``--threads``) wins when given. Otherwise ``min(cap, cores, idle)`` and at least 1,
    where idle = cores - load, rounded to the nearest whole core (so 2 cores at load 0.3 give 2 threads, at
    load 0.8 or more give 1). ``cores`` defaults to :func:`available_cores`, ``load`` to the 1-minute load
    average (0 where the platform has none).

    Raises:
        ValueError: ``requested`` not a positive integer, naming the value.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads must be a positive integer, got {requested!r}")
        return requested
    cores = available_cores() if cores is None else int(cores)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # pragma: no cover - not on Unix
            load = 0.0
    idle = math.floor(cores - load + 0.5)
    return max(1, min(cap, cores, idle))


def set_threads(requested: int | None = None) -> int:
    """``torch.set_num_threads(choose_threads(requested))``; returns the number set."""
    n = choose_threads(requested)
    torch.set_num_threads(n)
    return n
