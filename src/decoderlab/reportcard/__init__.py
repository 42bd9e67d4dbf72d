"""The report card of a recipe run: every stage's checkpoint scored on the same held-out questions per task --
greedy with the calculator off and on, and k sampled replies per question for the chat stages -- written as
``report.md``, ``report.png`` and ``card.json`` in the run directory (``decoderlab report RUN_DIR``; nanochat's
``report.md`` is the model: a column per stage, a row per task). Every number carries its 95% interval and every
stage-to-stage difference its paired interval, so a gain can be told from noise; ``card.json`` keeps each
question's outcome, so any comparison can be recomputed.

A run directory holds the stages as checkpoints in sub-directories named ``STAGES`` (``base``, ``sft``,
``control``, ``rl``: those present are scored, in that order). The base model (no chat template) is asked the
question as text and its first line scored; a chat stage answers in its template.

    scoring.py  one checkpoint on one row's questions, batched: greedy (calculator off and on) and sampled
    card.py     the numbers and tables from card.json's per-question outcomes
    stats.py    Wilson and paired intervals, McNemar, the paired bootstrap, pass@k (pure Python)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config.defaults import REPORT_QUESTIONS, REPORT_SAMPLES
from ..files import atomic_write_text
from ..reinforcement.rewards import load_reward
from ..tasks import SKILLS, generate as questions
from . import card as cards
from .scoring import STORY, Checkpoint, score_row, story

__all__ = ["QUESTIONS", "ROWS", "SAMPLES", "STAGES", "STORY", "TaskReward", "choose_rl_rows", "held_out",
           "parse_rows", "parse_stages", "report", "row_label", "run_stages", "score_stage"]

#: the stages a run may hold, in the card's order
STAGES = ("base", "sft", "control", "rl")
#: the card's rows: (skill, difficulty); 3-digit sums and differences asked with " Show your work." (the form the
#: recipe teaches) and scored on their answer line
ROWS = (("addition_work", 3), ("subtraction_work", 3), ("addition", 4), ("subtraction", 4), ("multiplication", 2),
        ("multiplication_work", 2), ("multiplication_work", 3), ("first_letter", 2), ("last_letter", 2),
        ("letter_count", 1), ("letter_count", 3), ("letter_count_work", 3), ("backwards", 1), ("larger", 3),
        ("smallest", 2), ("countdown", 1), ("countdown", 2), ("big_multiplication", 4))
#: held-out questions per row and sampled replies per question (``decoderlab.config.defaults``)
QUESTIONS, SAMPLES = REPORT_QUESTIONS, REPORT_SAMPLES


class TaskReward:
    """The reward a task row names (``row["reward"]``: ``number``, ``exact`` or ``countdown``), for RL on a mix
    of tasks."""

    name = "task"
    fields = ("reference", "reward")

    def __init__(self):
        self._rewards = {}

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        name = row["reward"]
        if name not in self._rewards:
            self._rewards[name] = load_reward(name)
        return self._rewards[name](reply, row, ended)


def row_label(skill: str, difficulty: int) -> str:
    return f"{skill} {SKILLS[skill].describe(difficulty)}"


def parse_rows(text: str) -> list[tuple[str, int]]:
    """``"addition:4,countdown:1"`` -> ``[("addition", 4), ("countdown", 1)]``. Raises ValueError naming the
    part and the skills and difficulties allowed."""
    out = []
    for part in text.split(","):
        skill, _, d = part.strip().partition(":")
        if skill not in SKILLS or not d.isdigit() or int(d) not in SKILLS[skill].difficulties:
            known = ", ".join(f"{s} ({'/'.join(map(str, v.difficulties))})" for s, v in SKILLS.items())
            raise ValueError(f"a row is skill:difficulty (such as addition:4), got {part.strip()!r}; skills "
                             f"(difficulties): {known}")
        out.append((skill, int(d)))
    return out


def held_out(questions_per_row: int, rows=ROWS) -> dict[tuple[str, int], list]:
    """The held-out questions of every row (seed 0: the same for every stage and every run; a row whose split
    holds fewer gives all it has)."""
    return {(s, d): questions(s, "held-out", questions_per_row, seed=0, difficulty=d) for s, d in rows}


def score_stage(directory, questions_per_row: int = QUESTIONS, rows=ROWS, samples: int = SAMPLES, *,
                items: dict | None = None) -> dict:
    """One checkpoint on the rows' questions (``items``: ``{(skill, difficulty): [Item]}``, default the held-out
    ones): ``{"rows": {label: score_row's dict}, "story": ...}``."""
    ck = Checkpoint.load(directory)
    items = items if items is not None else held_out(questions_per_row, rows)
    return {"rows": {row_label(s, d): score_row(ck, s, its, samples) for (s, d), its in items.items()},
            "story": story(ck)}


def run_stages(run_dir) -> list[str]:
    """The stages a run directory holds (a checkpoint's ``config.json`` in ``run_dir/STAGE``). Raises
    ``ValueError`` when it holds none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    found = [s for s in STAGES if (run_dir / s / "config.json").is_file()]
    if not found:
        raise ValueError(f"{run_dir} is not a recipe run: it holds none of the stage checkpoints "
                         f"{', '.join(s + '/' for s in STAGES)} (bench/recipe.py writes them)")
    return found


def parse_stages(text: str, run_dir) -> list[str]:
    """``"sft,rl"`` -> the stages to score, in the card's order. Raises ValueError for a name that is not a
    stage, or a stage the run does not hold (naming those it holds)."""
    held = run_stages(run_dir)
    asked = [s.strip() for s in text.split(",")]
    for s in asked:
        if s not in STAGES:
            raise ValueError(f"unknown stage {s!r}; stages: {', '.join(STAGES)}")
        if s not in held:
            raise ValueError(f"{run_dir} holds no {s} stage ({s}/config.json); it holds: {', '.join(held)}")
    return [s for s in STAGES if s in asked]


def choose_rl_rows(scores: dict, items: dict, k: int = 2, samples: int = SAMPLES, tokenizer=None) -> list[tuple]:
    """The ``k`` rows with the most room for RL in one stage's ``score_stage`` (with samples): pass@samples
    above both its pass@1 and a uniform guess's pass@samples (:func:`card.row_numbers`), among rows that are
    not tool rows and whose reference answers take more than one token on average (``tokenizer``; characters
    without one) -- where sampling finds right answers greedy decoding does not give, and a guess would not."""
    card = card_of({"sft": scores}, items, ["sft"], samples)
    nums = cards.numbers(card)
    ranked = []
    for (skill, d), its in items.items():
        label = row_label(skill, d)
        size = [len(tokenizer.encode(i.answer)) if tokenizer else len(i.answer) for i in its]
        if SKILLS[skill].needs_tool or sum(size) / len(size) <= 1:
            continue
        ranked.append((nums[label]["stages"]["sft"]["room"], (skill, d)))
    return [row for _, row in sorted(ranked, key=lambda r: -r[0])[:k]]


def card_of(scores: dict, items: dict, stages: list[str], samples: int, questions_per_row: int | None = None) -> dict:
    """card.json's content: the rows (their questions, answers and a guess's chance per question) and every
    stage's per-question outcomes."""
    rows = [{"label": row_label(s, d), "skill": s, "difficulty": d, "n": len(its), "needs_tool": SKILLS[s].needs_tool,
             "work": SKILLS[s].work, "questions": [i.question for i in its], "answers": [i.answer for i in its],
             "chance": [SKILLS[s].chance(i.question) for i in its]} for (s, d), its in items.items()]
    return {"stages": stages, "questions": questions_per_row, "samples": samples, "rows": rows,
            "scores": {st: scores[st]["rows"] for st in stages},
            "story": {st: scores[st].get("story") for st in stages}}


def report(run_dir, *, questions: int = QUESTIONS, samples: int = SAMPLES, rows=ROWS, stages=None,
           scored: dict | None = None) -> dict:
    """Score every stage of ``run_dir`` (or ``stages``) on ``questions`` held-out questions per row, greedy and
    (chat stages) ``samples`` sampled replies per question, and write ``report.md``, ``report.png`` and
    ``card.json`` there. ``scored``: stages already scored the same way (:func:`score_stage`), not scored again.
    Returns ``{"card", "numbers", "markdown", "path"}``.

    Raises:
        FileNotFoundError: no such directory.  ValueError: not a recipe run (:func:`run_stages`); questions or
        samples not an integer >= 1 (samples may be 0: no sampling); a stage the run does not hold.
    """
    for name, value, low in (("questions", questions, 1), ("samples", samples, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            what = "held-out questions per row" if low else "sampled replies per question"
            raise ValueError(f"{name} must be an integer >= {low} ({what}), got {value!r}")
    held = run_stages(run_dir)
    stages = [s for s in STAGES if s in (stages or held)]
    if missing := [s for s in stages if s not in held]:
        raise ValueError(f"{run_dir} holds no {', '.join(missing)} stage; it holds: {', '.join(held)}")
    run_dir, items = Path(run_dir), held_out(questions, rows)
    scores = dict(scored or {})
    for s in stages:
        if s not in scores:
            scores[s] = score_stage(run_dir / s, questions, rows, samples, items=items)
    card = card_of(scores, items, stages, samples, questions)
    markdown = cards.markdown(card, run_dir.name)
    atomic_write_text(run_dir / "report.md", markdown)
    atomic_write_text(run_dir / "card.json", json.dumps(card))
    cards.figure(run_dir / "report.png", card)
    return {"card": card, "numbers": cards.numbers(card), "markdown": markdown, "path": os.fspath(run_dir / "report.md")}
