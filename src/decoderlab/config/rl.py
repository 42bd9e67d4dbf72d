"""Settings of the stages after supervised fine-tuning (no torch): reinforcement learning from a checkable
reward (GRPO-style, :class:`RLConfig`), preference tuning (DPO) and LoRA adapters; their choices and defaults
are plain data in :mod:`~decoderlab.config.names` and :mod:`~decoderlab.config.defaults`.

The code that reads them: :mod:`decoderlab.reinforcement` (rewards, prompts, the GRPO loss and module,
sample -> reward -> step), :mod:`decoderlab.finetuning.dpo` (preference rows, the DPO loss and module) and
:mod:`decoderlab.lora` (PEFT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the choices and defaults as plain data (names, defaults: the command line's help reads them without this
# module's dataclass), here too for the code that reads the settings
from .defaults import DPO_BETA, END_OF_TURN_BONUS, RL_DEFAULTS  # noqa: F401
from .names import DEFAULT_LORA_TARGETS, DEFAULT_REWARD, LORA_TARGETS, REWARDS  # noqa: F401
from .settings import Settings


@dataclass
class RLConfig(Settings):
    """How a reinforcement-learning step samples and scores (the optimizer, steps, accumulation and seed are
    the run's :class:`~decoderlab.config.train.TrainConfig`; its ``batch_size`` counts prompts per
    micro-batch, each answered ``group_size`` times).

    Attributes:
        group_size: G, replies sampled per prompt; the advantages are each reply's reward minus its group's
            mean, so G = 1 would give all zeros (refused). nanochat's ``chat_rl`` samples 16, TRL's
            ``GRPOTrainer`` 8 (``num_generations``).
        max_new_tokens: the longest reply, in tokens (a reply also stops at the end of turn and at the
            model's ``max_len``).
        temperature, top_k, top_p: sampling (as ``decoderlab.generation``; temperature must be > 0: greedy
            replies of a group are all alike).
        kl_coef: weight of the KL penalty to the starting model (0: none, as nanochat; TRL's ``beta``).
        scale_rewards: divide the advantages by the group's standard deviation (+ 1e-4), as GRPO (Shao et
            al. 2024) and TRL by default; False keeps reward minus mean (nanochat, Dr. GRPO).
    """

    group_size: int = RL_DEFAULTS["group_size"]
    max_new_tokens: int = RL_DEFAULTS["max_new_tokens"]
    temperature: float = RL_DEFAULTS["temperature"]
    top_k: int | None = RL_DEFAULTS["top_k"]
    top_p: float | None = RL_DEFAULTS["top_p"]
    kl_coef: float = RL_DEFAULTS["kl_coef"]
    scale_rewards: bool = RL_DEFAULTS["scale_rewards"]

    def __post_init__(self):
        self.validate()

    def validate(self) -> "RLConfig":
        """Raise ``ValueError`` naming the offending field, its value and what is allowed."""
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise ValueError(f"group_size must be an integer >= 2 (replies per prompt; with {g!r} every reward "
                             f"equals its group's mean, so every advantage is 0 and nothing is learned), got {g!r}")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {m!r}")
        if not _real(self.temperature) or not self.temperature > 0:
            raise ValueError(f"temperature must be a finite number > 0 (the replies of a group must differ), "
                             f"got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise ValueError(f"top_k must be None or an integer >= 0, got {self.top_k!r}")
        if self.top_p is not None and not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if not _real(self.kl_coef) or self.kl_coef < 0:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if not isinstance(self.scale_rewards, bool):
            raise ValueError(f"scale_rewards must be True or False, got {self.scale_rewards!r}")
        return self



def _real(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
