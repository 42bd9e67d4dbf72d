"""The device inference runs on, from the name a user types: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``
(``decoderlab.config.names.DEVICES``).

``auto`` takes a CUDA GPU, else Apple silicon's MPS, else the CPU (the order of Lightning's
``accelerator="auto"``, which ``train`` and ``finetune`` use). A device this machine does not have is refused
in one line that names what it has (:func:`machine_devices`), before any weight is read.
"""

from __future__ import annotations

import re

import torch

from .config.names import DEVICES


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def machine_devices() -> list[str]:
    """The devices this machine has, as ``--device`` names them: ``cpu``, ``cuda:0`` .. ``cuda:N-1``, ``mps``."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        found.append("mps")
    return found


def _has() -> str:
    return "this machine has: " + ", ".join(machine_devices())


def _cuda(name: str, index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError(f"device {name}: no CUDA GPU here (torch.cuda.is_available() is False); "
                         f"{_has()}")
    count = torch.cuda.device_count()
    if index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if index >= count:
        raise ValueError(f"device {name}: there is no CUDA GPU {index}, only {count} "
                         f"(cuda:0{'' if count == 1 else f' .. cuda:{count - 1}'}); {_has()}")
    return torch.device("cuda", index)


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The ``torch.device`` for ``name`` (None = ``auto``): ``auto`` -> ``cuda`` if there is a CUDA GPU, else
    ``mps`` if there is Apple MPS, else ``cpu``; ``cuda`` -> the current CUDA GPU (``cuda:0`` unless changed);
    ``cuda:N`` -> GPU N; a ``torch.device`` is checked the same way.

    Raises:
        ValueError: an unknown name (the allowed ones listed), or a device this machine does not have (a CUDA
            GPU, GPU number N, Apple MPS), each naming the devices it has.
    """
    text = "auto" if name is None else str(name).strip()
    if text == "auto":
        if torch.cuda.is_available():
            return _cuda("auto", None)
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if text in ("cpu", "cpu:0"):
        return torch.device("cpu")
    if text in ("mps", "mps:0"):
        if not _mps_available():
            raise ValueError(f"device {text}: Apple MPS is on Apple silicon Macs only (macOS 12.3 or later, a "
                             f"PyTorch built with MPS); {_has()}")
        return torch.device("mps")
    cuda = re.fullmatch(r"cuda(?::(\d+))?", text)
    if cuda:
        return _cuda(text, None if cuda.group(1) is None else int(cuda.group(1)))
    raise ValueError(f"device {text}: not a device decoderlab knows; allowed: {', '.join(DEVICES)} ({_has()})")
