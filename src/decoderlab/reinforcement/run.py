""":func:`rl`: one reinforcement-learning run of a chat model on the run plumbing (:mod:`decoderlab.training.run`):
a run directory that is a chat checkpoint, Lightning checkpoints every ``eval_every`` steps and after the last,
resume, progress lines, accumulation, optionally LoRA adapters, and the curves of the run as a PNG.

The run directory holds, besides the run plumbing's files, ``rl.png`` (:func:`~.plot.plot_history`) and in
``summary.json`` the history of every step (reward, KL to the starting model, reply length, end-of-turn rate).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import torch

from ..chat import CHAT_TEMPLATE_KEY, load_base, load_model, template_from_meta, weights_dtype
from ..checkpoint import TOKENIZER_FILE, read_config
from ..config.defaults import RL_TRAIN
from ..config.names import DEFAULT_REWARD
from ..config.rl import RLConfig
from ..lora import has_lora, merge_lora, trainable_parameters
from ..model import DecoderOnlyTransformer
from ..tokenizers import Tokenizer
from ..training import (ExportCheckpoint, InterruptNotice, NonFiniteLossGuard, Run, Summary, TrainConfig, fit_run,
                        make_trainer, plan_run)
from ..training.adapters import base_pointer, run_lora, run_merge
from ..training.callbacks import LIGHTNING_DIR, RunCheckpoint
from ..training.module import frozen_copy
from ..training.run import RESUME_FIXED
from ..training.trainer import check_run_options
from .grpo import RLModule
from .plot import plot_history
from .prompts import load_prompts
from .rewards import load_reward, reward_name
from .rollouts import RolloutSampler, require_chat_template

#: the curves of a run, in its directory
PLOT_FILE = "rl.png"
#: train settings a resumed run cannot change: with the seed they fix every step's prompts and samples
RL_RESUME_FIXED = (*RESUME_FIXED, "batch_size")
#: the steps whose mean reward a summary reports as the start and the end of a run
_EDGE_STEPS = 10


@dataclass
class RLSummary(Summary):
    """What :func:`rl` reports, as attributes or as the mapping of ``summary.json``.

    Attributes:
        steps: optimizer steps done; history: per step ``{"step", "loss", "reward", "reward_std", "kl",
            "reply_length", "end_of_turn_rate"}`` (means over the step's replies; KL in nats per sampled
            token, to the starting model; lengths in tokens);
        reward_start / reward_end: the mean reward of the first / last min(10, steps // 2) steps (never the same);
        reward: the reward's name; prompts: rows of the prompts file; group_size: replies per prompt;
        plot: the PNG of the curves; template, num_parameters, trainable_parameters, lora, train_seconds,
            run_dir, device: as :class:`~decoderlab.finetuning.FinetuneSummary`.
    """

    steps: int
    history: list[dict]
    reward_start: float
    reward_end: float
    reward: str
    prompts: int
    group_size: int
    plot: str | None
    template: str
    num_parameters: int
    trainable_parameters: int
    lora: dict | None
    train_seconds: float
    run_dir: str
    device: str | None = None


class StepCheckpoint(RunCheckpoint):
    """Lightning checkpoints of a run without validation: ``last.ckpt`` and ``best-step{N}.ckpt`` (the newest,
    the fallback of a resume when ``last.ckpt`` is damaged; one file under both names) every ``every_n_steps``
    optimizer steps and after the last step."""

    def __init__(self, dirpath, every_n_steps: int):
        super().__init__(dirpath=str(dirpath), filename="best-step{step}", auto_insert_metric_name=False,
                         every_n_train_steps=every_n_steps, save_last=True, save_top_k=1,
                         enable_version_counter=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step >= trainer.max_steps and self._last_global_step_saved != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


def _digest(prompts) -> str:
    return hashlib.sha256(json.dumps([p.row for p in prompts], default=repr, sort_keys=True).encode()).hexdigest()


def _start(run: Run, checkpoint, base_model):
    """``(model, tokenizer, template, reference, start)``: the model to train, its chat template (refusing a
    base model without one), the starting model frozen (the KL's reference) and what run.json records. A
    resume builds the run's own model (its weights come with the Lightning checkpoint) and reloads the
    starting checkpoint as the reference (an in-memory ``base_model`` must be given again)."""
    if run.resumed:
        stored = run.info.get("checkpoint")
        if checkpoint is not None and str(Path(checkpoint).resolve()) != stored:
            run.keep("checkpoint", str(Path(checkpoint).resolve()), why="the run's weights started there")
        if run.info.get("base_sha256"):  # a LoRA run: its base, checked, is the starting model (the reference)
            model = load_base(run.run_dir, run.info)
            template = template_from_meta({CHAT_TEMPLATE_KEY: run.info[CHAT_TEMPLATE_KEY]})
            tok = Tokenizer.load(run.run_dir / TOKENIZER_FILE)
            return model, tok, template, frozen_copy(model), {"checkpoint": stored}
        if base_model is None and stored is None:
            raise ValueError(f"cannot resume {run.run_dir} without base_model: it started from a model in memory, "
                             f"which is the KL's reference; give the same base_model")
        reference = base_model[0] if base_model is not None else load_model(stored, dtype="float32").model
        template = template_from_meta({CHAT_TEMPLATE_KEY: run.info[CHAT_TEMPLATE_KEY]})
        model = DecoderOnlyTransformer(read_config(run.run_dir))
        tok = Tokenizer.load(run.run_dir / TOKENIZER_FILE)
        return model.train(), tok, template, frozen_copy(reference), {"checkpoint": stored}
    if (checkpoint is None) == (base_model is None):
        raise ValueError("give exactly one starting point: checkpoint (a chat checkpoint directory) or base_model")
    if base_model is not None:
        model, tok, template = base_model
        where = "the base model"
    else:
        model, tok, template, _ = load_model(checkpoint, dtype="float32")  # trained: a GGUF file dequantized
        where = str(checkpoint)
    template = require_chat_template(template, where)
    start = {"checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve())}
    return model.train(), tok, template, frozen_copy(model), start


def _settings(run: Run, prompts, reward, rl_config: RLConfig | None) -> tuple:
    """``(prompt rows, reward function, RLConfig, what run.json records)``; a resume keeps the run's prompts,
    reward and RL settings, refusing others."""
    if run.resumed and prompts is None:
        prompts = run.info.get("prompts")
    if prompts is None:
        raise ValueError("give the prompts to answer: a JSONL path or a list of rows (--prompts)"
                         if not run.resumed else f"cannot resume {run.run_dir} without prompts: they were given as "
                         f"a list, which run.json does not hold; give the same prompts")
    spec = run.keep("reward", reward if isinstance(reward, str) or reward is None else reward_name(reward),
                    default=DEFAULT_REWARD, why="it defines what the run learns")
    fn = reward if reward is not None and not isinstance(reward, str) else load_reward(spec)
    given = None if rl_config is None else rl_config.validate().to_dict()
    rl_cfg = RLConfig.from_dict(run.keep("rl_config", given, default=RLConfig().to_dict(),
                                         why="it defines the run's samples"))
    rows = load_prompts(prompts, fn)
    digest = _digest(rows)
    if run.resumed and run.info.get("prompts_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the prompts differ from those it was trained on; resume "
                         f"with the same prompts, or start a new run")
    path = str(Path(prompts).resolve()) if isinstance(prompts, (str, os.PathLike)) else None
    return rows, fn, rl_cfg, {"prompts": path, "prompts_sha256": digest, "reward": spec, "rl_config": rl_cfg.to_dict()}


def rl(prompts=None, *, out: str | os.PathLike | None = None, checkpoint: str | os.PathLike | None = None,
       base_model=None, reward=None, rl_config: RLConfig | None = None, train_config: TrainConfig | None = None,
       config_overrides: dict | None = None, resume: str | os.PathLike | bool | None = None,
       accelerator: str = "auto", lora: dict | None = None, merge: bool | None = None,
       callbacks: Sequence[L.Callback] = (), progress_bar: bool | str = True, logger: bool = True):
    """Reinforcement learning of a chat model from a checkable reward; return ``(model, tokenizer, summary)``
    (:class:`RLSummary`; the model merged and in eval mode).

    Start from ``checkpoint`` (a chat checkpoint: a decoderlab one with a chat template, or any checkpoint
    :func:`decoderlab.chat.load_model` reads) or ``base_model=(model, tokenizer, template)``. ``prompts``: a JSONL
    path or rows (:func:`decoderlab.reinforcement.prompts.load_prompts`: conversations with the fields the reward
    needs).
    ``reward``: a built-in name (``decoderlab.config.rl.REWARDS``; default ``contains_words``), ``module:function``
    or a function ``reward(reply, row, ended) -> float``. ``rl_config``: G, reply length, sampling, KL
    coefficient, reward scaling (:class:`~decoderlab.config.rl.RLConfig`). ``train_config`` (default
    ``decoderlab.config.RL_TRAIN`` on ``TrainConfig``, plus ``config_overrides``): ``batch_size`` prompts per
    micro-batch, ``accumulate``, ``max_steps``, the optimizer; ``eval_every`` steps between checkpoints. The
    algorithm: :mod:`decoderlab.reinforcement.rollouts` and :mod:`decoderlab.reinforcement.grpo`. ``lora``:
    ``{"rank", "alpha", "dropout", "targets"}`` trains LoRA adapters only: ``out`` keeps the adapter and a pointer
    to its base, checked (as :func:`decoderlab.finetuning.finetune`), and with ``merge`` the merged model once at
    the end, in the base's dtype, in ``out/merged``. ``resume`` (a run directory, a ``.ckpt`` or
    True for ``out``) continues the run with its own prompts, reward, RL settings and adapters (refusing
    others); it samples what the uninterrupted run would have. One process.

    Raises:
        ValueError: a checkpoint without a chat template (fine-tune it first); bad prompts (line and field),
            reward, RL, train or LoRA settings; a refused resume change.
        decoderlab.reinforcement.rewards.RewardError: the reward raised or returned a non-number (the prompt and
            the value named; the checkpoints written before are kept).
        FileNotFoundError: missing files. FileExistsError: a new run's ``out`` holds files.
    """
    run = plan_run(out, resume, train_config, config_overrides, TrainConfig(**RL_TRAIN), fixed=RL_RESUME_FIXED,
                   kind="rl")
    check_run_options(run.cfg, "auto", accelerator)
    rows, fn, rl_cfg, info = _settings(run, prompts, reward, rl_config)
    L.seed_everything(run.cfg.seed, verbose=False)
    model, tok, template, reference, start = _start(run, checkpoint, base_model)
    sampler = RolloutSampler(rows, tok, template, fn, rl_cfg, max_len=model.config.max_len,
                             batch_size=run.cfg.batch_size, accumulate=run.cfg.accumulate, seed=run.cfg.seed)
    settings = run_lora(run, model, lora)
    merge = run_merge(run, merge, settings)
    run.announce()
    pointer = base_pointer(run, start["checkpoint"], model, tok) if settings else {}  # (after every refusal)
    module = RLModule(model, run.cfg, sampler, reference=reference, kl_coef=rl_cfg.kl_coef)
    meta = {"task": "chat", CHAT_TEMPLATE_KEY: template.to_dict(), "tokenizer": tok.kind, "base": start["checkpoint"],
            "method": "rl", "reward": info["reward"], **({"lora": settings} if settings else {}), **pointer}
    merged_dtype = (weights_dtype(start["checkpoint"]) if start["checkpoint"] else torch.float32) if merge else None
    exporter = ExportCheckpoint(run.run_dir, tok, meta, merged_dtype=merged_dtype, every_n_steps=run.cfg.eval_every)
    trainer = make_trainer(run.cfg, run.run_dir, accelerator=accelerator, progress_bar=progress_bar, logger=logger,
                           checkpointing=False,
                           callbacks=[NonFiniteLossGuard(run.run_dir), StepCheckpoint(run.run_dir / LIGHTNING_DIR,
                                      run.cfg.eval_every), exporter, InterruptNotice(run.run_dir, "rl"), *callbacks])
    run.record(trainer, model.config, tok, {"devices": 1}, task="chat", method="rl", template=template.name,
               **{CHAT_TEMPLATE_KEY: template.to_dict()}, **info, checkpoint=start["checkpoint"], lora=settings,
               merge=merge, **pointer)
    seconds = fit_run(trainer, module, run)
    return _finish(trainer, run, module, tok, template, info, rl_cfg, settings, seconds, len(rows),
                   verbose=bool(progress_bar or logger))


def edge_steps(history: list[dict]) -> tuple[float, float, str]:
    """``(mean reward of the first k steps, of the last k, what they are)``: k = min(10, steps // 2), so the
    two never share a step (one step: that step twice, said so); NaN without steps."""
    if not history:
        return float("nan"), float("nan"), "no steps"
    k = max(1, min(_EDGE_STEPS, len(history) // 2))

    def mean(rows):
        return sum(h["reward"] for h in rows) / len(rows)

    words = "its one step" if len(history) == 1 else f"first and last {k} step{'s' if k > 1 else ''}"
    return mean(history[:k]), mean(history[-k:]), words


def _finish(trainer, run: Run, module: RLModule, tok, template, info, rl_cfg, settings, seconds, n_prompts, *,
            verbose: bool):
    """The curves, the summary (and ``summary.json``) and the closing line; the model merged, on the CPU."""
    history = [dict(h) for h in module.history]
    plot = str(plot_history(history, run.run_dir / PLOT_FILE)) if history else None
    device = str(next(module.model.parameters()).device)
    trained = module.model.cpu()
    model = (merge_lora(trained) if has_lora(trained) else trained).eval()

    first, last, edges = edge_steps(history)
    summary = RLSummary(steps=trainer.global_step, history=history, reward_start=first, reward_end=last,
                        reward=info["reward"], prompts=n_prompts,
                        group_size=rl_cfg.group_size, plot=plot, template=template.name,
                        num_parameters=model.num_parameters(), trainable_parameters=trainable_parameters(trained),
                        lora=settings, train_seconds=seconds, run_dir=str(run.run_dir), device=device)
    run.write_summary(trainer, summary)
    if verbose and history:
        last = history[-1]
        print(f"reinforcement learning for {summary.steps} steps: mean reward {summary.reward_start:.4f} -> "
              f"{summary.reward_end:.4f} ({edges}), KL "
              f"{last['kl']:.4f} nats/token, reply length {last['reply_length']:.1f} tokens, end of turn "
              f"{last['end_of_turn_rate']:.0%}; curves in {plot}", file=sys.stdout)
    return model, tok, summary
