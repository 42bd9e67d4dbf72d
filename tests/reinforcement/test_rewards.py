"""Rewards: the built-ins' scores, loading module:function, and a reward that raises or returns a non-number
(each named with the prompt and the value)."""

import math
import sys
import textwrap
from decimal import Decimal

import pytest

from decoderlab.config import END_OF_TURN_BONUS, REWARDS
from decoderlab.reinforcement.rewards import (BUILTIN_REWARDS, ContainsWords, RewardError, last_number, load_reward,
                                         score, word_coverage)
from decoderlab.tinystories import word_coverage as story_word_coverage

ROW = {"messages": [{"role": "user", "content": "Write a short story with the words: cat, hat, bat."}],
       "words": ["cat", "hat", "bat"]}


def test_builtin_names_are_the_config_floors():
    assert tuple(BUILTIN_REWARDS) == REWARDS
    assert story_word_coverage is word_coverage  # the demo scores what the reward rewards


def test_contains_words_is_the_share_present_plus_the_end_of_turn_bonus():
    r = load_reward("contains_words")
    assert r("The Cat sat.", ROW, False) == pytest.approx(1 / 3)
    assert r("A cat in a hat met a bat!", ROW, False) == 1.0
    assert r("A cat in a hat met a bat!", ROW, True) == pytest.approx(1.0 + END_OF_TURN_BONUS)
    assert r("cats and hats", ROW, True) == pytest.approx(END_OF_TURN_BONUS)  # whole words only
    assert ContainsWords(bonus=0.0)("cat", ROW, True) == pytest.approx(1 / 3)


def test_exact_regex_and_number():
    exact = load_reward("exact")
    assert exact("  red \n", {"reference": "red"}, True) == 1.0
    assert exact("Red", {"reference": "red"}, True) == 0.0
    rx = load_reward("regex")
    assert rx("<answer>4</answer>", {"pattern": r"^<answer>\d+</answer>$"}, False) == 1.0
    assert rx("the answer is 4", {"pattern": r"^<answer>\d+</answer>$"}, False) == 0.0
    num = load_reward("number")
    gsm8k = {"reference": "Natalia sold 48/2 = 24 clips in May.\n#### 72"}
    assert num("48 + 24 = 72", gsm8k, True) == 1.0
    assert num("72, or maybe 71", gsm8k, True) == 0.0  # the last number counts
    assert num("the total is 1,000.0 dollars", {"reference": 1000}, False) == 1.0
    assert num("no number here", {"reference": 3}, False) == 0.0
    assert last_number("from -2.5 to 3") == Decimal("3") and last_number("x") is None


def test_rows_are_checked_for_the_fields_a_builtin_needs():
    with pytest.raises(ValueError, match="'contains_words' reward needs a 'words' field.*has \\['messages'\\]"):
        load_reward("contains_words").check_row({"messages": []})
    with pytest.raises(ValueError, match="non-empty list of words"):
        load_reward("contains_words").check_row({"words": []})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        load_reward("regex").check_row({"pattern": "(unclosed"})
    with pytest.raises(ValueError, match="must be a number or text ending in one"):
        load_reward("number").check_row({"reference": "no digits"})
    with pytest.raises(ValueError, match="must be text for the 'exact' reward"):
        load_reward("exact").check_row({"reference": 3})


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length(reply, row, ended):
            return len(reply) / 10

        def boom(reply, row, ended):
            return row["missing"]

        def text(reply, row, ended):
            return "high"

        def nan(reply, row, ended):
            return float("nan")

        def two_args(reply, row):
            return 1.0

        class Scorer:
            @staticmethod
            def half(reply, row, ended):
                return 0.5

        not_a_function = 3
    """))
    (tmp_path / "broken_rewards.py").write_text("import no_such_package_here\n")
    monkeypatch.chdir(tmp_path)  # load_reward finds modules in the current directory, as python -m does
    yield
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_module_function_rewards_load_from_the_current_directory(reward_module):
    fn = load_reward("my_rewards:length")
    assert score(fn, "abcde", ROW, True, line=3) == 0.5
    assert load_reward("my_rewards:Scorer.half")("", ROW, False) == 0.5
    assert str(__import__("os").getcwd()) not in sys.path  # the directory is not left on sys.path


@pytest.mark.parametrize("spec, match", [
    ("no_such_reward", "unknown reward 'no_such_reward'; built-in rewards: contains_words, exact, regex, number"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("broken_rewards:fn", "cannot import module 'broken_rewards': ModuleNotFoundError: No module named "
                          "'no_such_package_here'"),
    ("my_rewards:nothing", "module 'my_rewards' has no attribute 'nothing'"),
    ("my_rewards:not_a_function", "'not_a_function' in module 'my_rewards' is a int, not a function"),
    ("my_rewards:two_args", "cannot be called as reward\\(reply, row, ended\\)"),
    (":fn", "must be module:function"),
    ("", "a reward is a built-in name"),
])
def test_a_reward_naming_nothing_importable_is_refused(reward_module, spec, match):
    with pytest.raises(RewardError, match=match):
        load_reward(spec)


def test_a_reward_that_raises_names_the_prompt_line_and_the_error(reward_module):
    fn = load_reward("my_rewards:boom")
    with pytest.raises(RewardError, match=r"reward 'my_rewards:boom' raised KeyError: 'missing' on a reply to the "
                                          r"prompt on line 7 \('Write a short story with the words: cat, hat, b"
                                          r".*reply 'once'") as e:
        score(fn, "once", ROW, False, line=7)
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize("name, shown", [("text", "'high' \\(str\\)"), ("nan", "nan \\(float\\)")])
def test_a_reward_that_returns_a_non_number_names_the_value_and_the_prompt(reward_module, name, shown):
    with pytest.raises(RewardError, match=rf"returned {shown} for a reply to the prompt on line 2 .*must return a "
                                          r"finite number"):
        score(load_reward(f"my_rewards:{name}"), "x", ROW, True, line=2)


def test_numbers_of_any_kind_and_bools_are_rewards():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for value, want in [(np.float32(0.25), 0.25), (torch.tensor(0.5), 0.5), (True, 1.0), (3, 3.0)]:
        assert score(lambda r, row, e, v=value: v, "", ROW, False) == want
    assert math.isfinite(score(lambda r, row, e: -1e30, "", ROW, False))


@pytest.mark.parametrize("text, number", [
    ("The numbers are 1,2,3", "3"), ("sorted: 3,5,8", "8"), ("12,3456", "3456"), ("1234,567", "567"),
    ("1,234", "1234"), ("it costs 1,234,567.50 in all", "1234567.50"), ("-1,000 and 2,50", "50"), ("7,", "7"),
])
def test_a_comma_list_is_a_list_and_thousands_separators_stay_one_number(text, number):
    """`last_number("The numbers are 1,2,3")` was 123 (the 'number' reward scored a right answer 0): a comma joins
    digits into one number only before a group of exactly three digits."""
    assert last_number(text) == Decimal(number)
    assert load_reward("number")(text, {"reference": number}, True) == 1.0
