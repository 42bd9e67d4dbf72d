"""The device inference runs on, from the name a user types: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``
(``decoderlab.config.names.DEVICES``).

``auto`` takes a CUDA GPU, else Apple silicon's MPS, else the CPU (the order of Lightning's
``accelerator="auto"``, which ``train`` and ``finetune`` use). A device this machine does not have is refused
in one line that names what it has (:func:`machine_devices`), before any weight is read.
"""

from __future__ import annotations

import os
import platform
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


#: CPU instructions that decide how fast each weight dtype decodes: fp32 FMA (avx2, avx512f), int8 dot products
#: (avx512_vnni, amx_int8), bfloat16 dot products (avx512_bf16, amx_bf16) and float16 arithmetic (avx512_fp16)
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: the name alone
        pass
    return name, flags


def cpu_features() -> list[str]:
    """The instructions of :data:`CPU_FEATURES` this CPU has (from ``/proc/cpuinfo``; [] where it cannot be
    read), in that order."""
    flags = _cpuinfo()[1]
    return [f for f in CPU_FEATURES if f in flags]


def cpu_summary() -> str:
    """One line naming the CPU: its model, CPU count, the instructions of :data:`CPU_FEATURES` it has and lacks,
    and the kernels torch picked (``torch.backends.cpu.get_cpu_capability()``), e.g. ``AMD EPYC, 2 CPUs: avx2
    fma avx512f avx512_vnni avx512_bf16 (no avx512_fp16, amx_tile, amx_bf16, amx_int8); torch kernels AVX512``."""
    name, flags = _cpuinfo()
    have = [f for f in CPU_FEATURES if f in flags]
    lacks = [f for f in CPU_FEATURES if f not in flags]
    kernels = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    feats = (" ".join(have) + (f" (no {', '.join(lacks)})" if lacks else "")) if flags else "instructions unknown"
    return f"{name}, {os.cpu_count()} CPUs: {feats}; torch kernels {kernels}"


def machine_line(threads: int) -> str:
    """The line a benchmark table is headed with: :func:`cpu_summary`, torch's version, the intra-op threads
    used and the 1-, 5- and 15-minute load averages (a loaded machine's absolute times are slow: read ratios)."""
    try:
        load = "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        load = "load unknown"
    return f"machine: {cpu_summary()}; torch {torch.__version__}, {threads} intra-op thread(s); {load}"
