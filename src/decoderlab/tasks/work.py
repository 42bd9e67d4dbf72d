"""Answers that show their work, and the program that checks every line of it.

Three forms, each written so that a line is one small step a program can check on its own:

* multiplication with partial products (Lee et al. 2023, "Teaching arithmetic to small transformers": a
  scratchpad of the steps lets a small model learn products it cannot answer at once)::

      What is 47 * 8? Show your work.
      7 * 8 = 56
      40 * 8 = 320
      56 + 320 = 376
      Answer: 376

* a letter count with the word spelled out, each letter its own token, the letter asked for numbered as it
  is met::

      How many times does the letter e appear in excellence? Show your work.
      e1-x-c-e2-l-l-e3-n-c-e4
      Answer: 4

* countdown (the game: reach a target from the given numbers with + - * /, each number used once; the
  search task of TinyZero and of Gandhi et al. 2024, "Stream of search"), one operation a line, every
  result a positive whole number that the next lines may use::

      Make 27 from 5, 8, 9.
      8 - 5 = 3
      3 * 9 = 27

:func:`check_work` reads a reply line by line and counts the false lines; the arithmetic of a line is done
by the ``evaluate`` it is given (the calculator's, :func:`decoderlab.chat.evaluate`: one evaluator for the
tool, the reward and the card). Pure Python, no torch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

#: what the scratchpad form of a question adds to the plain one
WORK_SUFFIX = " Show your work."
#: the last line of a scratchpad answer
ANSWER = "Answer: "
#: countdown's operations, and whether a step's result is allowed (a positive whole number)
OPERATIONS = ("+", "-", "*", "/")

_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
_COUNTDOWN = re.compile(r"Make (\d+) from (\d+(?:, \d+)+)\.")
_COUNT = re.compile(r"How many times does the letter ([a-z]) appear in ([a-z]+)\?")
_PRODUCT = re.compile(r"What is (\d+) \* (\d+)\?")


# ---------------------------------------------------------------------------------------------------------
# Writing the work
# ---------------------------------------------------------------------------------------------------------


def multiplication_work(a: int, b: int) -> str:
    """The scratchpad of ``a * b``: one partial product per pair of digits (units first, each digit with its
    place value: ``40 * 8 = 320``), then a running sum of them, then ``Answer: a*b``."""
    parts = []
    for j, db in enumerate(reversed(str(b))):
        for i, da in enumerate(reversed(str(a))):
            x, y = int(da) * 10 ** i, int(db) * 10 ** j
            parts.append((x, y, x * y))
    lines = [f"{x} * {y} = {p}" for x, y, p in parts]
    total = parts[0][2]
    for _, _, p in parts[1:]:
        lines.append(f"{total} + {p} = {total + p}")
        total += p
    return "\n".join(lines + [f"{ANSWER}{total}"])


def spelled_count(word: str, letter: str) -> str:
    """The word's letters joined by ``-``, each ``letter`` followed by its running count, then the answer."""
    out, n = [], 0
    for c in word:
        if c == letter:
            n += 1
            out.append(f"{c}{n}")
        else:
            out.append(c)
    return "-".join(out) + f"\n{ANSWER}{n}"


def _step(a: int, op: str, b: int) -> int | None:
    """``a op b`` when it is a positive whole number (countdown's rule), else None."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    return a // b if b and a % b == 0 else None


@lru_cache(maxsize=4096)
def _results(pool: tuple[int, ...]) -> dict[int, int]:
    """For a sorted pool: final result -> the number of ordered step sequences that end in it (each step
    takes an ordered pair of the pool's numbers and an operation whose result is allowed)."""
    if len(pool) == 1:
        return {pool[0]: 1}
    out: dict[int, int] = {}
    for i in range(len(pool)):
        for j in range(len(pool)):
            if i == j:
                continue
            rest = [pool[k] for k in range(len(pool)) if k not in (i, j)]
            for op in OPERATIONS:
                r = _step(pool[i], op, pool[j])
                if r is None:
                    continue
                for value, count in _results(tuple(sorted(rest + [r]))).items():
                    out[value] = out.get(value, 0) + count
    return out


def countdown_results(numbers) -> dict[int, int]:
    """Every result reachable from ``numbers`` with each used once, and how many step sequences reach it."""
    return dict(_results(tuple(sorted(numbers))))


def countdown_chance(numbers, target: int) -> float:
    """The share of all valid step sequences over ``numbers`` that end in ``target``: a uniform guess's
    chance."""
    results = _results(tuple(sorted(numbers)))
    return results.get(target, 0) / sum(results.values())


def countdown_solutions(numbers, target: int) -> list[tuple[tuple[int, str, int, int], ...]]:
    """Every step sequence (``((a, op, b, result), ...)``, in the order written) that uses each of ``numbers``
    once and ends in ``target``."""
    return list(_solutions(tuple(numbers), target))


@lru_cache(maxsize=65536)
def _solutions(pool: tuple[int, ...], target: int) -> tuple[tuple[tuple[int, str, int, int], ...], ...]:
    # depth first, a step then every way on from its pool: the order of an uncached walk (a seed draws the
    # same reference); cached by pool, since draws and their sub-pools repeat (generation was 85% this walk)
    if len(pool) == 1:
        return ((),) if pool[0] == target else ()
    out = []
    for i in range(len(pool)):
        for j in range(len(pool)):
            if i == j:
                continue
            for op in OPERATIONS:
                r = _step(pool[i], op, pool[j])
                if r is None:
                    continue
                rest = tuple(pool[k] for k in range(len(pool)) if k not in (i, j)) + (r,)
                if target in _results(tuple(sorted(rest))):
                    out += [((pool[i], op, pool[j], r),) + tail for tail in _solutions(rest, target)]
    return tuple(out)


def countdown_text(steps) -> str:
    """The lines of a step sequence (:func:`countdown_solutions`)."""
    return "\n".join(f"{a} {op} {b} = {r}" for a, op, b, r in steps)


def countdown_question(numbers, target: int) -> str:
    return f"Make {target} from {', '.join(map(str, numbers))}."


def draw_countdown(rng: random.Random, size: int, low: int = 1, high: int = 9,
                   targets: tuple[int, int] = (10, 100)) -> tuple[str, str]:
    """A countdown question with ``size`` numbers in ``[low, high]`` and a reachable target in ``targets``
    (the result of a random valid step sequence, not one of the numbers), and one of its solutions drawn at
    random as the reference (so a model fine-tuned on them learns the many ways, not one)."""
    while True:
        numbers = [rng.randint(low, high) for _ in range(size)]
        pool, steps = list(numbers), []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            op = rng.choice(OPERATIONS)
            r = _step(pool[i], op, pool[j])
            if r is None:
                break
            steps.append((pool[i], op, pool[j], r))
            pool = [pool[k] for k in range(len(pool)) if k not in (i, j)] + [r]
        if len(pool) == 1 and targets[0] <= pool[0] <= targets[1] and pool[0] not in numbers:
            target = pool[0]
            solutions = countdown_solutions(numbers, target)
            return countdown_question(numbers, target), countdown_text(rng.choice(solutions))


# ---------------------------------------------------------------------------------------------------------
# Checking the work
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkCheck:
    """A reply's work: ``lines`` (non-empty lines read), ``false`` (how many of them are false: a wrong
    equation, a misspelt word, a wrong count, a number the reply does not have, a line that is none of the
    form's), and ``solved`` (countdown: every line true, every number used once, the target reached)."""

    lines: int
    false: int
    solved: bool = False


def _lines(reply: str) -> list[str]:
    return [line.strip() for line in reply.strip().split("\n") if line.strip()]


def _equation_true(line: str, evaluate: Callable[[str], str]) -> tuple[int, str, int, int] | None:
    """``(a, op, b, result)`` when ``line`` is ``a op b = result`` and ``evaluate("a op b")`` gives ``result``."""
    m = _EQUATION.fullmatch(line)
    if m is None:
        return None
    try:
        ok = evaluate(f"{m[1]} {m[2]} {m[3]}") == m[4]
    except ValueError:  # the evaluator refused it (a division by zero)
        return None
    return (int(m[1]), m[2], int(m[3]), int(m[4])) if ok else None


def _answer_line(line: str) -> int | None:
    rest = line[len(ANSWER):] if line.startswith(ANSWER) else None
    return int(rest) if rest is not None and rest.isdigit() else None


def check_multiplication(reply: str, evaluate: Callable[[str], str]) -> WorkCheck:
    """Each ``a op b = c`` line true by ``evaluate``; the ``Answer:`` line true when it repeats the last
    line's result."""
    lines, false, last = _lines(reply), 0, None
    for line in lines:
        if line.startswith(ANSWER):
            false += last is None or _answer_line(line) != last
            continue
        eq = _equation_true(line, evaluate)
        false += eq is None
        last = eq[3] if eq else None
    return WorkCheck(len(lines), false)


def check_spelled_count(word: str, letter: str, reply: str) -> WorkCheck:
    """The first line true when it is exactly :func:`spelled_count`'s spelling of ``word`` with ``letter``
    numbered; the ``Answer:`` line true when it gives the number of marks the first line made."""
    lines, false, marks = _lines(reply), 0, None
    for k, line in enumerate(lines):
        if line.startswith(ANSWER):
            false += marks is None or _answer_line(line) != marks
        elif k == 0:
            right = spelled_count(word, letter).split("\n")[0]
            false += line != right
            marks = len(re.findall(r"\d+", line))
        else:
            false += 1
    return WorkCheck(len(lines), false)


def check_countdown(numbers, target: int, reply: str, evaluate: Callable[[str], str]) -> WorkCheck:
    """Each line ``a op b = c`` true by ``evaluate``, with ``a`` and ``b`` numbers the reply still has (the
    given ones and the results of earlier lines, each used once) and ``c`` a positive whole number; solved
    when every line is true, one number is left and it is ``target``."""
    lines, false, pool = _lines(reply), 0, list(numbers)
    for line in lines:
        eq = _equation_true(line, evaluate)
        ok = eq is not None and eq[3] > 0
        if ok:
            a, _, b, r = eq
            have = list(pool)
            for x in (a, b):
                if x in have:
                    have.remove(x)
                else:
                    ok = False
            if ok:
                pool = have + [r]
        false += not ok
    solved = bool(lines) and false == 0 and pool == [target]
    return WorkCheck(len(lines), false, solved)


def countdown_of(question: str) -> tuple[list[int], int] | None:
    """``(numbers, target)`` of a countdown question, or None when it is not one."""
    m = _COUNTDOWN.fullmatch(question)
    return ([int(x) for x in m[2].split(", ")], int(m[1])) if m else None


def check_work(question: str, reply: str, evaluate: Callable[[str], str]) -> WorkCheck | None:
    """The check of a reply to ``question`` when the question's answer shows work (a scratchpad question or
    countdown), else None. ``evaluate(expression) -> value as text`` does each line's arithmetic."""
    if (cd := countdown_of(question)) is not None:
        return check_countdown(cd[0], cd[1], reply, evaluate)
    if not question.endswith(WORK_SUFFIX):
        return None
    plain = question[: -len(WORK_SUFFIX)]
    if (m := _COUNT.fullmatch(plain)) is not None:
        return check_spelled_count(m[2], m[1], reply)
    if _PRODUCT.fullmatch(plain) is not None:
        return check_multiplication(reply, evaluate)
    return None
