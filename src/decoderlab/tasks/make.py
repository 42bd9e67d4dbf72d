"""Items of a task, split into train and held-out by a hash of the question, and the rows fine-tuning and RL read.

The split is a property of the problem a question asks, not of the seed: a question is held out when the first
8 bytes of the BLAKE2b hash of its problem (:func:`problem_of`), read as a number, fall in the lowest
``HELD_OUT_SHARE`` of their range. The problem is the question with what does not change its answer taken out --
the order of a sum's or a product's terms, of the numbers to compare or to make a countdown target from, and
" Show your work." -- so ``What is 3 + 5?`` and ``What is 5 + 3? Show your work.`` are one problem, in one
split; a word problem is its numbers whatever the story (:func:`decoderlab.tasks.words.problem_key`), so
"A box holds 24 pens; how many pens are in 17 boxes?" and ``What is 17 * 24?`` are one problem too. A generator
draws questions from its seeded ``random.Random`` and keeps those of the split asked for, so no held-out problem
is ever trained on, in any of its forms, whatever the seeds of the two files. Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import asdict, dataclass
from typing import Iterator

from . import words
from .skills import FAMILIES, SKILLS, Skill
from .work import WORK_SUFFIX

SPLITS = ("train", "held-out")
#: the share of every skill's questions that is held out
HELD_OUT_SHARE = 0.2
#: the name of the built-in tool the tool skill's conversations call, and its argument
CALCULATOR = "calculator"
FORMATS = ("chat", "prompts", "pairs")
#: draws without a new question of the split before a generator says the skill has no more
_MAX_MISSES = 10_000


@dataclass(frozen=True)
class Item:
    """One question: ``question`` (the user's message), ``answer`` (the reference, text), ``skill``,
    ``difficulty``, ``reward`` (the registered reward name: ``number`` or ``exact``), ``split``, and whether
    the answer goes through the calculator (``tool``)."""

    question: str
    answer: str
    skill: str
    difficulty: int
    reward: str
    split: str
    tool: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


#: (pattern, the problem it asks): questions whose answer does not change with the order of some of their numbers
_TWINS = ((re.compile(r"What is (\d+) ([+*]) (\d+)\?"), lambda m: f" {m[2]} ".join(_sorted(m[1], m[3]))),
          (re.compile(r"Which is larger, (\d+) or (\d+)\?"), lambda m: "larger " + " ".join(_sorted(m[1], m[2]))),
          (re.compile(r"What is the smallest of (\d+(?:, \d+)+)\?"),
           lambda m: "smallest " + " ".join(_sorted(*m[1].split(", ")))),
          (re.compile(r"Make (\d+) from (\d+(?:, \d+)+)\."),
           lambda m: f"make {m[1]} from " + " ".join(_sorted(*m[2].split(", ")))))


def _sorted(*numbers: str) -> list[str]:
    return sorted(numbers, key=int)


def problem_of(question: str) -> str:
    """The problem ``question`` asks: without " Show your work." and with the numbers whose order does not
    matter sorted (``What is 5 + 3?`` -> ``3 + 5``); any other question is its own problem."""
    q = question.removesuffix(WORK_SUFFIX)
    if (story := words.problem_key(q)) is not None:  # a word problem: its numbers, whatever the story
        return story
    for pattern, key in _TWINS:
        m = pattern.fullmatch(q)
        if m is not None:
            return key(m)
    return q


def split_of(question: str) -> str:
    """``"held-out"`` or ``"train"``: the split a question belongs to, by the hash of its problem
    (:func:`problem_of`; see the module docstring)."""
    h = int.from_bytes(hashlib.blake2b(problem_of(question).encode("utf-8"), digest_size=8).digest(), "big")
    return "held-out" if h < HELD_OUT_SHARE * 2 ** 64 else "train"


def task_names() -> list[str]:
    """Every name ``--task`` takes: the families (``arithmetic`` ...) then the skills (``addition`` ...)."""
    return list(FAMILIES) + list(SKILLS)


def skills_of(task: str) -> list[Skill]:
    """The skills of a task name (a family or one skill). Raises ``ValueError`` naming the known names."""
    if task in FAMILIES:
        return [SKILLS[s] for s in FAMILIES[task]]
    if task in SKILLS:
        return [SKILLS[task]]
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(task_names())}")


def _check(task: str, split: str, n: int, difficulty: int | None) -> list[Skill]:
    skills = skills_of(task)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer (the number of items), got {n!r}")
    if difficulty is not None:
        allowed = sorted(set().union(*(s.difficulties for s in skills)))
        bad = [s.name for s in skills if difficulty not in s.difficulties]
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or bad:
            ranges = "; ".join(f"{s.name} {s.difficulties[0]}-{s.difficulties[-1]}" for s in skills)
            raise ValueError(f"difficulty {difficulty!r} is out of range for task {task!r} ({ranges}); allowed "
                             f"for every skill of it: {sorted(set.intersection(*(set(s.difficulties) for s in skills))) or allowed}")
    return skills


def generate(task: str, split: str = "train", n: int = 100, *, seed: int = 0, difficulty: int | None = None,
             unique: bool = True) -> list[Item]:
    """``n`` items of ``task`` (a family: its skills in turn; or one skill) from ``split``, seeded.

    Args:
        task: a family (``arithmetic``, ``spelling``, ``comparison``, ``tool``) or a skill
            (``addition`` ... :func:`task_names`).
        split: ``"train"`` or ``"held-out"`` (disjoint by :func:`split_of`).
        n: how many items (>= 1).
        seed: the seed of the draws (the same seed, the same items).
        difficulty: one value of the knob for every skill; None: each item a difficulty drawn from the skill's
            range (a mix, easiest to hardest).
        unique: no question twice (a skill with fewer questions in the split than asked then gives what it has,
            e.g. 1-digit addition).

    Raises:
        ValueError: an unknown task or split (listing the known ones), ``n`` < 1, a difficulty outside a skill's
            range (naming the ranges).
    """
    skills = _check(task, split, n, difficulty)
    rng = random.Random(f"{task}:{split}:{seed}:{difficulty}")
    out, seen, misses = [], set(), {s.name: 0 for s in skills}
    live = list(skills)
    while len(out) < n and live:
        skill = live[len(out) % len(live)]
        d = difficulty if difficulty is not None else rng.choice(skill.difficulties)
        q, a = skill.draw(rng, d)
        if split_of(q) != split or (unique and q in seen):
            misses[skill.name] += 1
            if misses[skill.name] > _MAX_MISSES:  # this skill has no more questions of the split
                live.remove(skill)
            continue
        misses[skill.name] = 0
        seen.add(q)
        out.append(Item(q, a, skill.name, d, skill.reward, split, skill.needs_tool))
    return out


def expression_of(question: str) -> str:
    """The calculator expression a question asks for: a word problem's (:func:`decoderlab.tasks.words.expression_of`:
    ``"24 * 17 - 35"``), else the arithmetic of ``What is EXPRESSION?``."""
    story = words.expression_of(question)
    return story if story is not None else question.removeprefix("What is ").rstrip("?")


def calculator_call(item: Item, call_id: str = "call_0") -> dict:
    """The assistant message that answers ``item`` by calling the calculator (OpenAI's ``tool_calls`` shape) on
    :func:`expression_of` its question."""
    expression = expression_of(item.question)
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": CALCULATOR, "arguments": json.dumps({"expression": expression})}}]}


def conversation(item: Item) -> list[dict]:
    """The conversation that teaches ``item``: the question and the answer, or -- for a question that needs
    the tool -- the question, a calculator call, its result and then the answer (the ``tools`` template)."""
    user = {"role": "user", "content": item.question}
    if not item.tool:
        return [user, {"role": "assistant", "content": item.answer}]
    return [user, calculator_call(item), {"role": "tool", "tool_call_id": "call_0", "content": item.answer},
            {"role": "assistant", "content": item.answer}]


def wrong_answer(item: Item) -> str:
    """A wrong answer to ``item`` (the rejected reply of a preference pair), derived from the question's hash:
    a number off by 1 to 10, a word with two letters swapped or another letter."""
    h = hashlib.blake2b(item.question.encode("utf-8"), digest_size=4).digest()[0]
    if item.reward == "number":
        return str(int(item.answer) + (1 + h % 10) * (1 if h % 2 else -1))
    a = item.answer
    if len(a) > 1 and a != a[::-1]:
        return a[::-1] if len(a) > 2 else a[1] + a[0]
    return "z" if a != "z" else "a"


def row(item: Item, fmt: str = "chat") -> dict:
    """One JSONL row: ``chat`` -- ``{"messages": conversation}`` for ``finetune``; ``prompts`` --
    ``{"messages": [question], "reference", "reward", ...}`` for ``rl`` (the reward reads ``reference``);
    ``pairs`` -- TRL's ``{"prompt", "chosen", "rejected"}`` for ``finetune --method dpo`` (the rejected reply
    :func:`wrong_answer`). A prompt row also carries the item's skill, difficulty and split (the other two
    formats take no extra keys)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    meta = {"skill": item.skill, "difficulty": item.difficulty, "split": item.split}
    if fmt == "chat":
        return {"messages": conversation(item)}
    if fmt == "pairs":
        return {"prompt": item.question, "chosen": item.answer, "rejected": wrong_answer(item)}
    return {"messages": [{"role": "user", "content": item.question}], "reference": item.answer,
            "reward": item.reward, "tool": item.tool, **meta}


def iter_rows(items, fmt: str = "chat") -> Iterator[dict]:
    for item in items:
        yield row(item, fmt)


def write_rows(items, path: str | os.PathLike, fmt: str = "chat") -> int:
    """Write ``items`` as JSONL rows (:func:`row`) to ``path``; the number of rows."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in iter_rows(items, fmt):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n
