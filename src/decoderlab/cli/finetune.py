"""``decoderlab finetune``: a base checkpoint (or a preset from scratch) fine-tuned on conversations with a chat
template (``decoderlab.finetuning.finetune``)."""

from __future__ import annotations

from ..config.defaults import (DPO_BETA, FINETUNE_EVAL_PROMPTS, FINETUNE_TRAIN, FINETUNE_VAL_FRACTION,
                               TRAIN_DEFAULTS)
from ..config.names import (DEFAULT_BPE_VOCAB_SIZE, DEFAULT_TEMPLATE, DEFAULT_TOKENIZER, FINETUNE_METHODS, TEMPLATES,
                            TOKENIZERS)
from ..config.presets import PRESETS
from ..output import KeepWriting
from .argtypes import number, seed
from .errors import FAILED, in_flag_terms, print_error
from .options import (LORA_OPTIONS, RUN_OPTIONS, SHAPE_FIELDS, THREADS_OPTIONS, add_checkpoint_option,
                      add_model_shape_options, add_options, add_train_config_options, check_checkpoint, check_out_dir,
                      check_strategy, flag, lora_options, model_overrides, progress_mode, run_out, set_threads,
                      train_overrides)
from .resume import record_options, restore_options

DESCRIPTION = ("Fine-tune a base checkpoint (or a preset from scratch) on conversations: a JSONL file of "
               "{\"messages\": [...]}, {\"prompt\", \"completion\"} or Alpaca {\"instruction\", \"input\", "
               "\"output\"} lines. Only the assistant's tokens and the end of turn after them are trained. With --method "
               "dpo: preference pairs in TRL's format ({\"prompt\", \"chosen\", \"rejected\"}, as text or messages). "
               "The run directory becomes a chat checkpoint storing its template, for `decoderlab chat` and "
               "`generate --chat`.")

#: TrainConfig flags that fine-tuning does not use (the held-out split is --val-fraction / --val-data)
_SKIP = ("val_batches", "full_val_below")


def add_finetune(p) -> None:
    p.description = DESCRIPTION
    start = p.add_mutually_exclusive_group()  # one of them, unless --resume
    add_checkpoint_option(start, required=False, role="the base model to fine-tune",
                          default="none; give it or --preset")
    start.add_argument("--preset", default=None, choices=tuple(PRESETS),
                       help="train from scratch with this preset, the tokenizer built from the data (default: none; "
                            "give it or --checkpoint)")
    _add_data_options(p)
    g = p.add_argument_group("training (defaults: decoderlab.config.FINETUNE_TRAIN on TrainConfig)")
    g.add_argument("--tokenizer", default=None, choices=TOKENIZERS,
                   help=f"tokenizer built from the data, with --preset (default {DEFAULT_TOKENIZER})")
    g.add_argument("--vocab-size", type=number(int), default=None, metavar="N",
                   help=f"BPE vocabulary size, with --preset --tokenizer bpe (default {DEFAULT_BPE_VOCAB_SIZE})")
    add_train_config_options(g, {**TRAIN_DEFAULTS, **FINETUNE_TRAIN}, skip=_SKIP,
                             helps={"batch_size": "conversations per batch per process", "lr": "peak learning rate"})
    g.add_argument("--group-by-length", action="store_true", default=None,
                   help="batch conversations of nearly one length, so little of each step is padding (every "
                        "conversation still seen once per epoch) (default False)")
    add_options(g, RUN_OPTIONS)
    add_options(g, THREADS_OPTIONS)
    add_model_shape_options(p)
    lora = p.add_argument_group("LoRA adapters")
    add_options(lora, LORA_OPTIONS)
    lora.add_argument("--dtype", default=None, choices=("auto", "float32"),
                      help="the frozen base of a LoRA run: auto keeps a GGUF file's block weights in their blocks "
                           "under the adapters (QLoRA-style: memory close to the file's), float32 dequantizes them "
                           "(a float32 copy); a full fine-tune trains float32 weights (default auto)")
    p.set_defaults(func=cmd_finetune)


def _overrides(args) -> dict:
    out = train_overrides(args, _SKIP)
    return {**out, "group_by_length": True} if args.group_by_length else out


def _add_data_options(p) -> None:
    p.add_argument("--data", default=None, metavar="PATH",
                   help="the JSONL file of conversations (with --method dpo: of preference pairs); a resume reads "
                        "the run's own (default: none; give it or --resume)")
    p.add_argument("--method", default=None, choices=FINETUNE_METHODS,
                   help="sft: supervised on conversations; dpo: preference pairs against the starting model, "
                        "frozen (default sft)")
    p.add_argument("--beta", type=number(float), default=None, metavar="X",
                   help=f"DPO's beta, the strength of the pull to the starting model, with --method dpo "
                        f"(default {DPO_BETA:g})")
    p.add_argument("--val-data", default=None, metavar="PATH",
                   help="a held-out JSONL file (default: hold out --val-fraction of --data)")
    p.add_argument("--val-fraction", type=number(float, 0), default=None, metavar="X",
                   help=f"share of --data held out, seeded; 0 = none, evaluate on the training data (default "
                        f"{FINETUNE_VAL_FRACTION:g})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run/checkpoint directory to write (default: none; give it, or --resume RUN_DIR)")
    p.add_argument("--template", default=None, metavar="NAME",
                   help=f"chat template: {', '.join(TEMPLATES)}, or a *.jinja file (a Hugging Face chat template); "
                        f"a --checkpoint's own is kept (default {DEFAULT_TEMPLATE})")
    p.add_argument("--seed", type=seed(32), default=None, metavar="N",
                   help=f"random seed of the split, the batches and new weights (default {TRAIN_DEFAULTS['seed']})")
    p.add_argument("--eval-prompts", type=number(int, 0), default=None, metavar="N",
                   help=f"held-out prompts answered greedily at the end (default {FINETUNE_EVAL_PROMPTS})")


def _check_start(args, shape: dict) -> None:
    """One way to start: --checkpoint, --preset (with the from-scratch flags) or --resume."""
    if args.resume is None and args.data is None:
        raise ValueError("give --data PATH (the JSONL file to fine-tune on), or --resume RUN_DIR (a run's own data)")
    if args.resume is None and args.checkpoint is None and args.preset is None:
        raise ValueError("give --checkpoint PATH (a base model to fine-tune) or --preset NAME (a model from scratch)")
    if args.resume is not None and (args.checkpoint or args.preset or shape):
        raise ValueError("--resume continues a run with its own model; give no --checkpoint, --preset or shape flags")
    check_checkpoint(args.checkpoint)  # before the data is read
    scratch_only = [f for f in ("tokenizer", "vocab_size", *SHAPE_FIELDS) if getattr(args, f) is not None]
    if args.preset is None and scratch_only:
        verb = "applies" if len(scratch_only) == 1 else "apply"
        raise ValueError(f"{', '.join(flag(f) for f in scratch_only)} {verb} with --preset (a model from scratch); a "
                         f"checkpoint keeps its tokenizer and shape")


@in_flag_terms
def cmd_finetune(args) -> int:
    with KeepWriting():  # a closed output must not cost the run: training goes on, its lines discarded
        return _finetune(args)


def _finetune(args) -> int:
    args.out = run_out(args)
    check_out_dir(args.out)
    set_threads(args)
    restore_options(args)  # a resume's options are the run's
    if args.eval_prompts is None:
        args.eval_prompts = FINETUNE_EVAL_PROMPTS
    shape = model_overrides(args)
    _check_start(args, shape)
    from ..chat import get_template

    if args.template is not None:
        get_template(args.template)  # an unknown name lists the known ones, before the data is read
    if shape:
        from ..model import preset

        preset(args.preset, **shape)  # the shape's errors before the data is read
    check_strategy(args.strategy)
    lora = lora_options(args)
    from ..finetuning import finetune
    from ..training import NonFiniteLossError

    try:  # template, val fraction and tokenizer not given: the defaults, or a resumed run's own
        _, _, s = finetune(args.data, out=args.out, checkpoint=args.checkpoint, preset=args.preset,
                           template=args.template, val_data=args.val_data, val_fraction=args.val_fraction,
                           tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           model_overrides=shape or None, config_overrides=_overrides(args),
                           resume=args.resume, devices=args.devices, strategy=args.strategy,
                           num_nodes=args.num_nodes, progress_bar=progress_mode(args), method=args.method,
                           beta=args.beta, lora=lora, merge=args.merge or None, dtype=args.dtype,
                           eval_prompts=args.eval_prompts, callbacks=[record_options(args)])
    except NonFiniteLossError as e:
        print_error(e)
        return FAILED
    if s.is_global_zero:
        print(f"fine-tuned and evaluated on {s.device}; checkpoint written to {s.run_dir} (template "
              f"{s.template!r}); talk with it: decoderlab chat "
              f"--checkpoint {s.run_dir}")
    return 0
