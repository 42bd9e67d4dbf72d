"""The training precision for the machine at hand: ``precision="auto"`` resolved against the accelerator.

``auto`` (``TrainConfig``'s default) picks:

- on a CUDA GPU with bfloat16 (compute capability 8.0 or newer: A100, H100, RTX 30xx/40xx, ...):
  ``bf16-mixed`` (bfloat16 autocast, float32 weights and optimizer state);
- on an older CUDA GPU (T4, V100, ...): ``16-mixed`` (float16 autocast with a gradient scaler; Muon and AdamW
  alike: the scaler unscales the gradients of the one ``MuonAdamW`` before it steps) -- except under
  ``--strategy fsdp``, whose FSDP2 takes 32 or bf16-mixed only, where it stays ``32``;
- on the CPU and Apple MPS: ``32`` (bf16-mixed measured no faster on a CPU at the baby size; MPS autocast is
  opt-in) -- ``--precision bf16-mixed`` asks for it.

On CUDA, float32 matrix products run at ``torch.set_float32_matmul_precision("high")`` (TF32 on Ampere and
newer). Each choice is printed once per process on the first process, when it is made on an accelerator.
Sources: PyTorch AMP docs (``torch.autocast``, ``torch.amp.GradScaler``); Lightning's precision docs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..config.names import PRECISIONS

#: the first CUDA compute capability with bfloat16 tensor cores (Ampere)
BF16_CAPABILITY = (8, 0)
_announced: set[str] = set()


@dataclass(frozen=True)
class Machine:
    """The accelerator a run trains on, as the precision choice needs it.

    Attributes:
        accelerator: "cuda", "mps" or "cpu".
        name: the device's name ("NVIDIA A100-SXM4-80GB", "Apple MPS", "cpu").
        bf16: whether it computes in bfloat16 natively (CUDA compute capability >= 8.0).
    """

    accelerator: str
    name: str = ""
    bf16: bool = False


def detect_machine(accelerator: str = "auto") -> Machine:
    """The :class:`Machine` Lightning's ``accelerator`` means here: "auto" prefers CUDA, then MPS, then the
    CPU (as Lightning's ``accelerator="auto"``); "gpu" is CUDA or MPS; "cuda", "mps", "cpu" are themselves.
    The properties of a CUDA machine are those of its first device (``torch.cuda.get_device_capability``)."""
    kind = str(accelerator)
    if kind in ("auto", "gpu"):
        if torch.cuda.is_available():
            kind = "cuda"
        elif torch.backends.mps.is_available():
            kind = "mps"
        else:
            kind = "cpu"
    if kind == "cuda" and torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(0))
        return Machine("cuda", torch.cuda.get_device_name(0), capability >= BF16_CAPABILITY)
    if kind == "mps":
        return Machine("mps", "Apple MPS", False)
    return Machine(kind if kind == "cuda" else "cpu", kind, False)


def resolve_precision(requested: str, machine: Machine, *, strategy: str = "auto") -> tuple[str, str]:
    """``(precision, why)``: the precision a run asking for ``requested`` trains at on ``machine`` under
    ``strategy`` (see the module docstring), and the reason in words.

    Raises:
        ValueError: an unknown name (naming the allowed ones); ``16-mixed`` on the CPU (float16 autocast
            needs a GPU; naming the alternatives); ``16-mixed`` under ``--strategy fsdp``.
    """
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    fsdp = strategy == "fsdp"
    if requested == "16-mixed" and machine.accelerator == "cpu":
        raise ValueError("--precision 16-mixed (float16 autocast with a gradient scaler) needs a GPU; on the CPU "
                         "use --precision 32 (the default there, auto) or bf16-mixed")
    if requested == "16-mixed" and fsdp:
        raise ValueError("--precision 16-mixed cannot run under --strategy fsdp (FSDP2 takes 32 or bf16-mixed): "
                         "use --precision bf16-mixed or 32, or --strategy ddp")
    if requested != "auto":
        return requested, "asked for"
    if machine.accelerator != "cuda":
        return "32", f"on {machine.accelerator}; --precision bf16-mixed asks for bfloat16 autocast"
    if machine.bf16:
        return "bf16-mixed", f"{machine.name} computes in bfloat16"
    if fsdp:
        return "32", f"{machine.name} has no bfloat16 and FSDP2 takes no float16 autocast"
    return "16-mixed", f"{machine.name} has no bfloat16: float16 autocast with a gradient scaler"


def _first_process() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def _announce(line: str) -> None:
    """Print ``decoderlab: LINE`` on stderr once per process, on the first process only."""
    if line not in _announced and _first_process():
        _announced.add(line)
        print(f"decoderlab: {line}", file=sys.stderr, flush=True)


def choose_precision(requested: str, accelerator: str = "auto", *, strategy: str = "auto",
                     machine: Machine | None = None) -> str:
    """The precision to train at (:func:`resolve_precision` on ``machine``, by default the one
    ``accelerator`` means, :func:`detect_machine`); on CUDA also sets the float32 matmul precision to "high".
    Each choice made on an accelerator is printed once (see the module docstring).

    Raises:
        ValueError: as :func:`resolve_precision`.
    """
    machine = detect_machine(accelerator) if machine is None else machine
    precision, why = resolve_precision(requested, machine, strategy=strategy)
    if machine.accelerator != "cpu":
        _announce(f"precision {precision} ({'--precision ' + requested if requested != 'auto' else 'auto'}: {why})")
    if machine.accelerator == "cuda":
        torch.set_float32_matmul_precision("high")
        _announce("float32 matrix products at precision 'high' (TF32 where the GPU has it)")
    return precision


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name (decoderlab's or Lightning's): bfloat16 for "bf16-mixed",
    float16 for "16-mixed", None (no autocast) for "32"/"32-true"."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
