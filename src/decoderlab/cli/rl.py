"""``decoderlab rl``: reinforcement learning of a chat checkpoint from a checkable reward
(``decoderlab.reinforcement.rl``)."""

from __future__ import annotations

from ..config.defaults import RL_DEFAULTS, RL_TRAIN, TRAIN_DEFAULTS
from ..config.names import DEFAULT_REWARD, REWARDS
from ..output import KeepWriting
from .argtypes import number, seed
from .errors import FAILED, in_flag_terms, print_error
from .options import (LORA_OPTIONS, RUN_OPTIONS, THREADS_OPTIONS, add_checkpoint_option, add_options,
                      add_train_config_options, check_checkpoint, check_out_dir, dest, lora_options, progress_mode,
                      run_out, set_threads, train_overrides)
from .resume import record_options, restore_options

DESCRIPTION = ("Reinforcement learning of a chat checkpoint from a checkable reward: each step samples G replies "
               "per prompt, rewards them, and follows the policy gradient of the reward minus its group's mean "
               "(GRPO-style, optionally with a KL penalty to the starting model). The run directory becomes a chat "
               "checkpoint; rl.png draws the reward, KL, reply length and end-of-turn rate per step.")

#: TrainConfig flags that reinforcement learning does not use (it has no validation split)
_SKIP = ("val_batches", "full_val_below", "val_batch_size", "val_fraction")
_RL = RL_DEFAULTS
#: (flag, RLConfig field, argparse keywords, help)
_RL_OPTIONS = (
    ("--group-size", "group_size", dict(type=number(int), metavar="G"), "replies sampled per prompt (>= 2)"),
    ("--max-new-tokens", "max_new_tokens", dict(type=number(int, 1), metavar="N"), "the longest reply, in tokens"),
    ("--temperature", "temperature", dict(type=number(float, 0, above=True), metavar="T"), "sampling temperature (> 0)"),
    ("--top-k", "top_k", dict(type=number(int, 0), metavar="K"), "sample among the K likeliest tokens"),
    ("--top-p", "top_p", dict(type=number(float, 0, maximum=1, above=True), metavar="P"), "nucleus sampling"),
    ("--kl-coef", "kl_coef", dict(type=number(float), metavar="X"),
     "weight of the KL penalty to the starting model (the KL is recorded either way)"),
)


def add_rl(p) -> None:
    p.description = DESCRIPTION
    add_checkpoint_option(p, required=False, role="the chat model to train (one with a chat template: written by "
                          "`decoderlab finetune`, or a chat model's directory or GGUF file)",
                          default="none; give it or --resume")
    p.add_argument("--prompts", default=None, metavar="PATH",
                   help="JSONL of conversations to answer ({\"messages\": [...]} or {\"prompt\": ...}) with the "
                        "fields the reward needs (default: none; give it or --resume)")
    p.add_argument("--reward", default=None, metavar="NAME",
                   help=f"a built-in reward ({', '.join(REWARDS)}) or module:function, a function (reply, row, "
                        f"ended) -> float (default {DEFAULT_REWARD})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run/checkpoint directory to write (default: none; give it, or --resume RUN_DIR)")
    p.add_argument("--seed", type=seed(32), default=None, metavar="N",
                   help=f"random seed of the prompts' order and the samples (default {TRAIN_DEFAULTS['seed']})")
    g = p.add_argument_group("sampling and reward (defaults: decoderlab.config.RLConfig)")
    for flag_, field, kwargs, text in _RL_OPTIONS:
        g.add_argument(flag_, dest=field, default=None, help=f"{text} (default {_RL[field]})", **kwargs)
    g.add_argument("--scale-rewards", action="store_true", default=None,
                   help="divide the advantages by the group's standard deviation, as GRPO (default: reward minus mean)")
    t = p.add_argument_group("training (defaults: decoderlab.config.RL_TRAIN on TrainConfig)")
    add_train_config_options(t, {**TRAIN_DEFAULTS, **RL_TRAIN}, skip=_SKIP,
                             helps={"batch_size": "prompts per micro-batch (each answered G times)",
                                    "eval_every": "optimizer steps between checkpoints"})
    add_options(t, [o for o in RUN_OPTIONS if dest(o) in ("resume", "no_progress_bar")])
    add_options(t, THREADS_OPTIONS)
    add_options(p.add_argument_group("LoRA adapters"), LORA_OPTIONS)
    p.set_defaults(func=cmd_rl)


def _rl_config(args):
    """The ``RLConfig`` of the flags (None on a resume without them: the run's own)."""
    from ..config.rl import RLConfig

    changes = {f: getattr(args, f) for _, f, _, _ in _RL_OPTIONS if getattr(args, f) is not None}
    if args.scale_rewards:
        changes["scale_rewards"] = True
    return RLConfig(**{**_RL, **changes}) if changes or args.resume is None else None


@in_flag_terms
def cmd_rl(args) -> int:
    with KeepWriting():  # a closed output must not cost the run: training goes on, its lines discarded
        return _rl(args)


def _rl(args) -> int:
    args.out = run_out(args)
    check_out_dir(args.out)
    set_threads(args)
    restore_options(args)  # a resume's options are the run's
    if args.resume is None and (args.checkpoint is None or args.prompts is None):
        raise ValueError("give --checkpoint PATH (a chat checkpoint) and --prompts PATH (the prompts to answer)")
    check_checkpoint(args.checkpoint)  # before the prompts are read
    rl_config, lora = _rl_config(args), lora_options(args)
    from ..reinforcement import rl
    from ..training import NonFiniteLossError

    try:
        _, _, s = rl(args.prompts, out=args.out, checkpoint=args.checkpoint, reward=args.reward, rl_config=rl_config,
                     config_overrides=train_overrides(args, _SKIP), resume=args.resume, lora=lora,
                     merge=args.merge or None, progress_bar=progress_mode(args),
                     callbacks=[record_options(args)])
    except NonFiniteLossError as e:
        print_error(e)
        return FAILED
    print(f"checkpoint written to {s.run_dir}; talk with it: decoderlab chat --checkpoint {s.run_dir}")
    return 0
