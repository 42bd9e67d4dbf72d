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
from decoderlab.tasks.work import (check_work, column_lines, column_work, countdown_chance, countdown_of,
                                   countdown_results, countdown_solutions, multiplication_work, spelled_count)

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


def test_the_column_forms_against_python():
    """Every column of a sum or difference against Python's arithmetic on thousands of random draws (0-6 digits,
    unequal lengths, differences with long borrow chains): the column's digits, the carry or borrow passed on, the
    digits found so far equal to the true result of the columns so far, the answer the true result."""
    rng = random.Random(3)
    draws = [(rng.randrange(10 ** rng.randint(1, 6)), rng.choice("+-"), rng.randrange(10 ** rng.randint(1, 6)))
             for _ in range(4000)] + [(1000, "-", 1), (999, "+", 1), (0, "+", 0), (5, "-", 5), (100, "-", 99)]
    for a, op, b in draws:
        a, b = (b, a) if op == "-" and a < b else (a, b)
        lines, n = column_lines(a, op, b), max(len(str(a)), len(str(b)))
        assert len(lines) == n
        for k, (x, y, c, r, digits) in enumerate(lines):
            assert (x % 10, y) == (a // 10 ** k % 10, b // 10 ** k % 10)
            low = a % 10 ** (k + 1) + b % 10 ** (k + 1) if op == "+" else a % 10 ** (k + 1) - b % 10 ** (k + 1)
            if op == "+":
                assert r == x + y + c and int(digits) == low and c == (a % 10 ** k + b % 10 ** k >= 10 ** k)
            else:  # a borrow: the columns so far of a below b's, so the true result of them wraps past 10^(k+1)
                assert r == x - y - c and 0 <= r <= 9 and c == (a % 10 ** k < b % 10 ** k)
                assert int(digits) == low % 10 ** (k + 1) and (x >= 10) == (low < 0)
            assert len(digits) == k + 1 + (op == "+" and r >= 10)
        work = column_work(a, op, b)
        assert work.split("\n")[-1] == f"Answer: {a + b if op == '+' else a - b}"
        assert check_work(f"What is {a} {op} {b}? Show your work.", work, evaluate).false == 0


def test_the_column_forms_by_hand_and_their_tokens():
    """Lee et al.'s order (units first) with the carry and borrow written, digits one BPE token each."""
    assert column_work(847, "+", 585) == "7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\n8 + 5 + 1 = 14, 1432\nAnswer: 1432"
    assert column_work(532, "-", 187) == "12 - 7 - 0 = 5, 5\n13 - 8 - 1 = 4, 45\n5 - 1 - 1 = 3, 345\nAnswer: 345"
    assert column_work(815, "-", 802).split("\n")[-2:] == ["8 - 8 - 0 = 0, 013", "Answer: 13"]
    for a, op, b in ((5, "-", 7), (-1, "+", 2), (3, "*", 4)):
        with pytest.raises(ValueError, match=r"a \+ b or a - b .* got"):
            column_work(a, op, b)
    # the recipe's tokenizer: BPE trained on the corpus alone, which has no digits -- so each digit of a line is
    # its own token and a column's digits sit at the same offsets in every line
    from decoderlab.tasks.skills import CORPUS
    from decoderlab.tokenizers import BPETokenizer

    tok = BPETokenizer.train(CORPUS.read_text(encoding="utf-8"), 1024)
    text = column_work(847, "+", 585)
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == [ch for ch in text if ch.isdigit()]


@pytest.mark.parametrize("reply,false", [
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\n8 + 5 + 1 = 14, 1432\nAnswer: 1432", 0),
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 0 = 12, 122\n8 + 5 + 1 = 14, 1422\nAnswer: 1422", 1),  # the carry dropped
    ("7 + 5 + 0 = 13, 13\n4 + 8 + 1 = 13, 133\n8 + 5 + 1 = 14, 1433\nAnswer: 1433", 1),  # a false sum
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\n8 + 5 + 1 = 14, 1423\nAnswer: 1423", 1),  # digits miscopied
    ("7 + 5 + 0 = 12, 12\n8 + 4 + 1 = 13, 132\n8 + 5 + 1 = 14, 1432\nAnswer: 1432", 1),  # not the question's
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\nAnswer: 132", 1),  # a column missing: the answer does not follow
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\n8 + 5 + 1 = 14, 1432\nAnswer: 1433", 1),
    ("7 + 5 + 0 = 12, 12\n4 + 8 + 1 = 13, 132\n8 + 5 + 1 = 14, 1432\n0 + 0 + 1 = 1, 11432\nAnswer: 1432", 1),
])
def test_a_false_column_line_is_counted(reply, false):
    assert check_work("What is 847 + 585? Show your work.", reply, evaluate).false == false


@pytest.mark.parametrize("reply,false", [
    ("12 - 7 - 0 = 5, 5\n13 - 8 - 1 = 4, 45\n5 - 1 - 1 = 3, 345\nAnswer: 345", 0),
    ("12 - 7 - 0 = 5, 5\n3 - 8 - 1 = 4, 45\n5 - 1 - 1 = 3, 345\nAnswer: 345", 2),  # 3 - 8 - 1 false, so no borrow
    ("12 - 7 - 0 = 5, 5\n13 - 8 - 0 = 5, 55\n5 - 1 - 0 = 4, 455\nAnswer: 455", 2),  # the borrow dropped, twice
    ("2 - 7 - 0 = 5, 5\n13 - 8 - 1 = 4, 45\n5 - 1 - 1 = 3, 345\nAnswer: 345", 2),  # and the next borrow from it
    ("12 - 7 - 0 = 5, 5\n13 - 8 - 1 = 4, 45\n15 - 1 - 1 = 13, 1345\nAnswer: 1345", 1),  # a borrow not needed
    ("12 - 7 - 0 = 5, 5\n13 - 8 - 1 = 4, 45\n5 - 1 - 1 = 3, 345\nAnswer: 0345", 1),  # the answer's leading zero
])
def test_a_false_borrow_line_is_counted(reply, false):
    assert check_work("What is 532 - 187? Show your work.", reply, evaluate).false == false


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
