"""Data and rewards of learning from feedback (the stage after supervised fine-tuning).

- :mod:`.rewards`: rewards a program can check (``contains_words``, ``exact``, ``regex``, ``number``) and a
  user's own ``module:function``; :func:`~.rewards.score` calls one and names the prompt when it misbehaves
  (the module itself imports no torch);
- :mod:`.prompts`: the prompts JSONL of a reinforcement-learning run (conversations to answer + the fields
  the reward needs);
- :mod:`.preferences`: TRL's ``prompt`` / ``chosen`` / ``rejected`` rows for DPO, read and rendered with the
  chat template;
- :mod:`.jsonl`: JSON Lines with line numbers for every error.

Layer: above :mod:`decoderlab.chat` (the renderer and the message checks), below the runs that use them
(:mod:`decoderlab.reinforcement`, :mod:`decoderlab.finetuning`).
"""

from .preferences import PreferencePair, load_preferences, parse_pair, render_completion, render_pair
from .prompts import PromptRow, load_prompts
from .rewards import (BUILTIN_REWARDS, RewardError, RewardFn, last_number, load_reward, reward_name, score,
                      word_coverage)

__all__ = [
    "PreferencePair", "load_preferences", "parse_pair", "render_completion", "render_pair", "PromptRow",
    "load_prompts", "BUILTIN_REWARDS", "RewardError", "RewardFn", "last_number", "load_reward", "reward_name",
    "score", "word_coverage",
]
