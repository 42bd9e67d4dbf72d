"""The number checks every generation setting goes through: integers and reals of any kind (Python, NumPy,
0-d tensors) as Python numbers, and the sampling seed's range. Each raises naming the value and what is
allowed; :class:`decoderlab.generation.SamplingParams` and the logits processors build on them."""

from __future__ import annotations

import numbers

import torch


def as_scalar(value):
    """A 0-d tensor or NumPy 0-d array/scalar as the Python number it holds; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy scalars and 0-d arrays
        return value.item()
    return value


def is_integer(value) -> bool:
    """An integral number of any kind (int, NumPy integer, ...) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: the largest sampling seed: ``torch.Generator.manual_seed`` takes -2**63 .. 2**64-1 (a negative seed is the
#: same generator as seed + 2**64), decoderlab the non-negative int64 range, so that a chat's per-turn seed
#: (seed + turn) and a request's per-choice seed (seed + i) still fit torch's
MAX_SEED = 2**63 - 1


def check_seed(value, name: str = "seed") -> int:
    """A sampling seed as a Python int: any integral number in 0 .. :data:`MAX_SEED` (2**63-1).

    Raises:
        TypeError: not an integral number (bools, floats and text are refused), naming ``name`` and the value.
        ValueError: negative or larger than 2**63-1 (torch's "Overflow when unpacking long long" before).
    """
    value = as_scalar(value)
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer in 0 .. 2**63-1, got {value!r}")
    if not 0 <= int(value) <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in 0 .. 2**63-1, got {int(value)}")
    return int(value)


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int: any integral number (int, NumPy integer, 0-d integer tensor) >= minimum.

    Raises:
        TypeError: not an integral number (bools and floats are refused), naming ``name`` and the value.
        ValueError: smaller than ``minimum``.
    """
    value = as_scalar(value)
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def check_real(name: str, value, allowed: str) -> float:
    """``value`` as a Python float: any real number (int, float, NumPy number, 0-d tensor), not a bool.

    Raises:
        TypeError: not a real number, naming ``name``, the value and ``allowed``.
    """
    value = as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def check_range(name: str, value, low: float, high: float, allowed: str, *, low_open: bool = False) -> float:
    """A real number in [low, high] (``low_open``: (low, high]) as a Python float; NaN is refused.

    Raises:
        TypeError: not a real number. ValueError: outside the range; both name ``name`` and ``allowed``.
    """
    value = check_real(name, value, allowed)
    inside = (low < value if low_open else low <= value) and value <= high  # NaN fails both
    if not inside:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value
