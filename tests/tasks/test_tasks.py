"""The checkable tasks: each generator deterministic for a seed, its references right (against Python's own
arithmetic and str methods), the train and held-out splits disjoint by construction, the rows fine-tuning and
RL read, and every bad input one ValueError (one `decoderlab: error:` line on the command line)."""

import json
import re
import subprocess
import sys

import pytest

from decoderlab.chat import calculate, check_messages, evaluate
from decoderlab.tasks import (FAMILIES, HELD_OUT_SHARE, SKILLS, conversation, corpus_words, generate, row,
                              split_of, task_names, write_rows)
from decoderlab.tasks.work import check_work, countdown_of

NUM = r"(\d+)"


def reference(question: str) -> str:
    """The answer recomputed from the question's text alone, with Python's arithmetic and str methods (the
    final answer of a question that shows its work; a countdown question has many)."""
    question = question.removesuffix(" Show your work.")
    if m := re.fullmatch(rf"What is {NUM} ([-+*]) {NUM}\?", question):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str({"+": a + b, "-": a - b, "*": a * b}[op])
    if m := re.fullmatch(r"How many times does the letter ([a-z]) appear in ([a-z]+)\?", question):
        return str(m[2].count(m[1]))
    if m := re.fullmatch(r"Spell ([a-z]+) backwards\.", question):
        return "".join(reversed(m[1]))
    if m := re.fullmatch(r"What is the (first|last) letter of ([a-z]+)\?", question):
        return m[2][0] if m[1] == "first" else m[2][-1]
    if m := re.fullmatch(rf"Which is larger, {NUM} or {NUM}\?", question):
        return str(max(int(m[1]), int(m[2])))
    if m := re.fullmatch(r"What is the smallest of ([\d, ]+)\?", question):
        return str(min(int(x) for x in m[1].split(", ")))
    if question.startswith(("A ", "Each ")):  # a word problem: a group's size, the groups, then loose ones
        n = [int(x) for x in re.findall(NUM, question)]
        away = any(w in question for w in ("gives away", "sells"))
        return str(n[0] * n[1] + (0 if len(n) == 2 else -n[2] if away else n[2]))
    raise AssertionError(f"no reference for {question!r}")


@pytest.mark.parametrize("skill", list(SKILLS))
def test_each_skill_is_seeded_right_and_in_its_split(skill):
    for split in ("train", "held-out"):
        items = generate(skill, split, 300, seed=3)
        assert items == generate(skill, split, 300, seed=3)
        assert items != generate(skill, split, 300, seed=4)
        assert len({i.question for i in items}) == len(items)  # unique
        for i in items:
            if skill == "countdown":  # the reference is one solution: every line true, the target reached
                assert check_work(i.question, i.answer, evaluate).solved
            else:
                final = i.answer.split("\n")[-1].removeprefix("Answer: ")
                assert final == reference(i.question)
            assert i.split == split == split_of(i.question)
            assert i.skill == skill and i.difficulty in SKILLS[skill].difficulties
            assert i.reward == ("exact" if skill in ("backwards", "first_letter", "last_letter") else
                                "countdown" if skill == "countdown" else "number")
            assert 0 < SKILLS[skill].chance(i.question) <= 0.5


@pytest.mark.parametrize("difficulty,digits", [(1, 1), (2, 2), (3, 3), (4, 4)])
def test_difficulty_is_the_number_of_digits(difficulty, digits):
    for i in generate("addition", "train", 50, difficulty=difficulty):
        a, b = re.findall(r"\d+", i.question)
        assert len(a) == len(b) == digits


def test_the_splits_share_no_question_whatever_the_seeds():
    n = 10_000  # (40,000 took ~15 s of the suite; the split is a hash of the question, as the share below shows)
    train = {i.question for i in generate("arithmetic", "train", n, seed=1)}
    held = {i.question for i in generate("arithmetic", "held-out", n, seed=2)}
    assert len(train) == len(held) == n and not train & held
    # the split is the question's hash: about HELD_OUT_SHARE of all questions are held out
    everything = [f"What is {a} + {b}?" for a in range(100) for b in range(100)]
    share = sum(split_of(q) == "held-out" for q in everything) / len(everything)
    assert abs(share - HELD_OUT_SHARE) < 0.02


def test_a_small_split_gives_what_it_has():
    items = generate("addition", "held-out", 500, difficulty=1)
    everything = {f"What is {a} + {b}?" for a in range(10) for b in range(10)}
    assert {i.question for i in items} == {q for q in everything if split_of(q) == "held-out"}


def test_families_mix_their_skills_and_tool_questions_call_the_calculator():
    assert set(task_names()) == set(FAMILIES) | set(SKILLS)
    items = generate("spelling", "train", 40)
    assert {i.skill for i in items} == set(FAMILIES["spelling"])
    assert all(w.isalpha() and w.islower() and len(w) >= 3 for w in corpus_words())
    for item in generate("tool", "train", 20):
        conv = conversation(item)
        check_messages(conv)
        args = json.loads(conv[1]["tool_calls"][0]["function"]["arguments"])
        assert calculate(args) == conv[2]["content"] == conv[3]["content"] == item.answer
    plain = conversation(generate("addition", "train", 1)[0])
    assert [m["role"] for m in plain] == ["user", "assistant"]


def test_rows_for_finetune_and_rl(tmp_path):
    items = generate("comparison", "train", 10)
    assert write_rows(items, tmp_path / "c.jsonl") == 10
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert rows[0] == row(items[0]) and rows[0]["messages"][1]["content"] == items[0].answer
    p = row(items[0], "prompts")
    assert p["messages"] == [{"role": "user", "content": items[0].question}] and p["reference"] == items[0].answer
    pair = row(items[0], "pairs")
    assert pair["chosen"] == items[0].answer and pair["rejected"] != pair["chosen"]
    assert all(row(i, "pairs")["rejected"] != i.answer for i in generate("arithmetic", "train", 200)
               + generate("spelling", "train", 200))
    from decoderlab.reinforcement import load_prompts, load_reward

    write_rows(items, tmp_path / "p.jsonl", "prompts")
    assert len(load_prompts(tmp_path / "p.jsonl", load_reward("number"))) == 10


@pytest.mark.parametrize("kwargs,message", [
    (dict(task="algebra"), "unknown task 'algebra'; tasks: arithmetic, spelling"),
    (dict(task="addition", difficulty=5), "difficulty 5 is out of range for task 'addition' (addition 1-4)"),
    (dict(task="addition", difficulty=0), "difficulty 0 is out of range"),
    (dict(task="addition", n=0), "n must be a positive integer"),
    (dict(task="addition", n=-3), "n must be a positive integer .* got -3"),
    (dict(task="addition", split="test"), "unknown split 'test'; splits: train, held-out"),
])
def test_bad_input_is_named(kwargs, message):
    kwargs = {"split": "train", "n": 5, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate(kwargs.pop("task"), **kwargs)


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "decoderlab.cli", "tasks", "make", *args], capture_output=True,
                          text=True, cwd=cwd)


def test_the_command_writes_rows(tmp_path):
    r = run_cli("--task", "arithmetic", "--split", "train", "--n", "50", "--out", str(tmp_path / "a.jsonl"))
    assert r.returncode == 0 and "wrote 50 chat rows" in r.stdout
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r_["messages"][0]["content"] for r_ in rows] == [i.question for i in generate("arithmetic", "train", 50)]
    r = run_cli("--task", "tool", "--n", "3", "--format", "prompts", "--out", str(tmp_path / "p.jsonl"))
    assert r.returncode == 0 and all("reference" in json.loads(x) for x in (tmp_path / "p.jsonl").read_text().split("\n")[:3])


@pytest.mark.parametrize("args,message", [
    (["--task", "algebra", "--n", "3"], "unknown --task 'algebra'; tasks: arithmetic"),
    (["--task", "addition", "--n", "3", "--difficulty", "7"], "--difficulty 7 is out of range"),
    (["--task", "addition", "--n", "0"], "--n must be a positive integer (the number of items), got 0"),
    (["--task", "addition", "--n", "-1"], "--n must be a positive integer (the number of items), got -1"),
    (["--task", "addition", "--n", "3", "--split", "validation"], "unknown --split 'validation'; splits: train"),
])
def test_bad_input_is_one_error_line(tmp_path, args, message):
    r = run_cli(*args, "--out", str(tmp_path / "x.jsonl"))
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("decoderlab: error: ") and message in line
