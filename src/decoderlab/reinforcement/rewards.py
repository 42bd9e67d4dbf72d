"""Rewards a program can check: the built-ins and a user's own ``module:function``, and the one place a
reward is called (:func:`score`), which names the prompt and the value when a reward misbehaves.

A reward is a callable ``reward(reply, row, ended) -> float``:

* ``reply`` -- the sampled assistant reply as text (without its end-of-turn token);
* ``row`` -- the prompt's row of the prompts file as read (a dict: its ``messages`` or ``prompt`` and any
  other fields, e.g. ``words`` or ``reference``);
* ``ended`` -- whether the reply ended its turn (the model produced the end-of-turn token) rather than
  running out of room.

It may carry a ``fields`` attribute (a tuple of row keys it needs) and a ``check_row(row)`` method that
raises ``ValueError`` for a row it cannot score; :func:`decoderlab.reinforcement.prompts.load_prompts` then
checks every row before the run starts and names the line.

Built-ins (``decoderlab.config.REWARDS``):

* ``contains_words`` -- row ``words`` (a list of strings): the share of the words the reply uses as whole
  words (case-insensitive), plus :data:`~decoderlab.config.rl.END_OF_TURN_BONUS` when the reply ended its turn;
* ``exact`` -- row ``reference`` (text): 1 when the reply equals it after stripping whitespace, else 0;
* ``regex`` -- row ``pattern`` (a Python regular expression): 1 when ``re.search`` finds it in the reply;
* ``number`` -- row ``reference`` (a number, or text whose last number is the answer, as GSM8K's
  ``"... #### 72"``): 1 when the reply's last number equals it, else 0;
* ``countdown`` -- the prompt is a countdown question (``Make 27 from 5, 8, 9.``, :mod:`decoderlab.tasks.work`):
  1 when every line of the reply is a true step (checked by the calculator's evaluator) on numbers it has, each
  given number used once, and the last one left is the target, else 0.

Sources: verifiable rewards as in nanochat's ``chat_rl`` (GSM8K: the last number) and TRL's
``GRPOTrainer`` reward functions (format checks by regular expression).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import re
import sys
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

from ..config.defaults import END_OF_TURN_BONUS
from ..config.names import REWARDS
from ..tasks.work import check_countdown, countdown_of

RewardFn = Callable[[str, dict, bool], float]

_WORD = re.compile(r"[A-Za-z]+")
#: a number: digits with thousands commas (a comma before exactly three digits: "1,234"; "1,2,3" is three numbers)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|-?\.\d+")


class RewardError(ValueError):
    """A reward could not be loaded, or raised or returned something other than a finite number."""


# ---------------------------------------------------------------------------------------------------------
# Pieces the built-ins share
# ---------------------------------------------------------------------------------------------------------


def word_coverage(reply: str, words: Sequence[str]) -> int:
    """How many of ``words`` occur in ``reply`` as whole words (runs of letters), case-insensitive."""
    found = {w.lower() for w in _WORD.findall(reply)}
    return sum(w.lower() in found for w in words)


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (``-3``, ``1,000``, ``2.50``; thousands commas dropped) as an
    exact ``Decimal``, or None when it holds none. A comma joins digits only as a thousands separator, before a
    group of exactly three digits: ``"sorted: 3,5,8"`` ends in 8."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return Decimal(match.replace(",", ""))
        except InvalidOperation:  # pragma: no cover - the pattern only matches numbers
            continue
    return None


def _field(row: dict, name: str, reward: str):
    if not isinstance(row, dict) or name not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"the {reward!r} reward needs a {name!r} field in every row; this row has {keys}")
    return row[name]


# ---------------------------------------------------------------------------------------------------------
# The built-in rewards
# ---------------------------------------------------------------------------------------------------------


class ContainsWords:
    """``contains_words``: the share of ``row["words"]`` present in the reply as whole words, plus ``bonus``
    (default :data:`END_OF_TURN_BONUS`) when the reply ended its turn. Range [0, 1 + bonus]."""

    name = "contains_words"
    fields = ("words",)

    def __init__(self, bonus: float = END_OF_TURN_BONUS):
        if isinstance(bonus, bool) or not isinstance(bonus, (int, float)) or not math.isfinite(bonus):
            raise ValueError(f"bonus must be a finite number, got {bonus!r}")
        self.bonus = float(bonus)

    def check_row(self, row: dict) -> None:
        words = _field(row, "words", self.name)
        if (not isinstance(words, list) or not words
                or not all(isinstance(w, str) and _WORD.fullmatch(w) for w in words)):
            raise ValueError(f"\"words\" must be a non-empty list of words (letters only), got {words!r:.80}")

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        words = row["words"]
        return word_coverage(reply, words) / len(words) + (self.bonus if ended else 0.0)


class Exact:
    """``exact``: 1.0 when the reply equals ``row["reference"]`` after stripping surrounding whitespace, else
    0.0 (the exact match of :func:`decoderlab.finetuning.evaluate_chat`)."""

    name = "exact"
    fields = ("reference",)

    def check_row(self, row: dict) -> None:
        ref = _field(row, "reference", self.name)
        if not isinstance(ref, str):
            raise ValueError(f"\"reference\" must be text for the 'exact' reward, got {ref!r:.80}")

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        return float(reply.strip() == row["reference"].strip())


class Regex:
    """``regex``: 1.0 when ``re.search(row["pattern"], reply)`` matches, else 0.0 (anchor the pattern with
    ``^...$`` to require the whole reply)."""

    name = "regex"
    fields = ("pattern",)

    def __init__(self):
        self._compiled: dict[str, re.Pattern] = {}

    def _pattern(self, pattern: str) -> re.Pattern:
        if pattern not in self._compiled:
            self._compiled[pattern] = re.compile(pattern)
        return self._compiled[pattern]

    def check_row(self, row: dict) -> None:
        pattern = _field(row, "pattern", self.name)
        if not isinstance(pattern, str):
            raise ValueError(f"\"pattern\" must be a regular expression (text), got {pattern!r:.80}")
        try:
            self._pattern(pattern)
        except re.error as e:
            raise ValueError(f"\"pattern\" {pattern!r:.80} is not a valid regular expression: {e}") from None

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        return float(self._pattern(row["pattern"]).search(reply) is not None)


class Number:
    """``number``: 1.0 when the reply's last number equals ``row["reference"]`` (a number, or text whose last
    number is the answer, such as GSM8K's ``"... #### 72"``), compared exactly (``72`` == ``72.0``), else 0.0."""

    name = "number"
    fields = ("reference",)

    @staticmethod
    def _reference(ref) -> Decimal | None:
        if isinstance(ref, bool):
            return None
        if isinstance(ref, (int, float)):
            return Decimal(str(ref)) if math.isfinite(ref) else None
        return last_number(ref) if isinstance(ref, str) else None

    def check_row(self, row: dict) -> None:
        ref = _field(row, "reference", self.name)
        if self._reference(ref) is None:
            raise ValueError(f"\"reference\" must be a number or text ending in one for the 'number' reward, "
                             f"got {ref!r:.80}")

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        got = last_number(reply)
        return float(got is not None and got == self._reference(row["reference"]))


class Countdown:
    """``countdown``: 1.0 when the reply solves the countdown question of its prompt (the row's last user
    message), every line a true step checked by the calculator's evaluator
    (:func:`decoderlab.tasks.work.check_countdown`), else 0.0."""

    name = "countdown"
    fields = ()

    def __init__(self):
        from ..chat.calculator import evaluate  # (here: the chat package imports torch; this module does not)

        self._evaluate = evaluate

    def check_row(self, row: dict) -> None:
        if countdown_of(prompt_text(row)) is None:
            raise ValueError(f"the 'countdown' reward needs a countdown question (\"Make 27 from 5, 8, 9.\") as "
                             f"the last user message, got {prompt_text(row)!r:.80}")

    def __call__(self, reply: str, row: dict, ended: bool) -> float:
        numbers, target = countdown_of(prompt_text(row))
        return float(check_countdown(numbers, target, reply, self._evaluate).solved)


#: built-in reward name -> a factory of the reward object (the names are ``decoderlab.config.REWARDS``)
BUILTIN_REWARDS: dict[str, Callable[[], RewardFn]] = {
    "contains_words": ContainsWords, "exact": Exact, "regex": Regex, "number": Number, "countdown": Countdown}


# ---------------------------------------------------------------------------------------------------------
# Loading and calling
# ---------------------------------------------------------------------------------------------------------


def reward_name(reward) -> str:
    """How messages name a reward: its ``name`` attribute, else ``module:qualname``."""
    name = getattr(reward, "name", None)
    if isinstance(name, str):
        return name
    module, qual = getattr(reward, "__module__", None), getattr(reward, "__qualname__", None)
    return f"{module}:{qual}" if module and qual else repr(reward)


def load_reward(spec: str | RewardFn) -> RewardFn:
    """The reward a ``--reward`` value names: a built-in name (``decoderlab.config.REWARDS``) or
    ``module:function`` (``module`` imported with the current directory on ``sys.path``, as ``python -m``
    does; ``function`` may be dotted, ``module:Class.method``). A callable is returned unchanged.

    Raises:
        RewardError: an unknown name (listing the built-ins), a module that cannot be imported (with the
            import's own error), no such attribute, something not callable, or a callable that cannot be called
            as ``reward(reply, row, ended)``.
    """
    if callable(spec) and not isinstance(spec, str):
        return _check_signature(spec, reward_name(spec))
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"a reward is a built-in name ({', '.join(REWARDS)}) or module:function, got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]()
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}; built-in rewards: {', '.join(REWARDS)}; or give your own "
                          f"as module:function (a function reward(reply, row, ended) -> float)")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"reward {spec!r} must be module:function, both parts non-empty")
    fn = _import_attr(spec, module_name, attr)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr!r} in module {module_name!r} is a {type(fn).__name__}, "
                          f"not a function")
    return _check_signature(fn, spec)


def _import_attr(spec: str, module_name: str, attr: str):
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # a reward module next to the data, as `python -m` finds it
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module's own code raised while importing
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _check_signature(fn, name: str):
    try:
        inspect.signature(fn).bind("", {}, False)
    except TypeError as e:
        raise RewardError(f"reward {name!r} cannot be called as reward(reply, row, ended): {e}") from None
    except ValueError:  # a builtin without a signature: find out when it is called
        pass
    return fn


def as_reward_value(value) -> float | None:
    """``value`` as a finite float when it is a real number (bools count as 0/1; NumPy and 0-d tensor
    numbers through ``.item()``), else None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _where(row: dict, line: int | None) -> str:
    text = prompt_text(row)
    return f"the prompt on line {line} ({text!r:.60})" if line is not None else f"the prompt {text!r:.60}"


def prompt_text(row: dict) -> str:
    """The last user message of a prompts-file row (its ``messages`` or ``prompt``), for messages."""
    msgs = row.get("messages", row.get("prompt")) if isinstance(row, dict) else None
    if isinstance(msgs, str):
        return msgs
    if isinstance(msgs, list):
        users = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return str(row)[:60]


def score(reward: RewardFn, reply: str, row: dict, ended: bool, line: int | None = None) -> float:
    """``reward(reply, row, ended)`` as a float, checked.

    Raises:
        RewardError: the reward raised (its exception chained), or returned something other than a finite
            real number; the message names the reward, the prompt (its line in the prompts file), the reply
            and the value.
    """
    name = reward_name(reward)
    try:
        value = reward(reply, row, ended)
    except Exception as e:
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e} on a reply to {_where(row, line)}; "
                          f"reply {reply!r:.60}") from e
    out = as_reward_value(value)
    if out is None:
        raise RewardError(f"reward {name!r} returned {value!r:.60} ({type(value).__name__}) for a reply to "
                          f"{_where(row, line)}; a reward must return a finite number; reply {reply!r:.60}")
    return out
