"""Reinforcement learning from a checkable reward: sample -> reward -> batch -> step, and the ``rl`` run.

It sits above :mod:`decoderlab.generation` (the KV-cache engine samples the replies), :mod:`decoderlab.chat`
(the renderer, the message checks) and :mod:`decoderlab.training` (the run plumbing and the masked rows,
:mod:`decoderlab.training.rows`), which never import each other. The package is not named ``rl``, so that
``decoderlab.rl`` can stay a function. Its names load on first use (PEP 562): ``decoderlab.reinforcement.rewards``
imports no torch, so ``--help`` and a reward's own tests stay light.

    rewards    rewards a program can check (built-ins and module:function), and the one place one is called
    prompts    the prompts file of a run (conversations to answer + the fields the reward needs)
    grpo       group advantages, the per-token policy-gradient loss + KL, Rollout, RLModule
    rollouts   RolloutSampler (the samples of one optimizer step), require_chat_template
    train      train_rl: a model in memory trained on Lightning's loop
    plot       plot_history (reward, KL, reply length and end-of-turn rate per step, one PNG)
    run        rl (one run: the run directory, checkpoints, resume, LoRA, the curves) and RLSummary
"""

from __future__ import annotations

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    "BUILTIN_REWARDS": "rewards", "RewardError": "rewards", "RewardFn": "rewards", "last_number": "rewards",
    "load_reward": "rewards", "reward_name": "rewards", "score": "rewards", "word_coverage": "rewards",
    "PromptRow": "prompts", "load_prompts": "prompts",
    "RLModule": "grpo", "Rollout": "grpo", "group_advantages": "grpo",
    "RolloutSampler": "rollouts", "require_chat_template": "rollouts",
    "train_rl": "train", "plot_history": "plot",
    "rl": "run", "RLSummary": "run", "PLOT_FILE": "run",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # next time a plain attribute
        return value
    raise AttributeError(f"module 'decoderlab.reinforcement' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
