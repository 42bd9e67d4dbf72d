"""Word problems: every answer is Python's arithmetic on the story's numbers, the calculator call the
conversation makes computes it, and one problem -- in any of its stories, or as the plain product it asks -- is
in one split only."""

import random

import pytest

from decoderlab.chat import calculate
from decoderlab.tasks import SKILLS, conversation, expression_of, generate, split_of
from decoderlab.tasks import words
from decoderlab.tasks.make import problem_of


def python_answer(a: int, b: int, op: str, c: int | None) -> int:
    return a * b if not op else (a * b + c if op == "+" else a * b - c)


@pytest.mark.parametrize("steps", words.STEPS)
def test_every_answer_is_pythons_arithmetic_on_the_storys_numbers_and_the_calculator_call_computes_it(steps):
    items = generate("word_problem", "train", 200, seed=3, difficulty=steps) + generate(
        "word_problem", "held-out", 100, seed=3, difficulty=steps)
    for item in items:
        a, b, op, c = words.parse(item.question)
        assert 10 <= a <= 99 and 10 <= b <= 99 and (op == "") == (steps == 1)
        assert int(item.answer) == python_answer(a, b, op, c) > 0
        call = conversation(item)[1]["tool_calls"][0]["function"]["arguments"]
        assert calculate(call) == item.answer == str(eval(expression_of(item.question)))  # noqa: S307 (our text)
    assert item.tool and item.reward == "number" and SKILLS["word_problem"].needs_tool


def test_the_issue_s_example_reads_back_to_its_numbers():
    q = "A box holds 24 pens; how many pens are in 17 boxes?"
    assert words.parse(q) == (24, 17, "", None) and expression_of(q) == "24 * 17"
    assert problem_of(q) == problem_of("What is 17 * 24?") == problem_of("What is 24 * 17?") == "17 * 24"
    assert words.parse("What is 24 * 17?") is None and expression_of("What is 24 * 17?") == "24 * 17"


def every_wording(a: int, b: int, op: str, c: int | None) -> list[str]:
    """The problem told in every story of its steps, with the factors either way round (and, one step, asked
    plainly)."""
    if not op:
        stories = [t.format(a=x, b=y) for t in words.ONE_STEP for x, y in ((a, b), (b, a))]
        return stories + [f"What is {a} * {b}?", f"What is {b} * {a}?"]
    return [t.format(a=x, b=y, c=c) for t, o in words.TWO_STEP if o == op for x, y in ((a, b), (b, a))]


@pytest.mark.parametrize("steps", words.STEPS)
def test_held_out_twins_never_cross_the_split(steps):
    held = generate("word_problem", "held-out", 100, seed=0, difficulty=steps)
    for item in held:
        assert {split_of(q) for q in every_wording(*words.parse(item.question))} == {"held-out"}
    train = generate("word_problem", "train", 400, seed=1, difficulty=steps)
    assert {problem_of(i.question) for i in held}.isdisjoint(problem_of(i.question) for i in train)
    if steps == 1:  # nor is a held-out story's product trained as a plain 2x2-digit question
        plain = generate("multiplication", "train", 1000, seed=2, difficulty=3)
        assert {problem_of(i.question) for i in held}.isdisjoint(problem_of(i.question) for i in plain)


def test_a_draw_of_another_number_of_steps_is_refused_by_value():
    with pytest.raises(ValueError, match="1 or 2 steps, got 3"):
        words.draw(random.Random(0), 3)
    with pytest.raises(ValueError, match="word_problem 1-2"):
        generate("word_problem", "train", 2, difficulty=3)
