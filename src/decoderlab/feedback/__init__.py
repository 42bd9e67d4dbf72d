"""An alias for one release: ``decoderlab.feedback`` dissolved into the rooms that use it. Import from there:

- the rewards and the prompts file of RL: :mod:`decoderlab.reinforcement.rewards`,
  :mod:`decoderlab.reinforcement.prompts` (or ``decoderlab.reinforcement``);
- DPO's preference rows: :mod:`decoderlab.finetuning.dpo` (or ``decoderlab.finetuning``);
- the JSON Lines reader: :mod:`decoderlab.jsonl`.

The names load on first use (PEP 562), as before from their new homes; ``decoderlab.feedback.rewards``,
``.prompts`` and ``.preferences`` are aliases of those modules too.
"""

from __future__ import annotations

import importlib

#: old public name -> the module that defines it now
_MOVED = {
    **dict.fromkeys(("PreferencePair", "load_preferences", "parse_pair", "render_completion", "render_pair"),
                    "decoderlab.finetuning.dpo"),
    **dict.fromkeys(("PromptRow", "load_prompts"), "decoderlab.reinforcement.prompts"),
    **dict.fromkeys(("BUILTIN_REWARDS", "RewardError", "RewardFn", "last_number", "load_reward", "reward_name",
                     "score", "word_coverage"), "decoderlab.reinforcement.rewards"),
}

__all__ = list(_MOVED)


def __getattr__(name: str):
    if name in _MOVED:
        value = getattr(importlib.import_module(_MOVED[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'decoderlab.feedback' has no attribute {name!r}")
