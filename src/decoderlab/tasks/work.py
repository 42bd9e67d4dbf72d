"""Answers that show their work, and the program that checks every line of it.

Four forms, each written so that a line is one small step a program can check on its own:

* a sum or a difference column by column, the units first (Lee et al. 2023: the digits in the order a carry
  travels let a small model add digit by digit instead of guessing the carry ahead), each line one column's
  digits with the carry (or borrow) that came in, the column's result, and after the comma the digits found
  so far (the result then the digits before it, so the last line holds the answer to copy)::

      What is 847 + 585? Show your work.
      7 + 5 + 0 = 12, 12
      4 + 8 + 1 = 13, 132
      8 + 5 + 1 = 14, 1432
      Answer: 1432

  a difference borrows by writing the column's top digit plus ten (``12 - 7 - 0 = 5``), and the next column
  takes the 1 away::

      What is 532 - 187? Show your work.
      12 - 7 - 0 = 5, 5
      13 - 8 - 1 = 4, 45
      5 - 1 - 1 = 3, 345
      Answer: 345

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
_SUM = re.compile(r"What is (\d+) ([-+]) (\d+)\?")
_COLUMN = re.compile(r"(\d+) ([-+]) (\d) \2 ([01]) = (\d+), (\d+)")


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


def column_work(a: int, op: str, b: int) -> str:
    """The scratchpad of ``a + b`` or ``a - b`` (``op`` ``"+"`` or ``"-"``; ``a >= b >= 0`` for a difference):
    one line per column of the longer number, the units first, ``x op y op c = r, digits`` (``c`` the carry or
    borrow the column takes in; a borrowing column's ``x`` is its digit plus ten; ``digits`` the result's
    digits from this column down, :func:`column_lines`), then ``Answer: a op b``. Raises ``ValueError`` for
    another op, a negative number, or a difference below zero."""
    lines = [f"{x} {op} {y} {op} {c} = {r}, {digits}" for x, y, c, r, digits in column_lines(a, op, b)]
    return "\n".join(lines + [f"{ANSWER}{a + b if op == '+' else a - b}"])


def column_lines(a: int, op: str, b: int) -> list[tuple[int, int, int, int, str]]:
    """The columns of :func:`column_work`, units first: ``(x, y, c, r, digits)`` -- ``x`` a's digit (plus ten
    where a difference borrows), ``y`` b's digit (0 past its length), ``c`` the carry or borrow in, ``r`` the
    column's result (a sum's may be 10-19: its tens are the next carry), ``digits`` ``r`` then the last k
    digits of the line before (k: the columns before)."""
    if op not in ("+", "-") or a < 0 or b < 0 or (op == "-" and a < b):
        raise ValueError(f"column_work takes a + b or a - b of whole numbers >= 0 with a >= b for a difference; "
                         f"got {a} {op} {b}")
    n = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(n)[::-1], str(b).zfill(n)[::-1]
    out, c, digits = [], 0, ""
    for k in range(n):
        x, y = int(xs[k]), int(ys[k])
        if op == "+":
            r, nxt = x + y + c, int(x + y + c >= 10)
        else:
            x += 10 * (x - y - c < 0)
            r, nxt = x - y - c, int(x >= 10)
        digits = str(r) + (digits[-k:] if k else "")
        out.append((x, y, c, r, digits))
        c = nxt
    return out


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


def check_columns(a: int, op: str, b: int, reply: str, evaluate: Callable[[str], str]) -> WorkCheck:
    """:func:`column_work`'s lines checked one at a time: column k's line true when its digits are the
    question's (``x`` a's digit, or it plus ten in a difference), its carry or borrow is the one the line
    before passes on (a sum's result 10 or more, a difference's ``x`` 10 or more; 0 for the first), its
    result is ``evaluate("x op y op c")`` and a single digit where a difference or a column left of it needs
    one, and its digits are the result then the line before's last k; the ``Answer:`` line true when every
    column came before it and it is the last line's digits as a number. Each line is checked against the one
    before as written, so a slip is one false line, not every line after it. A line past the last column, or
    in no form, is false."""
    lines, false, k, prev = _lines(reply), 0, 0, None
    n = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(n)[::-1], str(b).zfill(n)[::-1]
    for line in lines:
        if line.startswith(ANSWER):
            false += k < n or prev is None or _answer_line(line) != int(prev[4]) or line[len(ANSWER):] != \
                str(int(prev[4]))
            continue
        m = _COLUMN.fullmatch(line)
        ok = m is not None and m[2] == op and k < n
        if ok:
            x, y, c, r, digits = int(m[1]), int(m[3]), int(m[4]), int(m[5]), m[6]
            carry = 0 if prev is None else int(prev[3] >= 10 if op == "+" else prev[0] >= 10)
            ok = (x % 10 == int(xs[k]) and (op == "-" or x < 10) and y == int(ys[k]) and c == carry
                  and evaluate(f"{x} {op} {y} {op} {c}") == m[5] and (op == "+" or r < 10)
                  and digits == m[5] + (prev[4][-k:] if k else ""))
            prev = (x, y, c, r, digits)  # the next line is checked against this one as written: one slip, one line
        false += not ok
        k += 1
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
    if (m := _SUM.fullmatch(plain)) is not None:
        return check_columns(int(m[1]), m[2], int(m[3]), reply, evaluate)
    return None
