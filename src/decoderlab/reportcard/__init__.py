"""The report card of a recipe run: every stage's checkpoint scored greedily on the same held-out questions per
task, with the calculator off and on, written as ``report.md``, ``report.png`` and ``card.json`` in the run
directory (``decoderlab report RUN_DIR``; nanochat's ``report.md`` is the model: a column per stage, a row per
task).

A run directory holds the stages as checkpoints in sub-directories named ``STAGES`` (``base``, ``sft``,
``control``, ``rl``: those present are scored, in that order). The base model (no chat template) is asked the
question as text and its first line scored; a chat stage answers in its template, greedily, the calculator's
call token banned (tools off) or the calls run (tools on: :func:`decoderlab.chat.run_tool_turn`). Each reply is
scored by the task's reward (``number``: the last number; ``exact``: the reply itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .chat import TOOLS, chat_reply, load_model, run_tool_turn
from .reinforcement.rewards import load_reward
from .generation import generate
from .tasks import SKILLS, generate as questions

#: the stages a run may hold, in the card's order
STAGES = ("base", "sft", "control", "rl")
#: the card's rows: (skill, difficulty)
ROWS = (("addition", 3), ("subtraction", 3), ("addition", 4), ("subtraction", 4), ("multiplication", 2),
        ("multiplication", 3), ("first_letter", 2), ("last_letter", 2), ("letter_count", 1), ("letter_count", 3),
        ("backwards", 1), ("larger", 3), ("smallest", 2), ("big_multiplication", 4))
#: the prompt of the plain chat turn the card checks (text, not a tool call or a number)
STORY = "Tell me a story about the king."
#: the longest reply of each step, in tokens: a call to the calculator on two 4-digit numbers is about 30 BPE tokens
MAX_NEW_TOKENS = 48


class TaskReward:
    """The reward a task row names (``row["reward"]``: ``number`` or ``exact``), for RL on a mix of tasks."""

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
    """``"addition:4,multiplication:3"`` -> ``[("addition", 4), ("multiplication", 3)]``. Raises ValueError."""
    out = []
    for part in text.split(","):
        skill, _, d = part.strip().partition(":")
        if skill not in SKILLS or not d.isdigit() or int(d) not in SKILLS[skill].difficulties:
            raise ValueError(f"a row is skill:difficulty (such as addition:4), got {part!r}")
        out.append((skill, int(d)))
    return out


def held_out(questions_per_row: int, rows=ROWS) -> dict[tuple[str, int], list]:
    """The held-out questions of every row (seed 0: the same for every stage and every run)."""
    return {(s, d): questions(s, "held-out", questions_per_row, seed=0, difficulty=d) for s, d in rows}


def _score(item, reply: str, ended: bool) -> float:
    return load_reward(item.reward)(reply, {"reference": item.answer}, ended)


def _base_reply(model, tok, question: str) -> str:
    out = generate(model, tok.encode(question + "\n"), MAX_NEW_TOKENS, temperature=0, tokenizer=tok)
    return tok.decode(out).strip().split("\n")[0]


def _chat_answer(model, tok, template, question: str, tools: bool) -> tuple[str, bool, list]:
    """(reply, ended with an end of turn, the calls made) of a chat model, greedy."""
    messages = [{"role": "user", "content": question}]
    if tools:
        turn = run_tool_turn(model, tok, messages, template, TOOLS, temperature=0, max_new_tokens=MAX_NEW_TOKENS)
        return turn.content, turn.finish_reason == "stop", turn.calls
    ban = {template.tool_call_id(tok): -100.0} if template.has_tools else None
    info: dict = {}
    reply = chat_reply(model, messages, tok, template, temperature=0, max_new_tokens=MAX_NEW_TOKENS,
                       logit_bias=ban, info=info)
    return reply, info["ended_with_end_of_turn"], []


def score_stage(directory, questions_per_row: int = 50, rows=ROWS, tools: bool = False) -> dict:
    """One checkpoint on the held-out questions: ``{row label: {"accuracy", "ended", "called", "n"}}`` plus
    ``"story"`` (the reply to ``STORY`` and whether it is text: no call, not a number alone)."""
    model, tok, template, _ = load_model(directory)
    out = {}
    for (skill, d), items in held_out(questions_per_row, rows).items():
        right = ended = called = expression = 0
        replies = []
        for item in items:
            if template is None:
                reply, end, calls = _base_reply(model, tok, item.question), True, []
            else:
                reply, end, calls = _chat_answer(model, tok, template, item.question, tools and template.has_tools)
            right += _score(item, reply, end)
            replies.append(reply)
            ended += end
            called += bool(calls)
            # the first call computed the question's answer (the calculator's result is the reference)
            expression += bool(calls) and calls[0].result == item.answer
        out[row_label(skill, d)] = {"accuracy": right / len(items), "ended": ended / len(items),
                                    "called": called / len(items), "expression_right": expression / len(items), "n": len(items), "needs_tool": item.tool,
                                    "replies": replies}
    if template is not None:
        reply, _, calls = _chat_answer(model, tok, template, STORY, tools and template.has_tools)
        words = [w for w in reply.split() if any(c.isalpha() for c in w)]
        out["story"] = {"reply": reply, "text": not calls and len(words) >= 3}
    return out


def choose_weak(scores: dict, k: int = 2, low: float = 0.2, high: float = 0.8) -> list[tuple[str, int]]:
    """The ``k`` rows (not tool rows) whose accuracy is nearest 50% within [low, high] (else nearest 50% of
    all): where RL has the most to gain and enough right answers in a group to learn from."""
    rows = [(label, s["accuracy"]) for label, s in scores.items() if label != "story" and not s["needs_tool"]]
    inside = [r for r in rows if low <= r[1] <= high] or rows
    picked = sorted(inside, key=lambda r: abs(r[1] - 0.5))[:k]
    by_label = {row_label(s, d): (s, d) for s, d in ROWS}
    return [by_label[label] for label, _ in picked]


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


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _table(title: str, columns: list[str], scores: dict, key: str = "accuracy") -> list[str]:
    labels = [row_label(s, d) for s, d in ROWS if row_label(s, d) in scores[columns[0]]]
    lines = [f"### {title}", "", "| task | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(_pct(scores[c][label][key]) for c in columns) + " |")
    return lines + [""]


def _summary_rows(columns: list[str], scores: dict) -> list[str]:
    """The turn-ended rate (tools off), the calls on questions the model answers itself (tools on), and the
    plain chat turn."""
    lines = ["### Behaviour", "", "| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]

    def mean(c, rows_of, key):
        vals = [v[key] for k, v in scores[c].items() if k != "story" and rows_of(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    lines.append("| turn ended (tools off, all rows) | " + " | ".join(
        _pct(mean(c, lambda v: True, "ended")) for c in columns) + " |")
    lines.append("| no tool call on self-answerable rows (tools on) | " + " | ".join(
        _pct(1 - mean(c + " +calc", lambda v: not v["needs_tool"], "called")) if c + " +calc" in scores else "-"
        for c in columns) + " |")
    lines.append("| the call's expression right on tool rows (tools on) | " + " | ".join(
        _pct(mean(c + " +calc", lambda v: v["needs_tool"], "expression_right")) if c + " +calc" in scores else "-"
        for c in columns) + " |")
    lines.append("| story prompt answered with text | " + " | ".join(
        ("yes" if scores[c]["story"]["text"] else "no") if "story" in scores[c] else "-" for c in columns) + " |")
    return lines + [""]


def card_markdown(run_dir, scores: dict, stages: list[str], questions_per_row: int) -> str:
    chat = [s for s in stages if s != "base"]
    lines = [f"# Report card: {Path(run_dir).name}", "",
             f"Held-out questions ({questions_per_row} per row, the same for every stage), greedy; accuracy by the "
             f"task's reward (`number`: the reply's last number; `exact`: the reply).", ""]
    lines += _table("Tools off (the tool-call token banned)", stages, scores)
    if chat:
        lines += _table("Calculator on (the calls run, their results fed back)", [s + " +calc" for s in chat], scores)
    lines += _summary_rows(chat, scores) if chat else []
    for s in chat:
        lines.append(f"- story prompt, {s}: {scores[s]['story']['reply']!r:.200}")
    return "\n".join(lines) + "\n"


def card_figure(path, scores: dict, stages: list[str]) -> None:
    """report.png: held-out accuracy per task (rows) across the stages (bars), the calculator's on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row_label(s, d) for s, d in ROWS if row_label(s, d) in scores[stages[0]]]
    columns = stages + [s + " +calc" for s in stages if s + " +calc" in scores]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(columns)
    for j, c in enumerate(columns):
        ax.bar([i + j * width for i in range(len(labels))], [100 * scores[c][lb]["accuracy"] for lb in labels],
               width, label=c)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, ncol=4)
    ax.set_title("Report card: held-out accuracy per task, by stage")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(run_dir, *, questions: int = 50) -> dict:
    """Score every stage of ``run_dir`` (:func:`score_stage`, tools off, and on for the chat stages) and write
    ``report.md``, ``report.png`` and ``card.json`` there. Returns ``{"scores", "stages", "markdown"}``.

    Raises:
        FileNotFoundError: no such directory.  ValueError: not a recipe run (:func:`run_stages`).
    """
    if isinstance(questions, bool) or not isinstance(questions, int) or questions < 1:
        raise ValueError(f"questions must be an integer >= 1 (held-out questions per row), got {questions!r}")
    stages = run_stages(run_dir)
    run_dir = Path(run_dir)
    scores = {}
    for s in stages:
        scores[s] = score_stage(run_dir / s, questions)
        if s != "base":
            scores[s + " +calc"] = score_stage(run_dir / s, questions, tools=True)
    markdown = card_markdown(run_dir, scores, stages, questions)
    (run_dir / "report.md").write_text(markdown, encoding="utf-8")
    (run_dir / "card.json").write_text(json.dumps({"stages": stages, "questions": questions, "scores": scores},
                                                  indent=2), encoding="utf-8")
    card_figure(run_dir / "report.png", scores, stages)
    return {"scores": scores, "stages": stages, "markdown": markdown, "path": os.fspath(run_dir / "report.md")}
