"""A counter of host-device synchronisations: the calls that make the host wait for the device's queued work.

On a GPU each of these stalls the host until the kernels queued before it have run; on the CPU they cost
nothing, which is why they have to be counted rather than timed (a CPU test that counts them catches what
a GPU would hit). Counted:

- at the Python level (``TorchFunctionMode``): ``Tensor.item``, ``Tensor.tolist``, ``bool``/``int``/``float``/
  ``index`` of a tensor (``__bool__``, ``__int__``, ``__float__``, ``__index__``), and ``Tensor.cpu``/``numpy``
  of a tensor that is not on the CPU;
- at the op level (``TorchDispatchMode``): ``aten._local_scalar_dense`` not already counted above (C++ code
  reading a scalar), ``aten.nonzero``, ``aten.masked_select``, ``aten.is_nonzero``, ``aten.equal``, and
  boolean-mask indexing (``aten.index``/``index_put`` with a bool index: its output size depends on the data).

Each event keeps the innermost ``decoderlab`` frame that issued it (else the innermost frame outside
PyTorch), so a failing budget names the line to fix. :class:`StepSyncs` is a Lightning callback that tags
the events with the training step they happen in (validation apart).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .frames import Frame, caller_frames, first_frame

aten = torch.ops.aten

_PY_SCALAR = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "__bool__",
              torch.Tensor.__int__: "__int__", torch.Tensor.__float__: "__float__",
              torch.Tensor.__index__: "__index__"}
_PY_COPY = {torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
_OPS = {aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
        aten.is_nonzero.default: "is_nonzero", aten.equal.default: "equal"}
_INDEX = {aten.index.Tensor: "boolean indexing", aten.index_put.default: "boolean index_put",
          aten.index_put_.default: "boolean index_put"}


@dataclass(frozen=True)
class SyncEvent:
    """One sync: its ``kind``, the innermost frame outside PyTorch (``where``: Lightning's or ours), the
    innermost ``decoderlab`` frame (``origin``) and the tag in force."""

    kind: str
    where: Frame | None
    origin: Frame | None
    tag: object = None

    def __str__(self) -> str:
        via = "" if self.origin == self.where or self.origin is None else f" (from {self.origin})"
        return f"{self.kind} at {self.where}{via}"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _PY_SCALAR.get(func)
        if kind is None and func in _PY_COPY and args and getattr(args[0], "device", None) is not None \
                and args[0].device.type != "cpu":
            kind = _PY_COPY[func]
        if kind is None:
            return func(*args, **(kwargs or {}))
        self.counter.record(kind)
        self.counter.inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.inside -= 1


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = None
        if func is aten._local_scalar_dense.default:
            kind = None if self.counter.inside else "_local_scalar_dense"
        elif func in _OPS:
            kind = _OPS[func]
        elif func in _INDEX and _bool_index(args[1] if len(args) > 1 else None):
            kind = _INDEX[func]
        if kind is not None:
            self.counter.record(kind)
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """Context manager counting host syncs in its block; see the module docstring.

    ``events`` lists them in order (each a :class:`SyncEvent`); ``len(counter)`` is their number; ``tag``
    (set while counting) labels the events recorded after it; ``by_tag()`` counts per tag.
    """

    def __init__(self):
        self.events: list[SyncEvent] = []
        self.tag = None
        self.inside = 0
        self._modes = (_FunctionLevel(self), _DispatchLevel(self))

    def record(self, kind: str) -> None:
        frames = caller_frames(3)
        self.events.append(SyncEvent(kind, frames[0] if frames else None, first_frame(frames), self.tag))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False

    def __len__(self) -> int:
        return len(self.events)

    def by_tag(self) -> Counter:
        return Counter(e.tag for e in self.events)

    def tagged(self, tag) -> list[SyncEvent]:
        return [e for e in self.events if e.tag == tag]

    def report(self, tag=None) -> str:
        events = self.events if tag is None else self.tagged(tag)
        return "\n".join(f"  {n} x {where}" for where, n in Counter(str(e) for e in events).most_common())


def step_syncs_callback(counter: HostSyncCounter):
    """A Lightning callback tagging ``counter``'s events with the optimizer step they belong to: events from
    one ``on_train_batch_start`` to the next get that step's number (``trainer.global_step`` + 1, 1-based,
    the step being computed); events inside a validation get ``("val", step)``."""
    import lightning as L

    class StepSyncs(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            counter.tag = trainer.global_step + 1

        def on_validation_start(self, trainer, *args):
            counter.tag = ("val", trainer.global_step)

        def on_validation_end(self, trainer, *args):
            counter.tag = trainer.global_step

    return StepSyncs()
