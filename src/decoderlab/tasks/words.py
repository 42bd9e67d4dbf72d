"""Word problems whose answer is one calculator expression: a product of two 2-digit numbers told as a story
(one step: "A box holds 24 pens; how many pens are in 17 boxes?" is ``24 * 17``), or that product and then a
number added or taken away (two steps: "... Sam has 17 boxes and gives away 35 pens. How many pens are left?"
is ``24 * 17 - 35``).

Each story is a sentence with three slots (``{a}`` the size of a group, ``{b}`` the number of groups, ``{c}``
the loose ones); :func:`parse` reads a question back to its numbers and operation, so the split can put every
wording of one problem -- and the plain ``What is 17 * 24?`` of a one-step one -- on one side
(:func:`problem_key`). Pure Python: no torch.
"""

from __future__ import annotations

import random
import re

#: one-step stories: the answer is ``a * b``
ONE_STEP = (
    "A box holds {a} pens; how many pens are in {b} boxes?",
    "Each bus carries {a} people. How many people do {b} buses carry?",
    "A crate holds {a} apples. How many apples are in {b} crates?",
    "A shelf holds {a} books. How many books fit on {b} shelves?",
    "A ticket costs {a} dollars. How many dollars do {b} tickets cost?",
)
#: two-step stories: (text, the operation that joins the loose ones ``c`` to the product ``a * b``)
TWO_STEP = (
    ("A box holds {a} pens. Sam has {b} boxes and {c} loose pens. How many pens does Sam have?", "+"),
    ("A box holds {a} pens. Sam has {b} boxes and gives away {c} pens. How many pens are left?", "-"),
    ("Each bus carries {a} people. {b} buses arrive, and {c} more people come on foot. How many people came?", "+"),
    ("A crate holds {a} apples. A shop gets {b} crates and sells {c} apples. How many apples are left?", "-"),
    ("A ticket costs {a} dollars. Ana buys {b} tickets and pays {c} dollars for parking. How many dollars did "
     "she spend?", "+"),
)
STEPS = (1, 2)


def _pattern(text: str) -> re.Pattern:
    return re.compile(re.escape(text).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
                      .replace(r"\{c\}", r"(?P<c>\d+)"))


_PATTERNS = [(_pattern(t), "") for t in ONE_STEP] + [(_pattern(t), op) for t, op in TWO_STEP]


def expression(a: int, b: int, op: str = "", c: int | None = None) -> str:
    """The calculator expression of a story: ``"24 * 17"`` or ``"24 * 17 - 35"``."""
    return f"{a} * {b}" + (f" {op} {c}" if op else "")


def draw(rng: random.Random, steps: int) -> tuple[str, str]:
    """``(question, answer)``: a story of ``steps`` steps (1 or 2) on two 2-digit numbers (and, in two steps, a
    third one below the product, so every answer is a positive whole number). Raises ValueError for another
    ``steps``."""
    if steps not in STEPS:
        raise ValueError(f"a word problem has 1 or 2 steps, got {steps!r}")
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if steps == 1:
        return rng.choice(ONE_STEP).format(a=a, b=b), str(a * b)
    text, op = rng.choice(TWO_STEP)
    c = rng.randint(10, 99)
    return text.format(a=a, b=b, c=c), str(a * b + c if op == "+" else a * b - c)


def parse(question: str) -> tuple[int, int, str, int | None] | None:
    """``(a, b, op, c)`` of a word problem (``op`` "" and ``c`` None for one step), or None for another
    question."""
    for pattern, op in _PATTERNS:
        m = pattern.fullmatch(question)
        if m is not None:
            return int(m["a"]), int(m["b"]), op, (int(m["c"]) if op else None)
    return None


def expression_of(question: str) -> str | None:
    """The calculator expression a word problem asks for (:func:`expression`), or None for another question."""
    parsed = parse(question)
    return None if parsed is None else expression(*parsed)


def problem_key(question: str) -> str | None:
    """The problem a word problem asks, whatever its wording: the product's factors sorted (``"17 * 24"``, the
    key of ``What is 24 * 17?`` too), then the second step (``"17 * 24 - 35"``); None for another question."""
    parsed = parse(question)
    if parsed is None:
        return None
    a, b, op, c = parsed
    lo, hi = sorted((a, b))
    return expression(lo, hi, op, c)
