"""Sampling: logits -> the next token of each row (greedy, temperature, top-k, top-p), one seeded
``torch.Generator`` per row, and the checks of the sampling settings."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def check_sampling(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise for bad sampling settings: temperature must be a finite number >= 0 (0 = greedy), top_k an
    integer >= 1 (or None), top_p a number in (0, 1] (or None).

    Raises:
        ValueError: a value out of range (named, with what is allowed). TypeError: a value of the wrong type.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not (0.0 < top_p <= 1.0):  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")


class Sampler:
    """Choose the next token of each row from its logits: greedy, temperature, top-k and top-p.

    Args:
        temperature: 0 means greedy (argmax, no division); otherwise the logits are divided by it.
        top_k: keep the k largest logits (clamped to the vocabulary; ties with the k-th value are kept).
        top_p: keep the smallest set of most probable tokens whose probability reaches top_p (nucleus
            sampling, Holtzman et al. 2019); the most probable token is always kept. 1 keeps all.

    ``sampler(logits, generators)``: logits (B, V); ``generators`` a list of B ``torch.Generator`` (one per
    row; each row draws exactly one uniform number per token, so a row's tokens depend only on its own
    generator and logits). Returns (B,) token ids. Sampling is by inverse CDF on one uniform draw (no sort
    unless top_p is set). The global RNG is never used.

    Raises: see :func:`check_sampling`.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
        check_sampling(temperature, top_k, top_p)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = None if top_p is None or top_p >= 1.0 else float(top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) divided by the temperature, with the tokens top-k/top-p leave out set to -inf."""
        logits = logits / self.temperature
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
        return ids.clamp_max_(logits.size(-1) - 1)


def make_generators(seed, n: int, device: torch.device) -> list[torch.Generator]:
    """One ``torch.Generator`` per row: seed None -> fresh entropy; an int -> every row seeded with it;
    a sequence of n ints -> one seed per row."""
    if seed is None:
        gens = []
        for _ in range(n):
            g = torch.Generator(device=device)
            g.seed()
            gens.append(g)
        return gens
    seeds = [seed] * n if isinstance(seed, int) and not isinstance(seed, bool) else list(seed)
    if len(seeds) != n:
        raise ValueError(f"seed must be an int or one int per prompt ({n}), got {len(seeds)} seeds")
    gens = []
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"seed must be an integer, got {s!r}")
        gens.append(torch.Generator(device=device).manual_seed(s))
    return gens
