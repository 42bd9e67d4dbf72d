"""The skills: one seeded generator per kind of question, each writing a question, its reference answer and the
name of the reward that checks a reply (``number``: the reply's last number; ``exact``: the reply itself;
``countdown``: every line of the work true and the target reached).

A skill has a difficulty knob (``difficulties``: the values it takes) and one phrasing per question kind, so a
small model learns the skill rather than the wording. The ``scratchpad`` family asks four of them again with
" Show your work." and answers with the steps (:mod:`.work`); ``search`` is countdown. Pure Python: no torch, nothing downloaded; the words of
the spelling skills come from the embedded tinyshakespeare corpus.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from . import words
from .work import (WORK_SUFFIX, column_work, countdown_chance, countdown_of, draw_countdown, multiplication_work,
                   spelled_count)

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
        chance: ``chance(question)``: the probability that a uniform guess over the question's possible
            answers is right (the floor under pass@k: a guesser's pass@k is ``1 - (1 - chance)^k``).
        work: the answer shows its work, a line a program checks at a time (:mod:`.work`), before the final
            answer (the scratchpad forms and countdown).
    """

    name: str
    family: str
    reward: str
    difficulties: tuple[int, ...]
    default: int
    draw: Callable[[random.Random, int], tuple[str, str]]
    describe: Callable[[int], str]
    needs_tool: bool = False
    chance: Callable[[str], float] | None = None
    work: bool = False


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


def _multiplication_work(rng, d):
    q, _ = _multiplication(rng, d)
    x, y = _ints(q)
    return q + WORK_SUFFIX, multiplication_work(x, y)


def _addition_work(rng, d):
    q, _ = _addition(rng, d)
    x, y = _ints(q)
    return q + WORK_SUFFIX, column_work(x, "+", y)


def _subtraction_work(rng, d):
    q, _ = _subtraction(rng, d)
    x, y = _ints(q)
    return q + WORK_SUFFIX, column_work(x, "-", y)


def _letter_count_work(rng, d):
    q, _ = _letter_count(rng, d)
    letter, word = _COUNT_Q.fullmatch(q).groups()
    return q + WORK_SUFFIX, spelled_count(word, letter)


def _word_problem(rng, d):
    return words.draw(rng, d)


def _word_chance(q):  # a guess anywhere between the smallest and the largest answer of such a story
    _, _, op, _ = words.parse(q)
    low, high = {"": (100, 9801), "+": (110, 9900), "-": (1, 9791)}[op]
    return 1 / (high - low + 1)


#: countdown difficulty -> how many numbers (each 1-9; the target 10-100)
COUNTDOWN_NUMBERS = {1: 3, 2: 4}


def _countdown(rng, d):
    return draw_countdown(rng, COUNTDOWN_NUMBERS[d])


# ---------------------------------------------------------------------------------------------------------
# A uniform guess's chance: one over the number of answers a question of the skill could have
# ---------------------------------------------------------------------------------------------------------

_COUNT_Q = re.compile(r"How many times does the letter ([a-z]) appear in ([a-z]+)\?")


def _ints(question: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", question)]


def _span(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _sum_chance(q):  # a + b over two numbers of a's digits: every sum from 2 lo to 2 hi
    lo, hi = _span(len(str(_ints(q)[0])))
    return 1 / (2 * (hi - lo) + 1)


def _difference_chance(q):  # a - b with a >= b: 0 .. hi - lo
    lo, hi = _span(len(str(_ints(q)[0])))
    return 1 / (hi - lo + 1)


@lru_cache(maxsize=None)
def _products(da: int, db: int) -> int:
    (la, ha), (lb, hb) = _span(da), _span(db)
    return len({x * y for x in range(la, ha + 1) for y in range(lb, hb + 1)})


def _product_chance(q):  # one of the distinct products of numbers of these digits
    a, b = _ints(q)[:2]
    return 1 / _products(len(str(a)), len(str(b)))


def _big_product_chance(q):  # a guess anywhere between the smallest and the largest product of such numbers
    (la, ha), (lb, hb) = (_span(len(str(x))) for x in _ints(q)[:2])
    return 1 / (ha * hb - la * lb + 1)


def _count_chance(q):  # 0 .. len(word)
    return 1 / (len(_COUNT_Q.search(q)[2]) + 1)


def _letter_chance(q):  # one of 26 letters
    return 1 / 26


def _backwards_chance(q):  # one of the distinct orders of the word's letters
    w = re.search(r"Spell ([a-z]+) backwards", q)[1]
    n = math.factorial(len(w))
    for c in set(w):
        n //= math.factorial(w.count(c))
    return 1 / n


def _pick_chance(q):  # one of the numbers shown
    return 1 / len(_ints(q))


def _countdown_chance(q):
    numbers, target = countdown_of(q)
    return countdown_chance(numbers, target)


def _digits(d: int) -> str:
    return f"{d}-digit"


def _letters(d: int) -> str:
    return "{}-{} letters".format(*WORD_LENGTHS[d])


def _factors(d: int) -> str:
    return "{}x{}-digit".format(*MUL_DIGITS[d])


SKILLS: dict[str, Skill] = {s.name: s for s in (
    Skill("addition", "arithmetic", "number", (1, 2, 3, 4), 3, _addition, _digits, chance=_sum_chance),
    Skill("subtraction", "arithmetic", "number", (1, 2, 3, 4), 3, _subtraction, _digits,
          chance=_difference_chance),
    Skill("multiplication", "arithmetic", "number", (1, 2, 3), 2, _multiplication, _factors,
          chance=_product_chance),
    Skill("letter_count", "spelling", "number", (1, 2, 3), 1, _letter_count, _letters, chance=_count_chance),
    Skill("backwards", "spelling", "exact", (1, 2, 3), 1, _backwards, _letters, chance=_backwards_chance),
    Skill("first_letter", "spelling", "exact", (1, 2, 3), 2, _first_letter, _letters, chance=_letter_chance),
    Skill("last_letter", "spelling", "exact", (1, 2, 3), 2, _last_letter, _letters, chance=_letter_chance),
    Skill("larger", "comparison", "number", (1, 2, 3, 4), 3, _larger, _digits, chance=_pick_chance),
    Skill("smallest", "comparison", "number", (1, 2, 3, 4), 2, _smallest, _digits, chance=_pick_chance),
    Skill("big_multiplication", "tool", "number", (3, 4), 4, _big_multiplication,
          lambda d: f"{d}x3-{d}-digit", needs_tool=True, chance=_big_product_chance),
    Skill("word_problem", "words", "number", words.STEPS, 2, _word_problem, lambda d: f"{d}-step",
          needs_tool=True, chance=_word_chance),
    Skill("addition_work", "scratchpad", "number", (1, 2, 3, 4), 3, _addition_work, _digits, chance=_sum_chance,
          work=True),
    Skill("subtraction_work", "scratchpad", "number", (1, 2, 3, 4), 3, _subtraction_work, _digits,
          chance=_difference_chance, work=True),
    Skill("multiplication_work", "scratchpad", "number", (1, 2, 3), 2, _multiplication_work, _factors,
          chance=_product_chance, work=True),
    Skill("letter_count_work", "scratchpad", "number", (1, 2, 3), 3, _letter_count_work, _letters,
          chance=_count_chance, work=True),
    Skill("countdown", "search", "countdown", (1, 2), 1, _countdown,
          lambda d: f"{COUNTDOWN_NUMBERS[d]} numbers", chance=_countdown_chance, work=True),
)}

#: task (a family, or one skill by name) -> its skills
FAMILIES: dict[str, tuple[str, ...]] = {}
for _s in SKILLS.values():
    FAMILIES.setdefault(_s.family, ())
    FAMILIES[_s.family] += (_s.name,)
