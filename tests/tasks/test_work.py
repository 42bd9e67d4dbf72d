"""Answers that show their work: every line of every reference checked true by a program (the calculator's
evaluator doing the arithmetic), a false line found and counted while the final answer still scores, countdown's
solutions and a guess's chance against brute force, and twins -- a + b and b + a, a question and its " Show
your work." form, the same numbers in another order -- never on both sides of the split."""

import itertools
import random

import pytest

from decoderlab.chat import evaluate
from decoderlab.reinforcement.rewards import load_reward
from decoderlab.tasks import SKILLS, generate, split_of
from decoderlab.tasks.make import problem_of
from decoderlab.tasks.work import (check_work, countdown_chance, countdown_of, countdown_results, countdown_solutions,
                                   multiplication_work, spelled_count)

WORK = [s for s in SKILLS if SKILLS[s].work]


@pytest.mark.parametrize("skill", WORK)
def test_every_line_of_every_reference_is_true(skill):
    for d in SKILLS[skill].difficulties:
        for item in generate(skill, "train", 150, seed=5, difficulty=d):
            checked = check_work(item.question, item.answer, evaluate)
            assert checked is not None and checked.false == 0 and checked.lines >= 1, (item.question, item.answer)
            row = {"reference": item.answer, "messages": [{"role": "user", "content": item.question}]}
            assert load_reward(item.reward)(item.answer, row, True) == 1.0


def test_the_forms_by_hand():
    assert multiplication_work(47, 8) == "7 * 8 = 56\n40 * 8 = 320\n56 + 320 = 376\nAnswer: 376"
    assert multiplication_work(12, 34).split("\n") == [
        "2 * 4 = 8", "10 * 4 = 40", "2 * 30 = 60", "10 * 30 = 300", "8 + 40 = 48", "48 + 60 = 108",
        "108 + 300 = 408", "Answer: 408"]
    assert spelled_count("excellence", "e") == "e1-x-c-e2-l-l-e3-n-c-e4\nAnswer: 4"
    assert spelled_count("king", "z") == "k-i-n-g\nAnswer: 0"


@pytest.mark.parametrize("question,reply,false", [
    # a right final number after a false line: scored right by the reward, the false line counted
    ("What is 47 * 8? Show your work.", "7 * 8 = 56\n40 * 8 = 330\n56 + 320 = 376\nAnswer: 376", 1),
    ("What is 47 * 8? Show your work.", "7 * 8 = 56\n40 * 8 = 320\n56 + 320 = 376\nAnswer: 376", 0),
    ("What is 47 * 8? Show your work.", "7 * 8 = 56\nforty\nAnswer: 376", 2),  # not a line of the form; answer
    ("How many times does the letter e appear in excellence? Show your work.",  # misspelt, the count right
     "e1-x-c-e2-l-e3-n-c-e4\nAnswer: 4", 1),
    ("How many times does the letter e appear in excellence? Show your work.", "e1-x-c-e2-l-l-e3-n-c-e4\nAnswer: 3", 1),
])
def test_a_false_line_is_counted_and_the_final_answer_still_scores(question, reply, false):
    checked = check_work(question, reply, evaluate)
    assert checked.false == false
    reference = "376" if "47" in question else "4"
    right = load_reward("number")(reply, {"reference": reference}, True)
    assert right == float(reply.endswith(reference))


def test_countdown_checks_each_step_and_the_numbers_it_uses():
    q = "Make 27 from 5, 8, 9."
    assert countdown_of(q) == ([5, 8, 9], 27)
    ok = check_work(q, "8 - 5 = 3\n3 * 9 = 27", evaluate)
    assert ok.solved and ok.false == 0 and ok.lines == 2
    for reply, false in [("8 - 5 = 3\n3 * 9 = 28", 1),   # a wrong product
                         ("8 - 5 = 3\n3 * 3 = 9", 1),     # 3 used twice: it has one 3
                         ("9 * 3 = 27", 1),               # no 3 to start with
                         ("8 + 5 = 13\n13 + 9 = 22", 0),  # true lines, another number reached
                         ("5 - 8 = -3\n9 * 3 = 27", 2)]:  # not a positive number (not even the form)
        checked = check_work(q, reply, evaluate)
        assert not checked.solved and checked.false == false, reply
    assert load_reward("countdown")("8 - 5 = 3\n3 * 9 = 27", {"messages": [{"role": "user", "content": q}]}, True) == 1


def brute_force(numbers):
    """Every ordered step sequence over a pool (a - b only when positive, a / b only when whole) and its end."""
    if len(numbers) == 1:
        yield numbers[0]
        return
    for i, j in itertools.permutations(range(len(numbers)), 2):
        a, b = numbers[i], numbers[j]
        rest = [numbers[k] for k in range(len(numbers)) if k not in (i, j)]
        for r in (a + b, a - b if a > b else None, a * b, a // b if a % b == 0 else None):
            if r is not None:
                yield from brute_force(rest + [r])


def test_countdown_results_solutions_and_chance_against_brute_force():
    rng = random.Random(0)
    for size in (3, 4):
        for _ in range(5):
            numbers = [rng.randint(1, 9) for _ in range(size)]
            ends = list(brute_force(numbers))
            counts = {v: ends.count(v) for v in set(ends)}
            assert countdown_results(numbers) == counts
            target = max(counts, key=lambda v: (v <= 100, counts[v]))
            assert countdown_chance(numbers, target) == counts[target] / len(ends)
            solutions = countdown_solutions(numbers, target)
            assert len(solutions) == counts[target]
            question = "Make {} from {}.".format(target, ", ".join(map(str, numbers)))
            for steps in solutions:
                reply = "\n".join(f"{a} {op} {b} = {r}" for a, op, b, r in steps)
                assert check_work(question, reply, evaluate).solved


def test_twins_share_a_split():
    assert split_of("What is 3 + 5?") == split_of("What is 5 + 3?") == split_of("What is 5 + 3? Show your work.")
    assert problem_of("What is 5 * 12?") == problem_of("What is 12 * 5? Show your work.") == "5 * 12"
    assert problem_of("What is 9 - 4?") != problem_of("What is 4 - 9?")  # not twins
    assert problem_of("Which is larger, 30 or 7?") == problem_of("Which is larger, 7 or 30?")
    assert problem_of("What is the smallest of 5, 12, 3?") == problem_of("What is the smallest of 3, 5, 12?")
    assert problem_of("Make 27 from 9, 5, 8.") == problem_of("Make 27 from 5, 8, 9.")
    # over whole skills and both forms: no problem is on both sides
    for skills in (("addition",), ("multiplication", "multiplication_work"), ("larger",), ("smallest",),
                   ("countdown",), ("letter_count", "letter_count_work")):
        sides = {}
        for split in ("train", "held-out"):
            sides[split] = {problem_of(i.question) for s in skills for d in SKILLS[s].difficulties
                            for i in generate(s, split, 400, seed=1, difficulty=d)}
        assert sides["train"] and sides["held-out"] and not sides["train"] & sides["held-out"], skills
