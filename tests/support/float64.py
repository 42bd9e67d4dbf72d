"""A guard against float64 work on the model's device.

Apple's MPS has no float64 and a consumer GPU runs it at a fraction of float32's speed, so decoderlab keeps
float64 to the host: exact sums are made on CPU copies by a few named functions. On a CPU-only test every
tensor is on the CPU, so the guard cannot tell a device tensor from a host copy by its device; it tells them
by who made the op instead. :class:`Float64Guard` (a ``TorchDispatchMode``) records every op that reads or
makes a float64 tensor with the Python frames that issued it, and counts as allowed only those issued from
inside one of the ``allowed`` functions (``module.qualname``, e.g.
``"decoderlab.training.sums.host_sums"``). ``violations`` lists the rest, each naming the innermost
``decoderlab`` frame (else the innermost frame outside PyTorch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .frames import Frame, caller_frames, first_frame


@dataclass(frozen=True)
class Float64Op:
    op: str
    where: Frame | None
    origin: Frame | None
    allowed_by: str | None

    def __str__(self) -> str:
        via = "" if self.origin == self.where or self.origin is None else f" (from {self.origin})"
        return f"{self.op} at {self.where}{via}"


def _float64(values) -> bool:
    leaves, _ = tree_flatten(values)
    return any((isinstance(v, torch.Tensor) and v.dtype == torch.float64) or v is torch.float64 for v in leaves)


class Float64Guard(TorchDispatchMode):
    """Records the float64 ops of its block; see the module docstring.

    Args:
        allowed: names (``module.qualname``) of the functions that may use float64 (on CPU copies).
    """

    def __init__(self, allowed=()):
        super().__init__()
        self.allowed = frozenset(allowed)
        self.ops: list[Float64Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _float64((args, kwargs or {})) or _float64(out):
            frames = caller_frames(2)
            allowed_by = next((f.name for f in frames if f.name in self.allowed), None)
            self.ops.append(Float64Op(str(func.overloadpacket.__name__), frames[0] if frames else None,
                                      first_frame(frames), allowed_by))
        return out

    @property
    def violations(self) -> list[Float64Op]:
        return [op for op in self.ops if op.allowed_by is None]

    def report(self) -> str:
        return "\n".join(f"  {n} x {where}" for where, n in Counter(str(v) for v in self.violations).most_common())
