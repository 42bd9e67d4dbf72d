"""The card's statistics against cases worked by hand and against scipy (where it is installed): Wilson's
interval, McNemar's exact test, Newcombe's paired interval, the paired bootstrap, Chen et al.'s pass@k."""

import math
import random

import pytest

from decoderlab.reportcard.stats import (PairedTable, guess_pass_at_k, mcnemar, paired_bootstrap, paired_interval,
                                         pass_at_k, wilson, z_of)

Z = 1.959963984540054


def test_wilson_by_hand():
    # k = 0 of n = 10: centre z^2/2n over 1 + z^2/n, half-width the same -> [0, z^2 / (n + z^2)]
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and wilson(10, 10)[1] == 1.0 and hi == pytest.approx(Z ** 2 / (10 + Z ** 2))  # 0.2775
    assert hi == pytest.approx(0.27753, abs=1e-5)
    # 8 of 10: p = .8; (0.8 + 0.19207 -+ 1.95996 sqrt(0.016 + 0.0096037)) / 1.384146
    half = Z * math.sqrt(0.8 * 0.2 / 10 + Z ** 2 / 400)
    assert wilson(8, 10) == pytest.approx(((0.8 + Z ** 2 / 20 - half) / (1 + Z ** 2 / 10),
                                           (0.8 + Z ** 2 / 20 + half) / (1 + Z ** 2 / 10)))
    assert wilson(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    # 400 questions: at most +-4.9 points anywhere (the card's size)
    assert max(hi - lo for lo, hi in (wilson(k, 400) for k in range(401))) / 2 < 0.049
    assert z_of(0.95) == pytest.approx(Z)


def test_wilson_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(0, 10), (3, 10), (10, 10), (137, 400), (396, 400), (1, 3)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_mcnemar_by_hand_and_against_scipy():
    # 10 questions right only in the first stage, 2 only in the second: 2 * P(X <= 2), X ~ Bin(12, 1/2)
    t = PairedTable(both=50, only_first=10, only_second=2, neither=38)
    assert mcnemar(t) == pytest.approx(2 * (1 + 12 + 66) / 4096)  # 0.03857
    assert mcnemar(PairedTable(5, 0, 0, 5)) == 1.0 and mcnemar(PairedTable(0, 3, 3, 0)) == 1.0
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(10, 2), (7, 7), (0, 9), (31, 12)]:
        assert mcnemar(PairedTable(20, b, c, 20)) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue)


def test_the_table_of_two_outcome_lists():
    t = PairedTable.of([1, 1, 0, 0, 1], [1, 0, 1, 0, 1])
    assert t == PairedTable(both=2, only_first=1, only_second=1, neither=1) and t.n == 5
    with pytest.raises(ValueError, match="one length"):
        PairedTable.of([1, 0], [1])
    with pytest.raises(ValueError, match="0 or 1"):
        PairedTable.of([1, 2], [1, 0])


def test_newcombe_paired_interval_by_hand():
    # both 40, only the first 5, only the second 15, neither 40 (n = 100): p1 = .45, p2 = .55, d = +.10
    t = PairedTable(40, 5, 15, 40)
    l1, u1 = wilson(45, 100)
    l2, u2 = wilson(55, 100)
    phi = (40 * 40 - 5 * 15 - 100 / 2) / math.sqrt(45 * 55 * 55 * 45)  # 1525 - 50 = 1475 over 2475: 0.595960
    assert phi == pytest.approx(0.595960, abs=1e-6)
    low = 0.10 - math.sqrt((0.55 - l2) ** 2 - 2 * phi * (0.55 - l2) * (u1 - 0.45) + (u1 - 0.45) ** 2)
    high = 0.10 + math.sqrt((u2 - 0.55) ** 2 - 2 * phi * (u2 - 0.55) * (0.45 - l1) + (0.45 - l1) ** 2)
    d, lo, hi = paired_interval(t)
    assert (d, lo, hi) == pytest.approx((0.10, low, high))
    assert lo > 0 and mcnemar(t) < 0.05  # the interval and the test agree: a difference
    # pairing narrows the interval: the same margins from two independent samples (phi = 0) give a wider one
    assert hi - lo < math.sqrt((0.55 - l2) ** 2 + (u1 - 0.45) ** 2) + math.sqrt((u2 - 0.55) ** 2 + (0.45 - l1) ** 2)
    # reversing the stages mirrors the interval
    assert paired_interval(PairedTable(40, 15, 5, 40)) == pytest.approx((-0.10, -high, -low))
    # no discordant pair: the difference is 0, inside its interval
    d, lo, hi = paired_interval(PairedTable(60, 0, 0, 40))
    assert d == 0 and lo < 0 < hi


def test_newcombe_worked_example():
    # Newcombe (1998)'s worked example, also Altman et al. (2000) "Statistics with confidence", table 6.2:
    # 14 both, 5 only the first, 0 only the second, 22 neither: the first minus the second is 0.1220
    # [0.0115, 0.2265]; ours is the second minus the first
    d, lo, hi = paired_interval(PairedTable(14, 5, 0, 22))
    assert (-d, -hi, -lo) == pytest.approx((0.1220, 0.0115, 0.2265), abs=5e-5)


def test_newcombe_covers_the_true_difference_about_95_percent_of_the_time():
    rng = random.Random(0)
    cover, runs = 0, 2000
    for _ in range(runs):  # two correlated stages, true accuracies 0.60 and 0.70 on 200 questions
        first, second = [], []
        for _ in range(200):
            u = rng.random()
            first.append(int(u < 0.6))
            second.append(int(u < 0.65 or rng.random() < 0.05 / 0.35 and u >= 0.65))
        d, lo, hi = paired_interval(PairedTable.of(first, second))
        cover += lo <= 0.10 <= hi  # P(second) = 0.65 + 0.35 * (0.05 / 0.35) = 0.70
    assert 0.93 <= cover / runs <= 0.975


def test_paired_bootstrap():
    first = [0.0, 0.25, 0.5, 0.5, 1.0, 0.0, 0.125, 0.75]
    second = [x + 0.25 for x in first]  # every question +0.25: no spread, the interval is the point
    assert paired_bootstrap(first, second) == pytest.approx((0.25, 0.25, 0.25))
    rng = random.Random(1)
    a = [rng.random() for _ in range(300)]
    b = [x + rng.gauss(0.05, 0.2) for x in a]
    d, lo, hi = paired_bootstrap(a, b, resamples=4000)
    se = math.sqrt(sum((y - x - d) ** 2 for x, y in zip(a, b)) / 299 / 300)
    assert lo == pytest.approx(d - Z * se, abs=0.006) and hi == pytest.approx(d + Z * se, abs=0.006)
    assert paired_bootstrap(a, b) == paired_bootstrap(a, b)  # seeded
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap([1.0], [1.0, 0.0])


def test_pass_at_k_by_hand():
    # n = 5 samples, c = 2 right, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # k = 1: the share right
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0  # k = n: any right
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    assert pass_at_k(200, 7, 100) == pytest.approx(1 - math.comb(193, 100) / math.comb(200, 100))
    assert guess_pass_at_k(0.5, 8) == pytest.approx(1 - 0.5 ** 8) and guess_pass_at_k(0, 8) == 0
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (-1, 0, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_is_unbiased():
    # a question right with probability p: the estimator's mean over draws of n samples is 1 - (1 - p)^k
    rng = random.Random(2)
    p, n, k = 0.2, 8, 4
    est = [pass_at_k(n, sum(rng.random() < p for _ in range(n)), k) for _ in range(40_000)]
    assert sum(est) / len(est) == pytest.approx(1 - (1 - p) ** k, abs=0.005)
