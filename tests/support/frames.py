"""Where an op came from: the Python frames above the PyTorch machinery that issued it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class Frame:
    """One Python frame: ``module`` (``__name__`` of its globals), ``function`` (qualified name), ``file``,
    ``line``."""

    module: str
    function: str
    file: str
    line: int

    @property
    def name(self) -> str:
        """``module.qualname`` (``decoderlab.training.callbacks.LMMetrics.on_validation_epoch_end``)."""
        return f"{self.module}.{self.function}"

    def __str__(self) -> str:
        return f"{self.name} ({os.path.basename(self.file)}:{self.line})"


def caller_frames(skip: int = 1) -> list[Frame]:
    """The frames of the current stack, innermost first, leaving out PyTorch's own and this package's."""
    frames = []
    f = sys._getframe(skip)
    while f is not None:
        file = f.f_code.co_filename
        if not file.startswith(_TORCH) and not file.startswith(_HERE):
            frames.append(Frame(f.f_globals.get("__name__", "?"), getattr(f.f_code, "co_qualname", f.f_code.co_name),
                                file, f.f_lineno))
        f = f.f_back
    return frames


def first_frame(frames: list[Frame], prefix: str = "decoderlab") -> Frame | None:
    """The innermost frame of a module under ``prefix`` (the library's line that asked), else the innermost."""
    for fr in frames:
        if fr.module == prefix or fr.module.startswith(prefix + "."):
            return fr
    return frames[0] if frames else None
