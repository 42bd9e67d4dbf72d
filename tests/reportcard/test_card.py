"""The card's numbers from per-question outcomes alone: accuracies with Wilson intervals, paired differences
marked when their interval excludes 0, sampled pass@1 and pass@k beside a guess, the room, and the work column
(a reply whose final number is right but one of its lines false is right, and counted in the work column)."""

import math

import pytest

from decoderlab.reportcard import card as cards
from decoderlab.reportcard.stats import PairedTable, paired_interval, wilson


def outcomes(right, replies=None, false_lines=None, sample_right=None):
    n = len(right)
    out = {"right": right, "replies": replies or ["x"] * n, "ended": [True] * n,
           "false_lines": false_lines or [None] * n}
    if sample_right is not None:
        out["sample_right"] = sample_right
    return {"off": out, "on": None}


def hand_card():
    """Two rows, three stages, 10 questions each; the work row's third SFT reply has a right final number after
    a false line."""
    work = {"sft": outcomes([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], ["7 * 8 = 56\nAnswer: 56"] * 10,
                            [0, 0, 1, 0, 2, 0, 0, 0, 0, 0], [8, 6, 4, 1, 0, 0, 2, 0, 0, 0]),
            "rl": outcomes([1, 1, 1, 1, 1, 1, 1, 0, 0, 0], None, [0] * 10, [8, 8, 8, 7, 6, 5, 5, 1, 0, 0]),
            "base": outcomes([0] * 10)}
    plain = {"sft": outcomes([1] * 9 + [0], sample_right=[8] * 9 + [0]),
             "rl": outcomes([1] * 10, sample_right=[8] * 10), "base": outcomes([0] * 10)}
    rows = [{"label": "multiplication_work 2x1-digit", "n": 10, "needs_tool": False, "work": True,
             "chance": [0.002] * 10},
            {"label": "larger 3-digit", "n": 10, "needs_tool": False, "work": False, "chance": [0.5] * 10}]
    scores = {s: {"multiplication_work 2x1-digit": work[s], "larger 3-digit": plain[s]} for s in ("base", "sft", "rl")}
    return {"stages": ["base", "sft", "rl"], "questions": 10, "samples": 8, "rows": rows, "scores": scores,
            "story": {"base": None, "sft": {"reply": "a king", "text": True}, "rl": {"reply": "a king", "text": True}}}


def test_numbers_by_hand():
    nums = cards.numbers(hand_card())
    w = nums["multiplication_work 2x1-digit"]
    assert w["stages"]["sft"]["greedy"] == pytest.approx((0.3, *wilson(3, 10)))
    assert w["stages"]["rl"]["greedy"] == pytest.approx((0.7, *wilson(7, 10)))
    # the pairs: rl - sft = +0.4, 4 discordant questions all one way
    assert w["pairs"]["rl - sft"]["greedy"] == pytest.approx(paired_interval(PairedTable(3, 0, 4, 3)))
    assert w["pairs"]["rl - sft"]["greedy"][1] > 0 and "rl - base" not in w["pairs"]
    # sampled: pass@1 the mean share, pass@8 the share of questions with any right sample (n = k = 8)
    assert w["stages"]["sft"]["pass1"] == pytest.approx(21 / 80)
    assert w["stages"]["sft"]["passk"] == pytest.approx(0.5)
    guess = 1 - (1 - 0.002) ** 8
    assert w["guess_passk"] == pytest.approx(guess)
    assert w["stages"]["sft"]["room"] == pytest.approx(0.5 - max(21 / 80, guess))
    # the work: the third reply was right with a false line; two replies have false lines, 3 lines in all
    assert w["stages"]["sft"]["work_true"] == pytest.approx(0.8) and w["stages"]["sft"]["false_lines"] == 3
    larger = nums["larger 3-digit"]
    assert larger["guess_passk"] == pytest.approx(1 - 0.5 ** 8)
    assert larger["stages"]["sft"]["room"] == pytest.approx(0.9 - max(0.9, 1 - 0.5 ** 8))  # a guess does better
    assert larger["stages"]["sft"]["work_true"] is None


def test_the_markdown_shows_each_number_with_its_interval_and_marks_differences():
    card = hand_card()
    md = cards.markdown(card, "hand")
    lo, hi = wilson(3, 10)
    assert f"| multiplication_work 2x1-digit | 10 | 0% [0, {100 * wilson(0, 10)[1]:.0f}] | 30% [{100 * lo:.0f}, " \
           f"{100 * hi:.0f}] |" in md
    d, dlo, dhi = paired_interval(PairedTable(3, 0, 4, 3))
    assert f"{100 * d:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}] *" in md  # excludes 0: marked
    d, dlo, dhi = paired_interval(PairedTable(9, 0, 1, 0))
    assert f"| larger 3-digit | +90.0 " in md and f"{100 * d:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}] |" in md
    assert "80% (3)" in md  # the work column: 80% of replies with every line true, 3 false lines in all
    assert "26% / 50%" in md  # sft's pass@1 / pass@8 on the work row
    assert math.isfinite(cards.numbers(card)["larger 3-digit"]["pairs"]["rl - sft"]["pass1"][1])
