"""Sampling: logits -> the next token of each row (greedy, temperature, top-k, top-p), one seeded
``torch.Generator`` per row, and the checks of the sampling settings."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

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
#: (seed + turn) still fits
MAX_SEED = 2**63 - 1


def check_seed(value, name: str = "seed") -> int:
    """A sampling seed as a Python int: any integral number in 0 .. :data:`MAX_SEED` (2**63-1).

    Raises:
        TypeError: not an integral number (bools and floats are refused), naming ``name`` and the value.
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


def check_sampling(temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> tuple[float, int | None, float | None]:
    """Check the sampling settings and return them as Python numbers ``(temperature, top_k, top_p)``.

    temperature: a finite real number >= 0 (0 = greedy); top_k: an integer >= 0, where 0 or None means no
    top-k filter (as in Hugging Face and llama.cpp); top_p: a real number in (0, 1], or None. Numbers of any
    kind are accepted: Python, NumPy, or 0-d tensors.

    Raises:
        ValueError: a value out of range (named, with what is allowed). TypeError: a value of the wrong type.
    """
    temperature = check_real("temperature", temperature, "a number >= 0 (0 = greedy)")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        top_k = check_int("top_k", top_k, 0) or None
    if top_p is not None:
        top_p = check_real("top_p", top_p, "a number in (0, 1]")
        if not (0.0 < top_p <= 1.0):  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")
    return temperature, top_k, top_p


class Sampler:
    """Choose the next token of each row from its logits: greedy, temperature, top-k and top-p.

    Args:
        temperature: 0 means greedy (argmax, no division); otherwise the logits are divided by it.
        top_k: keep the k largest logits (clamped to the vocabulary; ties with the k-th value are kept);
            0 or None: no top-k filter.
        top_p: keep the smallest set of most probable tokens whose probability reaches top_p (nucleus
            sampling, Holtzman et al. 2019); the most probable token is always kept. 1 keeps all.
        suppress: token ids never to choose (their logits are set to -inf before anything else), e.g. the
            tokenizer's ``<PAD>``, which a language model never sees as a target.

    ``sampler(logits, generators)``: logits (B, V); ``generators`` a list of B ``torch.Generator`` (one per
    row; each row draws exactly one uniform number per token, so a row's tokens depend only on its own
    generator and logits). Returns (B,) token ids. Sampling is by inverse CDF on one uniform draw (no sort
    unless top_p is set). The global RNG is never used.

    Extremes: the choice is never driven by a NaN. A temperature so small that logits / temperature
    overflows picks among the largest logits (as the limit of the distribution does); tokens with a logit of
    +inf are the only candidates (equally likely); a row whose logits are all -inf (every token suppressed or
    filtered), or logits holding NaN, raise ``ValueError``.

    Raises: see :func:`check_sampling`; ``ValueError`` for a suppressed id < 0.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 suppress: Sequence[int] = ()):
        self.temperature, self.top_k, top_p = check_sampling(temperature, top_k, top_p)
        self.top_p = None if top_p is None or top_p >= 1.0 else top_p
        self.suppress = sorted({check_int("a suppressed token id", i, 0) for i in suppress})
        self._suppress_index: torch.Tensor | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _suppressed(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.suppress:
            return logits
        idx = self._suppress_index
        if idx is None or idx.device != logits.device:
            idx = self._suppress_index = torch.tensor(
                [i for i in self.suppress if i < logits.size(-1)], dtype=torch.long, device=logits.device)
        return logits.index_fill(-1, idx, float("-inf"))

    @staticmethod
    def _check_rows(logits: torch.Tensor) -> None:
        """Raise ``ValueError`` for NaN logits or a row with no possible token (all -inf)."""
        if torch.isnan(logits).any():
            raise ValueError("the model's logits hold NaN, so no token can be chosen (check the weights, and "
                             "that the model's values fit its dtype)")
        if (logits == float("-inf")).all(dim=-1).any():
            raise ValueError("no token can be chosen: every logit of a row is -inf (every token suppressed or "
                             "filtered out)")

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) divided by the temperature, safely: never NaN, the row maximum always finite.

        Where the plain division overflows (a tiny temperature) the row's maximum is subtracted first; rows
        holding +inf logits keep only those tokens (logit 0, the others -inf)."""
        z = logits / self.temperature
        if bool(torch.isfinite(z.amax(dim=-1)).all()):
            return z
        self._check_rows(logits)
        m = logits.amax(dim=-1, keepdim=True)
        posinf = m == float("inf")
        # the maxima are 0 exactly, also where the temperature underflows the dtype (0 / 0 would be NaN)
        shifted = torch.where(logits == m, 0.0, (logits - m.masked_fill(posinf, 0.0)) / self.temperature)
        only_inf = torch.zeros_like(logits).masked_fill(logits != float("inf"), float("-inf"))
        return torch.where(posinf, only_inf, shifted)

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) with the suppressed tokens at -inf, divided by the temperature (see :meth:`scaled`),
        and the tokens top-k/top-p leave out set to -inf."""
        logits = self.scaled(self._suppressed(logits))
        v = logits.size(-1)
        if self.top_k is not None and self.top_k < v:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None:
            probs = torch.softmax(logits, dim=-1)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more probable tokens
            drop_sorted = before >= self.top_p  # the first token has before == 0 < top_p: always kept
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def __call__(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        if self.greedy:
            logits = self._suppressed(logits)
            if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
                self._check_rows(logits)  # +inf is a fine maximum; NaN and all -inf rows raise
            return logits.argmax(dim=-1)
        if logits.dtype in (torch.float16, torch.bfloat16):  # a CDF needs more precision than 8 bits
            logits = logits.float()
        probs = torch.softmax(self.filter(logits), dim=-1)
        cdf = probs.cumsum(dim=-1)
        if len(generators) == 1:
            u = torch.rand(1, generator=generators[0], dtype=torch.float64, device=logits.device)
        else:
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device)
                           for g in generators])
        x = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # in [0, total): the first cdf > x has prob > 0
        ids = torch.searchsorted(cdf, x, right=True).squeeze(-1)
        # x rounded up to the total (about 2**-24 of draws in float32): the last token that has probability
        last = probs.size(-1) - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
        return torch.minimum(ids, last)


def make_generators(seed, n: int, device: torch.device) -> list[torch.Generator]:
    """One ``torch.Generator`` per row: seed None -> fresh entropy; an integer (of any kind) -> every row
    seeded with it; a sequence of n integers -> one seed per row."""
    if seed is None:
        gens = []
        for _ in range(n):
            g = torch.Generator(device=device)
            g.seed()
            gens.append(g)
        return gens
    seed = as_scalar(seed)
    if is_integer(seed):
        seeds = [seed] * n
    else:
        try:
            seeds = list(seed)
        except TypeError:
            raise TypeError(f"seed must be an integer or one integer per prompt, got {seed!r}") from None
    if len(seeds) != n:
        raise ValueError(f"seed must be an int or one int per prompt ({n}), got {len(seeds)} seeds")
    gens = []
    for s in seeds:
        s = as_scalar(s)
        if not is_integer(s):
            raise TypeError(f"seed must be an integer, got {s!r}")
        gens.append(torch.Generator(device=device).manual_seed(check_seed(s)))
    return gens
