"""The skills: one seeded generator per kind of question, each writing a question, its reference answer and the
name of the reward that checks a reply (``number``: the reply's last number; ``exact``: the reply itself).

A skill has a difficulty knob (``difficulties``: the values it takes) and one phrasing per question kind, so a
small model learns the skill rather than the wording. Pure Python: no torch, nothing downloaded; the words of
the spelling skills come from the embedded tinyshakespeare corpus.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

#: the embedded corpus the spelling words come from (the file ``decoderlab.data`` trains on by default)
CORPUS = Path(__file__).resolve().parents[1] / "corpora" / "tinyshakespeare.txt"
#: spelling difficulty -> the word lengths it draws (letters)
WORD_LENGTHS = {1: (3, 5), 2: (6, 8), 3: (9, 14)}


@dataclass(frozen=True)
class Skill:
    """One kind of checkable question.

    Attributes:
        name: the skill's name (``addition``, ``letter_count`` ...).
        family: the task it belongs to (``arithmetic``, ``spelling``, ``comparison``, ``tool``).
        reward: the registered reward that scores a reply (``number`` or ``exact``).
        difficulties: the values of the difficulty knob, easiest first.
        default: the difficulty used when none is given.
        draw: ``draw(rng, difficulty) -> (question, answer)``.
        describe: ``describe(difficulty)``: what that difficulty asks, for tables ("3-digit").
        needs_tool: questions beyond a small model's own skill, answered through the calculator.
    """

    name: str
    family: str
    reward: str
    difficulties: tuple[int, ...]
    default: int
    draw: Callable[[random.Random, int], tuple[str, str]]
    describe: Callable[[int], str]
    needs_tool: bool = False


def _number(rng: random.Random, digits: int) -> int:
    """A number of exactly ``digits`` digits (1 digit: 0-9)."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _addition(rng, d):
    a, b = _number(rng, d), _number(rng, d)
    return f"What is {a} + {b}?", str(a + b)


def _subtraction(rng, d):
    a, b = sorted((_number(rng, d), _number(rng, d)), reverse=True)
    return f"What is {a} - {b}?", str(a - b)


#: multiplication difficulty -> the digits of the two factors
MUL_DIGITS = {1: (1, 1), 2: (2, 1), 3: (2, 2)}


def _multiplication(rng, d):
    da, db = MUL_DIGITS[d]
    a, b = _number(rng, da), _number(rng, db)
    return f"What is {a} * {b}?", str(a * b)


def _big_multiplication(rng, d):
    """``d`` digits times 3 to ``d`` digits, in either order (4821 * 377 as well as 377 * 4821)."""
    a, b = _number(rng, d), _number(rng, rng.randint(3, d))
    if rng.random() < 0.5:
        a, b = b, a
    return f"What is {a} * {b}?", str(a * b)


@lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """The distinct lower-case words (letters a-z only, 3 letters or more) of the embedded corpus, sorted."""
    text = CORPUS.read_text(encoding="utf-8").lower()
    return tuple(sorted({w for w in re.findall(r"[a-z]+", text) if len(w) >= 3}))


@lru_cache(maxsize=None)
def words_of_length(difficulty: int) -> tuple[str, ...]:
    lo, hi = WORD_LENGTHS[difficulty]
    return tuple(w for w in corpus_words() if lo <= len(w) <= hi)


def _word(rng, d) -> str:
    words = words_of_length(d)
    return words[rng.randrange(len(words))]


def _letter_count(rng, d):
    w = _word(rng, d)
    letter = rng.choice(w) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return f"How many times does the letter {letter} appear in {w}?", str(w.count(letter))


def _backwards(rng, d):
    w = _word(rng, d)
    return f"Spell {w} backwards.", w[::-1]


def _first_letter(rng, d):
    w = _word(rng, d)
    return f"What is the first letter of {w}?", w[0]


def _last_letter(rng, d):
    w = _word(rng, d)
    return f"What is the last letter of {w}?", w[-1]


def _larger(rng, d):
    a, b = _number(rng, d), _number(rng, d)
    while b == a:
        b = _number(rng, d)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


def _smallest(rng, d):
    k = rng.randint(3, 5)
    xs = [_number(rng, d) for _ in range(k)]
    return f"What is the smallest of {', '.join(map(str, xs))}?", str(min(xs))


def _digits(d: int) -> str:
    return f"{d}-digit"


SKILLS: dict[str, Skill] = {s.name: s for s in (
    Skill("addition", "arithmetic", "number", (1, 2, 3, 4), 3, _addition, _digits),
    Skill("subtraction", "arithmetic", "number", (1, 2, 3, 4), 3, _subtraction, _digits),
    Skill("multiplication", "arithmetic", "number", (1, 2, 3), 2, _multiplication,
          lambda d: "{}x{}-digit".format(*MUL_DIGITS[d])),
    Skill("letter_count", "spelling", "number", (1, 2, 3), 1, _letter_count,
          lambda d: "{}-{} letters".format(*WORD_LENGTHS[d])),
    Skill("backwards", "spelling", "exact", (1, 2, 3), 1, _backwards,
          lambda d: "{}-{} letters".format(*WORD_LENGTHS[d])),
    Skill("first_letter", "spelling", "exact", (1, 2, 3), 2, _first_letter,
          lambda d: "{}-{} letters".format(*WORD_LENGTHS[d])),
    Skill("last_letter", "spelling", "exact", (1, 2, 3), 2, _last_letter,
          lambda d: "{}-{} letters".format(*WORD_LENGTHS[d])),
    Skill("larger", "comparison", "number", (1, 2, 3, 4), 3, _larger, _digits),
    Skill("smallest", "comparison", "number", (1, 2, 3, 4), 2, _smallest, _digits),
    Skill("big_multiplication", "tool", "number", (3, 4), 4, _big_multiplication,
          lambda d: f"{d}x3-{d}-digit", needs_tool=True),
)}

#: task (a family, or one skill by name) -> its skills
FAMILIES: dict[str, tuple[str, ...]] = {}
for _s in SKILLS.values():
    FAMILIES.setdefault(_s.family, ())
    FAMILIES[_s.family] += (_s.name,)
