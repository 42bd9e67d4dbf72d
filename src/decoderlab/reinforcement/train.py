""":func:`train_rl`: reinforcement learning of a model in memory on Lightning's loop -- the samples of each step
(:class:`~decoderlab.reinforcement.rollouts.RolloutSampler`) stepped on by the policy-gradient module
(:class:`~decoderlab.reinforcement.grpo.RLModule`). The run directory, checkpoints and resume of a full
``decoderlab rl`` command are :func:`decoderlab.reinforcement.rl`'s (:mod:`.run`)."""

from __future__ import annotations

from typing import Sequence

import lightning as L

from ..chat import ChatTemplate
from ..config.rl import RLConfig
from ..tokenizers import Tokenizer
from ..training import TrainConfig, fit, make_trainer
from ..training.module import frozen_copy
from .grpo import RLModule
from .prompts import PromptRow
from .rewards import RewardFn
from .rollouts import RolloutSampler


def train_rl(model, tokenizer: Tokenizer, template: str | ChatTemplate, prompts: Sequence[PromptRow],
             reward: RewardFn, *, train_config: TrainConfig, rl_config: RLConfig, reference=None,
             track_kl: bool = False, callbacks: Sequence[L.Callback] = (), ckpt_path=None, run_dir=None,
             accelerator: str = "auto", progress_bar: bool | str = False, logger: bool = False):
    """Train ``model`` (in place) on ``prompts`` with ``reward``; return ``(model, history)``.

    ``history`` is :attr:`RLModule.history`: one dict per optimizer step (``step``, ``loss``, ``reward``,
    ``reward_std``, ``kl``, ``reply_length``, ``end_of_turn_rate``). ``train_config``: optimizer, schedule,
    ``max_steps``, ``batch_size`` (prompts per micro-batch), ``accumulate``, ``seed``. The KL to the starting
    model is computed when ``rl_config.kl_coef > 0`` or ``track_kl`` (``reference``: the model to compare
    with; default a frozen copy of ``model`` as it starts). ``ckpt_path``: a Lightning checkpoint to resume
    from (written by a ``ModelCheckpoint`` in ``callbacks``; the run directory's checkpoints are the run
    plumbing's). One process.

    Raises:
        ValueError: bad settings (see :class:`~decoderlab.config.rl.RLConfig`); a prompt too long for the model.
        decoderlab.reinforcement.rewards.RewardError: the reward raised or returned a non-number (the run stops; the
            checkpoints written before are kept).
    """
    train_config.validate()
    rl_config.validate()
    L.seed_everything(train_config.seed, verbose=False)
    sampler = RolloutSampler(prompts, tokenizer, template, reward, rl_config, max_len=model.config.max_len,
                             batch_size=train_config.batch_size, accumulate=train_config.accumulate,
                             seed=train_config.seed)
    if reference is None and (rl_config.kl_coef > 0 or track_kl):
        reference = frozen_copy(model)
    module = RLModule(model, train_config, sampler, reference=reference, kl_coef=rl_config.kl_coef)
    trainer = make_trainer(train_config, run_dir, devices=1, accelerator=accelerator, callbacks=callbacks,
                           progress_bar=progress_bar, logger=logger, checkpointing=False)
    fit(trainer, module, ckpt_path=ckpt_path)
    return model, module.history
