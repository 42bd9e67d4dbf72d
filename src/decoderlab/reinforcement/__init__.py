"""Reinforcement learning from a checkable reward: sample -> reward -> batch -> step, and the ``rl`` run.

It sits above :mod:`decoderlab.generation` (the KV-cache engine samples the replies) and
:mod:`decoderlab.training` (the loss and the Lightning module, :mod:`decoderlab.training.grpo`), which never
import each other, and above :mod:`decoderlab.feedback` (the prompts file and the rewards). The package is not
named ``rl``, so that ``decoderlab.rl`` can stay a function.

    rollouts   RolloutSampler (the samples of one optimizer step), require_chat_template, train_rl
    plot       plot_history (reward, KL, reply length and end-of-turn rate per step, one PNG)
    run        rl (one run: the run directory, checkpoints, resume, LoRA, the curves) and RLSummary
"""

from ..training.module import frozen_copy
from .plot import plot_history
from .rollouts import RolloutSampler, require_chat_template, train_rl
from .run import PLOT_FILE, RLSummary, rl

__all__ = ["RolloutSampler", "require_chat_template", "train_rl", "frozen_copy", "plot_history", "rl", "RLSummary", "PLOT_FILE"]
