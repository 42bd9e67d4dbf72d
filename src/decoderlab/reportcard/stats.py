"""The statistics of the report card: how sure a held-out number is, and whether two stages differ (pure
Python, no torch, no numpy).

* :func:`wilson` -- the 95% interval of one accuracy (k right of n): Wilson's score interval, which stays inside
  [0, 1] and keeps its coverage near 0% and 100%, where the textbook ``p +- 1.96 sqrt(p(1-p)/n)`` does not
  (Wilson 1927; Brown, Cai & DasGupta 2001, "Interval estimation for a binomial proportion").
* :func:`paired_interval` -- the 95% interval of the difference of two accuracies measured on the *same*
  questions: Newcombe's method 10 (Newcombe 1998, "Improved confidence intervals for the difference between
  binomial proportions based on paired data", Stat. Med. 17:2635), built from the two Wilson intervals and the
  correlation of the pairs. Pairing matters: two stages that agree on most questions differ by much less noise
  than two independent samples would.
* :func:`mcnemar` -- McNemar's exact test of the same pairs: only the discordant questions (right in one
  stage, wrong in the other) carry evidence, and under "no difference" each is a fair coin.
* :func:`paired_bootstrap` -- the interval of a difference of per-question means that are not 0/1 (sampled
  pass@1: the share of k samples that were right), by resampling questions (Efron & Tibshirani 1993); seeded.
* :func:`pass_at_k` -- the unbiased estimator of pass@k from n samples of which c are right (Chen et al. 2021,
  "Evaluating large language models trained on code", the HumanEval paper): ``1 - C(n-c, k) / C(n, k)``.
* :func:`guess_pass_at_k` -- pass@k of a guesser that is right with probability p per try.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

#: the confidence of every interval on the card
CONFIDENCE = 0.95


def z_of(confidence: float = CONFIDENCE) -> float:
    """The two-sided normal quantile of ``confidence`` (1.959964 for 0.95). Raises ValueError outside (0, 1)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1 (exclusive), got {confidence!r}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson's score interval ``(low, high)`` of a proportion with ``k`` successes in ``n`` trials::

        (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n),   p = k/n

    Raises:
        ValueError: ``k`` or ``n`` not an integer >= 0, ``k > n``, or ``n == 0``.
    """
    k, n = _count("k", k), _count("n", n)
    if n == 0 or k > n:
        raise ValueError(f"a proportion needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    z = z_of(confidence)
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    # (at k = 0 and k = n one end is exactly 0 or 1; the float formula leaves 1e-17)
    return (0.0 if k == 0 else (centre - half) / den), (1.0 if k == n else (centre + half) / den)


@dataclass(frozen=True)
class PairedTable:
    """The 2 x 2 table of two stages' outcomes on the same questions: ``both`` right, ``only_first`` right,
    ``only_second`` right, ``neither``."""

    both: int
    only_first: int
    only_second: int
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.only_first + self.only_second + self.neither

    @classmethod
    def of(cls, first: Sequence, second: Sequence) -> "PairedTable":
        """The table of two equally long sequences of outcomes (each 0/1 or a bool). Raises ValueError."""
        if len(first) != len(second) or not first:
            raise ValueError(f"paired outcomes must be two non-empty sequences of one length, got {len(first)} "
                             f"and {len(second)}")
        cells = [0, 0, 0, 0]
        for x, y in zip(first, second):
            if x not in (0, 1) or y not in (0, 1):
                raise ValueError(f"a paired outcome is 0 or 1 (wrong or right), got {x!r} and {y!r}")
            cells[(1 - int(x)) * 2 + (1 - int(y))] += 1
        return cls(cells[0], cells[1], cells[2], cells[3])


def paired_interval(table: PairedTable, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(difference, low, high)``: the second stage's accuracy minus the first's on the same questions, with
    Newcombe's (1998) method-10 interval::

        (l1, u1), (l2, u2) = Wilson intervals of p1, p2;   d = p2 - p1
        B   = both * neither - only_first * only_second
        phi = C / sqrt(the product of the four margins)  (0 if any is 0),
              C = B - n/2 when B > n/2, B when B < 0, else 0   (Newcombe's correction for continuity)
        low  = d - sqrt((p2 - l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2)
        high = d + sqrt((u2 - p2)^2 - 2 phi (u2 - p2)(p1 - l1) + (p1 - l1)^2)

    Raises:
        ValueError: an empty table.
    """
    t = table
    n = t.n
    if n == 0:
        raise ValueError("an empty table has no difference")
    r1, r2 = t.both + t.only_first, t.both + t.only_second  # right in the first, in the second
    p1, p2 = r1 / n, r2 / n
    l1, u1 = wilson(r1, n, confidence)
    l2, u2 = wilson(r2, n, confidence)
    margins = r1 * (n - r1) * r2 * (n - r2)
    b = t.both * t.neither - t.only_first * t.only_second
    c = b - n / 2 if b > n / 2 else (b if b < 0 else 0.0)
    phi = c / math.sqrt(margins) if margins else 0.0
    d = p2 - p1
    low = d - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    high = d + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    return d, low, high


def mcnemar(table: PairedTable) -> float:
    """McNemar's exact two-sided p-value: twice the smaller binomial tail of ``only_first`` in
    ``only_first + only_second`` fair coin tosses (capped at 1; 1 with no discordant pair)."""
    b, c = table.only_first, table.only_second
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def paired_bootstrap(first: Sequence[float], second: Sequence[float], *, resamples: int = 2000, seed: int = 0,
                     confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(difference, low, high)``: mean(second) - mean(first) over the same questions, with the percentile
    interval of that difference over ``resamples`` resamplings of the questions (with replacement; seeded, so a
    card recomputed from its outcomes gives the same interval).

    Raises:
        ValueError: sequences of different lengths or empty; ``resamples`` < 1.
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"paired values must be two non-empty sequences of one length, got {len(first)} and "
                         f"{len(second)}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    z_of(confidence)
    diffs = [float(y) - float(x) for x, y in zip(first, second)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    lo = means[min(resamples - 1, int(math.floor(tail * resamples)))]
    hi = means[max(0, int(math.ceil((1 - tail) * resamples)) - 1)]
    return sum(diffs) / n, lo, hi


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k -- the chance that at least one of k replies is right -- from ``n``
    sampled replies of which ``c`` were right (Chen et al. 2021, eq. 1): ``1 - C(n-c, k) / C(n, k)``,
    computed as a product so it never forms a huge binomial. With k = 1 it is c / n; with k = n, 1 if c > 0.

    Raises:
        ValueError: not integers, c > n, or k outside 1..n.
    """
    n, c, k = _count("n", n), _count("c", c), _count("k", k)
    if c > n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        prod *= 1.0 - k / i
    return 1.0 - prod


def guess_pass_at_k(p: float, k: int) -> float:
    """pass@k of a guesser right with probability ``p`` on each of ``k`` independent tries: ``1 - (1 - p)^k``.

    Raises:
        ValueError: ``p`` outside [0, 1] or ``k`` < 1.
    """
    if not (isinstance(p, (int, float)) and 0 <= p <= 1):
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    return 1.0 - (1.0 - p) ** k
