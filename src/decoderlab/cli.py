"""The ``decoderlab`` command line: thin commands over the library API.

Each subcommand parses its options and calls one library function; the commands hold no logic the Python
API lacks. Errors a user can cause (bad paths, bad values) print ``decoderlab: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from contextlib import contextmanager

from ._version import __version__

# ---------------------------------------------------------------------------------------------------------
# Defaults and choices, mirrored here so that `decoderlab --help` imports no torch. Each mirror is checked
# against its source (TrainConfig, train_pairs, PRESETS, POSITIONS/NORMS/MLPS, TOKENIZERS ...) by
# tests/test_package.py, so the help cannot drift from what the library does.
# ---------------------------------------------------------------------------------------------------------

#: ``decoderlab.training.TrainConfig``'s defaults for the fields that have a flag
TRAIN_DEFAULTS = {"max_steps": 2000, "batch_size": 12, "lr": 1e-3, "min_lr": 1e-4, "warmup": 100,
                  "precision": "32", "compile": False, "seed": 42, "eval_every": 250, "val_batches": None,
                  "grad_clip": 1.0, "accumulate": 1, "log_every": 50, "optimizer": "adamw", "muon_lr": 0.05,
                  "schedule": "cosine", "cooldown": 0.4, "full_val_below": None}
#: ``decoderlab.training.optim.OPTIMIZERS`` and ``SCHEDULES``
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
#: ``decoderlab.training.recipes``: the recipe names, the default one and its TrainConfig fields
RECIPE_NAMES = ("baby-shakespeare-nanogpt", "baby-shakespeare-speedrun")
DEFAULT_RECIPE = "baby-shakespeare-speedrun"
DEFAULT_RECIPE_TRAIN = dict(max_steps=450, batch_size=12, optimizer="muon", muon_lr=0.05, lr=3e-3, min_lr=3e-4,
                            warmup=50, schedule="cosine", eval_every=150, val_batches=4, val_batch_size=64,
                            full_val_at_end=True, log_every=50)
#: ``decoderlab.training.train_pairs``' defaults (the lesson: 30 epochs, seed 42, Adam lr 0.1, batch size 1)
PAIR_DEFAULTS = {"max_epochs": 30, "seed": 42, "lr": 0.1, "batch_size": 1}
#: ``decoderlab.training.PRECISIONS``
PRECISIONS = ("32", "bf16-mixed")
#: ``decoderlab.model.PRESETS``: names, and the shape fields a flag can override
PRESET_NAMES = ("statquest", "baby-shakespeare", "baby-shakespeare-speedrun", "shakespeare-char", "gpt2")
#: what ``train --preset`` takes: the model presets and the recipes (a recipe's name wins), gpt2 last
TRAIN_PRESET_NAMES = (*PRESET_NAMES[:3], "baby-shakespeare-nanogpt", *PRESET_NAMES[3:])
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "max_len", "dropout", "position", "norm", "mlp")
PRESET_SHAPES = {
    "statquest": dict(n_layer=1, n_head=1, d_model=2, max_len=6, dropout=0.0, position="sinusoidal", norm="none",
                      mlp="none"),
    "baby-shakespeare": dict(n_layer=4, n_head=4, d_model=128, max_len=64, dropout=0.0, position="learned",
                             norm="layernorm", mlp="gelu"),
    "baby-shakespeare-speedrun": dict(n_layer=4, n_head=4, d_model=128, max_len=64, dropout=0.0, position="rope",
                                      norm="layernorm", mlp="relu2"),
    "shakespeare-char": dict(n_layer=6, n_head=6, d_model=384, max_len=256, dropout=0.2, position="learned",
                             norm="layernorm", mlp="gelu"),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, max_len=1024, dropout=0.0, position="learned",
                 norm="layernorm", mlp="gelu"),
}
#: ``decoderlab.positions.POSITIONS``, ``decoderlab.model.NORMS``, ``decoderlab.model.MLPS``
MODEL_CHOICES = {"position": ("sinusoidal", "learned", "rope", "none"), "norm": ("none", "layernorm", "rmsnorm"),
                 "mlp": ("none", "gelu", "relu2")}
#: ``decoderlab.tokenizers.TOKENIZERS`` and ``DEFAULT_BPE_VOCAB_SIZE``
TOKENIZER_KINDS = ("word", "char", "bpe")
DEFAULT_TOKENIZER = "char"
DEFAULT_BPE_VOCAB_SIZE = 1024
#: what generate and chat use for options not given (``ChatSession``'s for language models)
GENERATE_DEFAULTS = {"max_new_tokens": 200, "temperature": 1.0}
#: ``decoderlab.finetuning.FINETUNE_DEFAULTS``: the TrainConfig fields fine-tuning sets (the rest: TRAIN_DEFAULTS)
FINETUNE_CONFIG = {"max_steps": 500, "batch_size": 16, "lr": 3e-4, "min_lr": 3e-5, "warmup": 20, "eval_every": 100}
FINETUNE_TRAIN_DEFAULTS = {**TRAIN_DEFAULTS, **FINETUNE_CONFIG}
#: ``decoderlab.finetuning.finetune``'s defaults for the arguments that have a flag
FINETUNE_DEFAULTS = {"template": "decoderlab", "val_fraction": 0.1, "tokenizer": "char", "eval_prompts": 100}
#: ``decoderlab.chat.TEMPLATES``
CHAT_TEMPLATES = ("decoderlab", "lesson")

#: the Python names in library messages -> the flags a user typed (see :func:`_in_flag_words`)
FIELD_FLAGS = {**{f: "--" + f.replace("_", "-") for f in (*TRAIN_DEFAULTS, "vocab_size", "n_layer", "n_head",
                                                          "d_model", "max_len", "dropout", "val_fraction",
                                                          "eval_prompts", "threads")},
               "max_epochs": "--epochs"}
_FIELD_RE = re.compile(r"(?<![\w./-])(" + "|".join(sorted(FIELD_FLAGS, key=len, reverse=True)) + r")(?![\w/-]|\.\w)")


def _in_flag_words(message: str) -> str:
    """A library message in the words of the command line: ``max_steps must be ...`` -> ``--max-steps must
    be ...`` (whole words only; names inside paths and file names are left alone)."""
    return _FIELD_RE.sub(lambda m: FIELD_FLAGS[m.group(1)], str(message))


class ArgumentParser(argparse.ArgumentParser):
    """argparse with decoderlab's one-line errors: ``decoderlab: error: --max-steps must be an integer, got
    'x' (see decoderlab train --help)`` and exit status 2."""

    def error(self, message: str):
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m:
            flag = m.group(1).split("/")[-1]
            message = f"{flag} {m.group(2)}" if m.group(2).startswith("must ") else f"{flag}: {m.group(2)}"
        self.exit(2, f"decoderlab: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is named alone: ``generate --devices 2 The`` said "unrecognized
        arguments: --devices The" (the words after an unknown flag are left over too); now "unrecognized
        option: --devices (see decoderlab generate --help)". Left-over words without a flag are listed."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [a.split("=", 1)[0] for a in extras
                     if a.startswith("-") and a != "-" and not re.fullmatch(r"-\d+(\.\d*)?", a)]
            parser = self
            for action in self._actions:  # the subcommand's parser names its own --help
                if isinstance(action, argparse._SubParsersAction):
                    parser = action.choices.get(getattr(ns, action.dest, None), self)
            if flags:
                parser.error(f"unrecognized option{'s' if len(flags) > 1 else ''}: {', '.join(flags)}")
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def _number(kind, minimum=None, what: str = ""):
    """An argparse type: an int or float (>= ``minimum`` if given), with an error in our words."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}{what}, "
                                             f"got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{what}, got {text}")
        return value
    parse.integer = kind is int
    return parse


def _seed(exponent: int):
    """An argparse type for ``--seed``: an integer in 0 .. 2**exponent-1 (63: a sampling ``torch.Generator``;
    32: training, whose ``seed_everything`` seeds NumPy), refused in those words rather than as torch's
    "Overflow when unpacking long long"."""
    def parse(text: str):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not 0 <= value < 2**exponent:
            raise argparse.ArgumentTypeError(f"must be an integer in 0 .. 2**{exponent}-1, got {text!r}")
        return value
    parse.integer = True
    return parse


_DEVICES_HELP = "a number of devices >= 1, -1 (all), 'auto', or device indices such as 0,1"


def _devices(text: str):
    """``--devices``: an int >= 1, -1, "auto", or a comma-separated list of device indices ("0,1", "1,")."""
    value = text.strip()
    if value == "auto" or ("," in value and re.fullmatch(r"\d+(,\d+)*,?", value)):
        return value
    if re.fullmatch(r"-1|[1-9]\d*", value):
        return int(value)
    raise argparse.ArgumentTypeError(f"must be {_DEVICES_HELP}; got {text!r}")


# ---------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------


def _default(field: str, defaults: dict = TRAIN_DEFAULTS) -> str:
    value = defaults[field]
    if value is None:
        return "never" if field == "full_val_below" else "all"
    return f"{value:g}" if isinstance(value, float) else str(value)


#: (flag, TrainConfig field, argparse type, help); each help gets "(default ...)" from TRAIN_DEFAULTS; the
#: values are checked by TrainConfig, whose messages are put in the flags' words
TRAIN_OPTIONS = (
    ("--max-steps", "max_steps", _number(int), "optimizer steps"),
    ("--batch-size", "batch_size", _number(int), "sequences per batch per process (statquest: pairs per batch)"),
    ("--lr", "lr", _number(float), "peak learning rate (statquest: Adam's learning rate)"),
    ("--min-lr", "min_lr", _number(float), "learning rate at the end of the cosine decay"),
    ("--warmup", "warmup", _number(int), "steps of linear warm-up (keep it below --max-steps)"),
    ("--eval-every", "eval_every", _number(int), "optimizer steps between evaluations (and checkpoints)"),
    ("--val-batches", "val_batches", _number(int), "evaluate on at most this many batches of 64 windows"),
    ("--log-every", "log_every", _number(int), "optimizer steps between progress lines and logged train-loss rows"),
    ("--grad-clip", "grad_clip", _number(float), "clip the gradient norm to this, 0 = no clipping"),
    ("--accumulate", "accumulate", _number(int), "batches per optimizer step (gradient accumulation)"),
    ("--muon-lr", "muon_lr", _number(float), "Muon's peak learning rate, with --optimizer muon"),
    ("--cooldown", "cooldown", _number(float), "with --schedule wsd: the last fraction of --max-steps that decays"),
    ("--full-val-below", "full_val_below", _number(float),
     "with --val-batches: also evaluate all validation windows whenever the subset's loss is at or below this"),
)


def add_train_config_options(g, defaults: dict = TRAIN_DEFAULTS, *, skip: tuple = (), helps: dict | None = None,
                             lesson: bool = False, recipe: dict | None = None) -> None:
    """Add the ``TrainConfig`` flags of :data:`TRAIN_OPTIONS` (less ``skip``), ``--optimizer``, ``--schedule``
    and ``--precision`` to ``g``, each help ending with its default from ``defaults`` (and statquest's with
    ``lesson``). With ``recipe`` (the default recipe's fields), a field it sets shows the recipe's value as
    the default and ``defaults``' as the one of a plain model preset. ``helps`` replaces the text of some
    fields. Used by ``train`` and ``finetune``: one option set, read back by :func:`train_overrides`."""
    def default(field: str) -> str:
        extra = f"; statquest {PAIR_DEFAULTS[field]:g}" if lesson and field in PAIR_DEFAULTS else ""
        if recipe is not None and field in recipe and recipe[field] != defaults[field]:
            return (f"(default {_default(field, recipe)}; {_default(field, defaults)} with a plain model "
                    f"preset{extra})")
        return f"(default {_default(field, defaults)}{extra})"

    for flag, field, kind, text in TRAIN_OPTIONS:
        if field in skip:
            continue
        text = (helps or {}).get(field, text)
        g.add_argument(flag, dest=field, type=kind, default=None, metavar="N" if kind.integer else "X",
                       help=f"{text} {default(field)}")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help=f"adamw: AdamW for every parameter; muon: Muon for the blocks' weight matrices, AdamW "
                        f"(--lr) for embeddings, gains and biases {default('optimizer')}")
    g.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help=f"after the warm-up: cosine decay to --min-lr, or wsd (flat, then a linear decay over "
                        f"the last --cooldown) {default('schedule')}")
    g.add_argument("--precision", default=None, choices=PRECISIONS,
                   help=f"32 = float32; bf16-mixed = bfloat16 autocast, float32 weights {default('precision')}")


def add_threads_option(p) -> None:
    """``--threads`` (``train``, ``generate``/``sample``, ``chat``, ``serve``), applied by :func:`set_threads`."""
    p.add_argument("--threads", type=_number(int), default=None, metavar="N",
                   help="PyTorch intra-op threads (default: the cores the 1-minute load average leaves idle, "
                        "at most 2; see decoderlab.threads)")


def set_threads(args) -> int:
    """``torch.set_num_threads`` from ``--threads``, or chosen from the machine's cores and load."""
    from .threads import set_threads as set_torch_threads

    try:
        return set_torch_threads(getattr(args, "threads", None))
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def add_run_options(g) -> None:
    """``--resume``, ``--devices``, ``--strategy``, ``--num-nodes``, ``--no-progress-bar`` (``train``,
    ``finetune``)."""
    g.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                   help="continue a run: its directory or a .ckpt; without a value: --out (default: a new run)")
    g.add_argument("--devices", type=_devices, default="1", metavar="N",
                   help=f"{_DEVICES_HELP}, per node (default %(default)s)")
    g.add_argument("--strategy", default="auto",
                   help="Lightning strategy: auto, ddp, ddp_spawn, fsdp, deepspeed, ... (default %(default)s)")
    g.add_argument("--num-nodes", type=_number(int, 1), default=1, metavar="N",
                   help="machines (default %(default)s)")
    g.add_argument("--no-progress-bar", action="store_true",
                   help="plain progress lines instead of the bar (the default when the output is not a terminal)")


def train_overrides(args, skip: tuple = ()) -> dict:
    """The ``TrainConfig`` fields given with :func:`add_train_config_options`' flags (and ``--seed``,
    ``--compile`` where the command has them), as ``{field: value}``."""
    fields = [f for _, f, _, _ in TRAIN_OPTIONS if f not in skip] + ["optimizer", "schedule", "precision",
                                                                      "compile", "seed"]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def add_model_shape_options(parser) -> None:
    """Add the model-shape flags (``--n-layer``, ``--n-head``, ``--d-model``, ``--max-len``, ``--dropout``,
    ``--position``, ``--norm``, ``--mlp``) to ``parser``: ``ModelConfig`` fields on top of ``--preset``.
    :func:`model_overrides` reads them back. Used by ``train`` (and ``finetune``)."""
    g = parser.add_argument_group("model shape (ModelConfig fields on top of --preset; default: the preset's)")

    def presets(field: str) -> str:  # statquest trains the lesson's fixed model
        return ", ".join(f"{name} {PRESET_SHAPES[name][field]}" for name in PRESET_NAMES if name != "statquest")

    g.add_argument("--n-layer", type=_number(int), default=None, metavar="N",
                   help=f"decoder blocks (default: {presets('n_layer')})")
    g.add_argument("--n-head", type=_number(int), default=None, metavar="N",
                   help=f"attention heads; must divide --d-model (default: {presets('n_head')})")
    g.add_argument("--d-model", type=_number(int), default=None, metavar="N",
                   help=f"values per token, the embedding size (default: {presets('d_model')})")
    g.add_argument("--max-len", type=_number(int), default=None, metavar="N",
                   help=f"context length in tokens; each data split needs more tokens than this "
                        f"(default: {presets('max_len')})")
    g.add_argument("--dropout", type=_number(float), default=None, metavar="P",
                   help=f"dropout probability in [0, 1) (default: {presets('dropout')})")
    for field, what in (("position", "position encoding"), ("norm", "normalisation (pre-norm)"),
                        ("mlp", "MLP after attention")):
        g.add_argument(f"--{field}", choices=MODEL_CHOICES[field], default=None,
                       help=f"{what} (default: {presets(field)})")


def model_overrides(args) -> dict:
    """The ``ModelConfig`` fields given with :func:`add_model_shape_options`' flags, as ``{field: value}``."""
    return {f: getattr(args, f) for f in SHAPE_FIELDS if getattr(args, f, None) is not None}


def add_train(sub) -> None:
    p = sub.add_parser("train", help=f"train a model (default: the {DEFAULT_RECIPE} recipe on the embedded "
                                     "tinyshakespeare)",
                       description="Train a language model on text (a recipe, or a preset's shape changed by the "
                                   "model-shape flags), or with --preset statquest the lesson's model on its two "
                                   f"pairs. The default recipe, {DEFAULT_RECIPE}, is baby-shakespeare's size with "
                                   "rotary positions, QK-norm, ReLU² and zero-initialised projections, trained "
                                   "with Muon + AdamW for 450 steps (README: \"Training a GPT on text\"). "
                                   "Progress: a bar on a terminal; plain lines when the output is redirected or "
                                   "with --no-progress-bar.")
    p.add_argument("--preset", default=None, choices=TRAIN_PRESET_NAMES,
                   help=f"a recipe ({', '.join(RECIPE_NAMES)}: a model and its training settings) or a model "
                        f"preset (trained with TrainConfig's defaults); statquest trains the lesson's pairs "
                        f"(default {DEFAULT_RECIPE})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run/checkpoint directory to write (default runs/<timestamp>; statquest: runs/statquest)")
    p.add_argument("--epochs", type=_number(int), default=None, metavar="N",
                   help=f"epochs of pair training, statquest only (default {PAIR_DEFAULTS['max_epochs']})")
    p.add_argument("--seed", type=_seed(32), default=None, metavar="N",
                   help=f"random seed of the weights and batches (default {TRAIN_DEFAULTS['seed']})")
    g = p.add_argument_group("language-model training (defaults: decoderlab.training.TrainConfig)")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a UTF-8 text file or a folder of .txt files (default: the embedded tinyshakespeare)")
    g.add_argument("--tokenizer", default=None, choices=TOKENIZER_KINDS,
                   help=f"tokenizer built from the data (default {DEFAULT_TOKENIZER})")
    g.add_argument("--vocab-size", type=_number(int), default=None, metavar="N",
                   help=f"BPE vocabulary size, at least 259 (default {DEFAULT_BPE_VOCAB_SIZE}; bpe only)")
    add_train_config_options(g, lesson=True, recipe=DEFAULT_RECIPE_TRAIN)
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the decoder blocks (default: off)")
    add_run_options(g)
    add_threads_option(g)
    add_model_shape_options(p)
    p.set_defaults(func=cmd_train)


#: flags that apply to language-model training only (statquest trains the lesson's pairs)
_LM_ONLY = ("data", "tokenizer", "vocab_size", "max_steps", "min_lr", "warmup", "precision", "compile", "eval_every",
            "val_batches", "log_every", "grad_clip", "accumulate", "resume", "optimizer", "muon_lr", "schedule",
            "cooldown", "full_val_below", *SHAPE_FIELDS)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_out_dir(out) -> None:
    """``--out`` must be a directory, or not exist yet below directories: an existing file gets one sentence."""
    # os.path rather than pathlib: --help and the argument checks stay quick to start (bench/startup.py)
    path = os.path.normpath(str(out))
    p = path
    while True:
        if os.path.exists(p):
            if not os.path.isdir(p):
                raise ValueError(f"--out {out} is a file, not a directory" if p == path
                                 else f"--out {out}: {p} is a file, not a directory")
            return
        parent = os.path.dirname(p)
        if parent == p or not parent:
            return
        p = parent


@contextmanager
def _warnings_as_lines():
    """decoderlab's own warnings as ``decoderlab: warning: ...`` lines in the words of the flags (other
    libraries' warnings are shown as usual)."""
    package = os.path.dirname(os.path.realpath(__file__))
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if os.path.realpath(filename).startswith(package) and issubclass(category, UserWarning):
            print(f"decoderlab: warning: {_in_flag_words(message)}", file=sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("default", UserWarning)
        warnings.showwarning = showwarning
        yield


def cmd_train(args) -> int:
    try:
        with _warnings_as_lines():
            return _train(args)
    except ValueError as e:
        raise ValueError(_in_flag_words(e)) from None


def _train(args) -> int:
    set_threads(args)
    name = args.preset or DEFAULT_RECIPE
    if args.out is not None:
        _check_out_dir(args.out)
    if name == "statquest":
        return _train_statquest(args)
    if args.epochs is not None:
        raise ValueError(f"--epochs applies to --preset statquest only; a language model trains for --max-steps "
                         f"(default {DEFAULT_RECIPE_TRAIN['max_steps']})")
    from .training import NonFiniteLossError, train_lm

    overrides = train_overrides(args)
    shape = model_overrides(args)
    if args.resume is not None:
        if shape:
            raise ValueError(f"{', '.join(_flag(f) for f in shape)}: a resumed run keeps its model shape "
                             f"(its config.json); give the shape flags to a new run")
        _check_not_finished(args)
    elif shape:
        from .model import preset
        from .training.recipes import resolve

        preset(resolve(name)[0], **shape)  # the shape's errors before the corpus is read and tokenized
    _check_strategy(args.strategy)
    progress = True if sys.stdout.isatty() and not args.no_progress_bar else "plain"
    try:
        preset = name if args.resume is None else args.preset  # a resumed run keeps its own
        model, tok, s = train_lm(args.data, preset=preset, tokenizer=args.tokenizer,
                                 vocab_size=args.vocab_size, out=args.out, config_overrides=overrides,
                                 model_overrides=shape or None, resume=args.resume, devices=args.devices,
                                 strategy=args.strategy, num_nodes=args.num_nodes, progress_bar=progress)
    except NonFiniteLossError as e:
        print(f"decoderlab: error: {e}", file=sys.stderr)
        return 1
    if s.is_global_zero:
        if args.resume is not None:  # the run's own preset or recipe
            from .checkpoint import read_meta

            name = read_meta(s.run_dir).get("preset") or name
        print(f"trained {name} ({s.num_parameters:,} parameters) for {s.steps} steps: train loss {s.train_loss:.4f} "
              f"(mean of the last {s.train_loss_steps} steps), {s.tokens_per_second:,.0f} tokens per second")
        if s.val_loss is not None:
            step = s.val_history[-1][0] if s.val_history else s.steps
            print(f"final evaluation at step {step}: val loss {s.val_loss:.4f} nats/token (perplexity "
                  f"{s.val_ppl:.2f}, {s.val_bpb:.3f} bits per byte); checkpoint written to {s.run_dir}")
    return 0


def _check_strategy(strategy: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    known = ("auto", *StrategyRegistry.available_strategies())
    if strategy not in known:
        common = [k for k in known if not re.search(r"find_unused|stage|offload|debug", k)]
        raise ValueError(f"--strategy {strategy!r} is not a Lightning strategy; known: {', '.join(common)} (and "
                         f"variants such as fsdp_cpu_offload, deepspeed_stage_2)")


def _check_not_finished(args) -> None:
    """Resuming a run that already reached its --max-steps would train nothing: say so, and how to continue."""
    import json
    from pathlib import Path

    from .checkpoint import read_meta
    from .training import RUN_FILE, resolve_resume

    run_dir, _ = resolve_resume(args.resume, Path(args.out) if args.out is not None else None)
    try:
        planned = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))["train_config"]["max_steps"]
        step = read_meta(run_dir).get("step")
    except (OSError, ValueError, KeyError, TypeError):
        return  # train_lm names what is wrong with the run directory
    max_steps = args.max_steps if args.max_steps is not None else planned
    if isinstance(step, int) and step >= max_steps:
        raise ValueError(f"{run_dir} is already finished: it trained {step} steps of --max-steps {max_steps}; to "
                         f"continue it, give a larger --max-steps: decoderlab train --resume {run_dir} "
                         f"--max-steps {2 * step}")
    if isinstance(step, int):
        print(f"resuming {run_dir} at step {step} of --max-steps {max_steps}", flush=True)


def _train_statquest(args) -> int:
    from .lesson import LESSON_PAIRS, greedy_response, pair_inputs_and_labels
    from .training import train_pairs

    lm_only = [opt for opt in _LM_ONLY if getattr(args, opt) is not None]
    lm_only += [opt for opt, default in (("devices", 1), ("strategy", "auto"), ("num_nodes", 1))
                if getattr(args, opt) != default]
    if lm_only:
        raise ValueError(
            f"--preset statquest trains the lesson's two pairs; {', '.join(_flag(o) for o in lm_only)} "
            f"{'applies' if len(lm_only) == 1 else 'apply'} to language-model presets only (statquest takes "
            f"--out, --epochs, --seed, --lr, --batch-size)"
        )
    out = args.out or "runs/statquest"
    pick = {k: v for k, v in (("max_epochs", args.epochs), ("seed", args.seed), ("lr", args.lr),
                              ("batch_size", args.batch_size)) if v is not None}
    settings = {**PAIR_DEFAULTS, **pick}
    model, tok = train_pairs(out=out, **settings)
    import torch

    with torch.no_grad():
        loss = float(model.compute_loss(pair_inputs_and_labels(LESSON_PAIRS, tok)))
    print(f"trained the lesson's model ({model.num_parameters()} parameters) for {settings['max_epochs']} epochs "
          f"on its two pairs: final loss {loss:.4f} (mean cross-entropy over both pairs)")
    answers = []
    for prompt, _ in LESSON_PAIRS:
        ids = greedy_response(model, tok.encode(prompt) + [tok.eos_id], tok.eos_id)
        answers.append(tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_id else ids))
        print(f'  "{prompt}" -> {answers[-1]}')
    verdict = ('both lesson prompts are answered "awesome"' if all(a == "awesome" for a in answers)
               else 'not both lesson prompts are answered "awesome" (try more --epochs or another --seed)')
    print(f"{verdict}; checkpoint written to {out}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# generate (and its alias sample)
# ---------------------------------------------------------------------------------------------------------


def _add_sampling_options(p, temperature_help: str) -> None:
    p.add_argument("--max-new-tokens", type=_number(int), default=None, metavar="N",
                   help=f"longest continuation in tokens (default {GENERATE_DEFAULTS['max_new_tokens']}; a "
                        "pair-trained model answers until <EOS>)")
    p.add_argument("--temperature", type=_number(float), default=None, metavar="T", help=temperature_help)
    p.add_argument("--top-k", type=_number(int), default=None, metavar="K",
                   help="sample among the K most probable tokens; 0 = no top-k filter (default: no filter)")
    p.add_argument("--top-p", type=_number(float), default=None, metavar="P",
                   help="nucleus sampling: the most probable tokens up to probability P in (0, 1] (default: no "
                        "filter)")
    p.add_argument("--seed", type=_seed(63), default=None, metavar="N",
                   help="seed for reproducible sampling (default: fresh entropy)")


def _add_checkpoint_option(p, required: bool = True) -> None:
    p.add_argument("--checkpoint", required=required, default=None, metavar="DIR",
                   help="a decoderlab checkpoint or training run directory, or a Hugging Face GPT-2 directory "
                        "(config.json, model.safetensors or pytorch_model.bin, tokenizer.json or vocab.json + "
                        "merges.txt)" + ("" if required else " (default: none)"))


GENERATE_DESCRIPTION = (
    "Continue a prompt. The lesson's model (statquest, trained on prompt/response pairs) answers its prompt "
    "greedily until <EOS>, as in the lesson (with --chat its reply is sampled as the options say). "
    "`decoderlab sample` is `decoderlab generate --no-stream --echo` (the same options). With --chat the prompt "
    "is a user message and the reply is rendered with the chat template stored in a checkpoint written by "
    "`decoderlab finetune`; it ends at the end of turn. "
    r"--stop understands the backslash escapes \n \t \r \\ \0 \xHH \uHHHH, so --stop '\n\n' stops at a blank line.")


#: ``decoderlab.dtypes.DTYPES``, named here so that --help imports no torch
DTYPE_NAMES = ("float32", "bfloat16", "float16", "int8")


def _add_dtype_option(p) -> None:
    # checked by load_checkpoint (one error line listing the choices), not by argparse's choices
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help=f"weights for inference: {', '.join(DTYPE_NAMES)} (default float32, as trained; bfloat16 "
                        "and float16 halve the bytes read per token, int8 quarters them with weight-only "
                        "quantization and needs torchao: pip install \"decoderlab[quant]\")")


def _add_generate_options(p) -> None:
    _add_checkpoint_option(p)
    _add_dtype_option(p)
    _add_sampling_options(p, f"sampling temperature, 0 = greedy (default {GENERATE_DEFAULTS['temperature']:g})")
    add_threads_option(p)
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help=r"stop before this text; backslash escapes such as \n and \t are understood (repeatable; "
                        "default: none)")
    p.add_argument("--no-stream", action="store_true",
                   help="print the continuation at the end (default: stream it as it is produced)")
    p.add_argument("--echo", action="store_true",
                   help="print the prompt followed by its continuation, decoded together (a pair-trained model "
                        "then continues the text instead of answering; default: the continuation only)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: one assistant reply with the checkpoint's chat template "
                        "(default: continue the text)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before the prompt, with --chat (default: none)")
    p.add_argument("--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt text (or give it as the positional argument; default: a newline)")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (default: a newline)")
    p.set_defaults(func=cmd_generate)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model (streamed as it is produced)",
                       description=GENERATE_DESCRIPTION)
    _add_generate_options(p)


def add_sample(sub) -> None:
    p = sub.add_parser("sample", help="alias of `generate --no-stream --echo`: print a prompt and its continuation",
                       description=GENERATE_DESCRIPTION)
    _add_generate_options(p)
    p.set_defaults(no_stream=True, echo=True)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0", "'": "'", '"': '"', "a": "\a", "b": "\b",
            "f": "\f", "v": "\v"}
_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.|$)", re.S)


def unescape(text: str, flag: str = "--stop") -> str:
    r"""``text`` with the backslash escapes a user types in a shell turned into characters: ``\n`` (newline),
    ``\t``, ``\r``, ``\\``, ``\0``, ``\'``, ``\"``, ``\a``, ``\b``, ``\f``, ``\v``, ``\xHH``, ``\uHHHH`` and
    ``\UHHHHHHHH`` (as in Python string literals). Any other character stands for itself.

    Raises:
        ValueError: an unknown escape (``\q``) or a lone backslash at the end, showing ``text`` as typed.
    """
    def replace(m: re.Match) -> str:
        e = m.group(1)
        if len(e) > 1:
            return chr(int(e[1:], 16))
        if e in _ESCAPES:
            return _ESCAPES[e]
        what = "ends with a lone backslash" if e == "" else f"has an unknown escape \\{e}"
        raise ValueError(rf"{flag} '{text}' {what}; known escapes: \n \t \r \\ \0 \xHH \uHHHH (write \\ for a "
                         "backslash)")

    return _ESCAPE_RE.sub(replace, text)


def _stops(typed: list[str] | None, tok) -> list[str] | None:
    """The --stop strings, unescaped and checked against the tokenizer; errors show them as typed."""
    if typed is None:
        return None
    stops = []
    for raw in typed:
        stop = unescape(raw)
        if stop == "":
            raise ValueError("--stop '' is empty; give the text to stop before")
        if stop not in getattr(tok, "token_to_id", {}):
            try:
                ids = tok.encode(stop)
            except (KeyError, ValueError) as e:
                msg = e.args[0] if e.args else e
                raise ValueError(f"--stop '{raw}' cannot be encoded by this model's tokenizer: {msg}") from None
            if not ids:
                raise ValueError(f"--stop '{raw}' encodes to no tokens")
        stops.append(stop)
    return stops


def _load(directory, dtype=None):
    """``(model, tokenizer, template, meta)`` of a decoderlab checkpoint or a Hugging Face GPT-2 directory
    (``decoderlab.chat.load_model``), its weights in ``dtype`` for inference (``--dtype``)."""
    from .chat import load_model

    return load_model(directory, dtype=dtype)


def cmd_generate(args) -> int:
    if args.prompt is not None and args.prompt_option is not None:
        raise ValueError("give the prompt once: as the positional argument or with --prompt, not both")
    prompt = args.prompt if args.prompt is not None else args.prompt_option
    if args.system is not None and not args.chat:
        raise ValueError("--system applies with --chat (a system message of a chat checkpoint's conversation)")
    set_threads(args)
    model, tok, template, _ = _load(args.checkpoint, dtype=args.dtype)
    # the lesson's model answers its prompt (the prompt is the user turn of its template), as in the lesson
    if args.chat or (template is not None and template.name == "lesson" and not args.echo):
        return _generate_chat(args, model, tok, template, prompt)
    from .generation import stream_text
    from .tokenizers import EOS

    prompt = "\n" if prompt is None else prompt
    n = GENERATE_DEFAULTS["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens
    # stop strings are matched on the text; <PAD> is never sampled and <EOS> ends a language model's text
    # (where the template opens the assistant turn with it, the lesson's, it separates prompt and answer: the
    # text goes on); with --echo the prompt and its continuation are decoded together, so word tokens keep
    # their separators
    pieces = stream_text(model, tok, tok.encode(prompt), n,
                         temperature=GENERATE_DEFAULTS["temperature"] if args.temperature is None else args.temperature,
                         top_k=args.top_k, top_p=args.top_p, stop=_stops(args.stop, tok),
                         seed=args.seed, echo=args.echo,
                         stop_at_eos=template is None or template.assistant != EOS)
    _write_pieces(pieces, stream=not args.no_stream)
    return 0


def _write_pieces(pieces, *, stream: bool, tail=lambda: "") -> None:
    """Write text pieces as they come (``stream``) or all at the end, then ``tail()`` and a newline. On Ctrl-C,
    what was produced so far is written before the interrupt goes on (``main`` prints the one line, exit 130)."""
    written: list[str] = []
    try:
        for piece in pieces:
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            else:
                written.append(piece)
    except KeyboardInterrupt:
        sys.stdout.write("".join(written) + "\n")
        sys.stdout.flush()
        raise
    sys.stdout.write("".join(written) + tail() + "\n")


def _generate_chat(args, model, tok, template, prompt) -> int:
    """``generate --chat``: one reply to ``prompt`` as a user message (after ``--system``), rendered with the
    checkpoint's template (the renderer fine-tuning used), ending at the end of turn. The lesson's model
    answers so without --chat too: greedily (its sampling options then need --chat), the prompt may end with
    the <EOS> the lesson writes after it, and the answer is printed with its <EOS>."""
    from .chat import stream_chat_reply

    lesson = template is not None and template.name == "lesson"
    if lesson and not args.chat:
        sampling = [o for o in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
                    if getattr(args, o) is not None]
        if sampling:
            raise ValueError(f"{', '.join(_flag(o) for o in sampling)} {'does' if len(sampling) == 1 else 'do'} not "
                             "apply: the lesson's model answers greedily until <EOS>, as in the lesson (give --chat "
                             "to sample its reply)")
        if prompt is not None and prompt.split()[-1:] == [template.assistant]:
            prompt = prompt.rsplit(template.assistant, 1)[0]
    not_here = [f for f, given in (("--stop", args.stop is not None),
                                   ("--echo", args.echo and args.command != "sample")) if given]
    if not_here:
        raise ValueError(f"{', '.join(not_here)} {'does' if len(not_here) == 1 else 'do'} not apply with --chat: "
                         f"the reply ends at the chat template's end of turn")
    if template is None:
        raise ValueError(f"--chat needs a chat checkpoint (written by `decoderlab finetune`); {args.checkpoint} has "
                         f"no chat template in its meta.json")
    if prompt is None:
        raise ValueError("give the user message to answer, e.g. \"hello\"")
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": prompt}]
    default_t = template.default_temperature  # the lesson: greedy
    info: dict = {}
    pieces = stream_chat_reply(
        model, tok, messages, template,
        max_new_tokens=GENERATE_DEFAULTS["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens,
        temperature=default_t if args.temperature is None else args.temperature,
        top_k=None if args.top_k == 0 else args.top_k, top_p=args.top_p, seed=args.seed, info=info)
    _write_pieces(pieces, stream=not args.no_stream,  # the lesson prints its <EOS>
                  tail=lambda: f"{tok.separator}{template.end}" if lesson and info.get("ended_with_end_of_turn")
                  else "")
    return 0


# ---------------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------------

#: the slash commands of ``decoderlab chat``: (name, argument, help); the settings are named as their flags
CHAT_COMMANDS = (
    ("/temperature", "T", "sampling temperature (0 = greedy)"),
    ("/top-k", "K", "sample among the K most probable tokens (0 or off: no top-k filter)"),
    ("/top-p", "P", "nucleus sampling, P in (0, 1] (off: no top-p filter)"),
    ("/max-new-tokens", "N", "longest reply, in tokens"),
    ("/seed", "S", "seed the sampling of the next turns (off: fresh entropy)"),
    ("/reset", "", "forget the conversation"),
    ("/help", "", "this help"),
    ("/quit", "", "leave (also /exit, Ctrl-D)"),
)
CHAT_HELP = "commands (the settings are named as the flags; /top_k, /max_new_tokens ... work too):\n" + "\n".join(
    f"  {f'{name} {arg}'.strip():<19} {text}" for name, arg, text in CHAT_COMMANDS)

CHAT_HELP += "\nCtrl-C stops a reply; Ctrl-D, /quit (or Ctrl-C at the prompt) exits."


class ChatExit(Exception):
    """Raised by :func:`chat_command` for ``/quit`` and ``/exit``: the conversation is over."""


def chat_command(session, line: str) -> str | None:
    """Run a ``/command`` of ``decoderlab chat`` on ``session`` (a ``ChatSession``) and return its message, or
    None when ``line`` is not a command. Settings are named as their flags (``/top-k 20``,
    ``/max-new-tokens 50``; the underscore forms work too); see ``CHAT_COMMANDS``.

    Raises:
        ChatExit: ``/quit`` or ``/exit``.
    """
    from .generation.sampling import MAX_SEED, check_int, check_sampling

    line = line.strip()
    if not line.startswith("/"):
        return None
    typed, _, arg = line[1:].partition(" ")
    name = typed.lower().replace("_", "-")
    arg = arg.strip()
    off = arg.lower() in ("off", "none", "")
    try:
        if name == "help":
            return CHAT_HELP
        if name in ("quit", "exit"):
            raise ChatExit
        if name == "reset":
            session.reset()
            return "(conversation reset)"
        if name == "temperature":
            t = _command_number(typed, arg, float, "a number >= 0 (0 = greedy)")
            check_sampling(t, session.top_k, session.top_p)
            session.temperature = t
            return f"(temperature = {t:g})"
        if name == "top-k":
            k = None if off else _command_number(typed, arg, int, "an integer >= 0 (0 or off: no top-k filter)")
            k = None if k == 0 else k  # 0 = no top-k filter, as the flag
            check_sampling(session.temperature, k, session.top_p)
            session.top_k = k
            return f"({typed} off)" if k is None else f"({typed} = {k})"
        if name == "top-p":
            p = None if off else _command_number(typed, arg, float, "a number in (0, 1] (off: no top-p filter)")
            check_sampling(session.temperature, session.top_k, p)
            session.top_p = p
            return f"({typed} off)" if p is None else f"({typed} = {p:g})"
        if name == "max-new-tokens":
            session.max_new_tokens = check_int(typed, _command_number(typed, arg, int, "an integer >= 0"), 0)
            return f"({typed} = {session.max_new_tokens})"
        if name == "seed":
            session.seed = None if off else _command_number(typed, arg, int, "an integer in 0 .. 2**63-1 (off: "
                                                                             "fresh entropy)", maximum=MAX_SEED)
            return "(seed off)" if session.seed is None else f"(seed = {session.seed})"
    except _CommandArgumentError as e:
        return f"error: {e}"
    except (ValueError, TypeError) as e:
        return f"error: /{typed} {arg!r}: {e}"
    return f"unknown command /{typed}; type /help"


class _CommandArgumentError(ValueError):
    """A chat command's argument is not what the command takes (the message says what it takes)."""


def _command_number(typed: str, arg: str, kind, takes: str, maximum=None):
    """``arg`` as ``kind`` (int or float) for the chat command ``/typed``; an integer must be >= 0 (and <=
    ``maximum``). Raises ``_CommandArgumentError``: "/max-new-tokens takes an integer >= 0, got 'abc'"."""
    try:
        value = kind(arg)
    except ValueError:
        value = None
    if value is None or (kind is int and (value < 0 or (maximum is not None and value > maximum))):
        raise _CommandArgumentError(f"/{typed} takes {takes}, got {arg!r}")
    return value


def _chat_turn(session, line: str) -> bool:
    """Stream the reply to ``line``; False after an error line. Ctrl-C at any moment of the turn (the prompt's
    prefill, a piece being written, the generator's cleanup, the notes after it) stops this reply only: the
    conversation goes on (Ctrl-C at the prompt leaves)."""
    wrote = False
    try:
        pieces = session.reply(line)
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
                wrote = True
        finally:
            getattr(pieces, "close", lambda: None)()  # the generators' cleanup here, where Ctrl-C is this turn's
        sys.stdout.write("\n")
        sys.stdout.flush()
        if getattr(session, "notice", None):  # a chat checkpoint's session: turns dropped, no end of turn
            print(session.notice, file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C during a reply stops the reply; the conversation goes on
        sys.stdout.write(("\n" if wrote else "") + "(reply stopped)\n")
        sys.stdout.flush()
    except (KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", flush=True)
        return False
    return True


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk with a model; each turn continues the conversation (/help, /quit)",
                       description="Talk with a model: each line you type is a turn, and the model's reply "
                                   "continues the conversation. A chat checkpoint (written by `decoderlab "
                                   "finetune`) renders every turn with its stored template and drops the oldest "
                                   "turns when the conversation outgrows the context. Slash commands (/help) "
                                   "change the settings; /quit, /exit or Ctrl-D leave.\n\n" + CHAT_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_checkpoint_option(p)
    _add_dtype_option(p)
    _add_sampling_options(p, "sampling temperature (default: 0 = greedy for pair-trained models, else "
                             f"{GENERATE_DEFAULTS['temperature']:g})")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message that opens the conversation, for a chat checkpoint; kept when old turns "
                        "are dropped and after /reset (default: none)")
    add_threads_option(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from .generation import ChatSession

    set_threads(args)
    model, tok, template, _ = _load(args.checkpoint, dtype=args.dtype)
    options = dict(temperature=args.temperature, top_k=None if args.top_k == 0 else args.top_k, top_p=args.top_p,
                   max_new_tokens=args.max_new_tokens, seed=args.seed)
    if template is not None:  # a chat checkpoint: the stored template renders every turn
        from .chat import TemplateChatSession

        session = TemplateChatSession(model, tok, template, system=args.system, **options)
    elif args.system is not None:
        raise ValueError(f"--system needs a chat checkpoint (written by `decoderlab finetune`); {args.checkpoint} "
                         f"has no chat template in its meta.json")
    else:
        session = ChatSession(model, tok, **options)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - not on every platform
        pass
    interactive = sys.stdin.isatty()
    if interactive:
        print("decoderlab chat -- /help for commands, /quit or Ctrl-D to leave")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:  # at the prompt: leave (main prints the one line, exit status 130)
            if interactive:
                print()
            raise
        except UnicodeDecodeError as e:  # bytes on standard input that are not UTF-8
            print(f"error: the input is not UTF-8 text: byte 0x{e.object[e.start]:02x} at byte {e.start} "
                  f"({e.reason})", flush=True)
            continue
        if not line.strip():
            continue
        try:
            message = chat_command(session, line)
        except ChatExit:
            return 0
        if message is not None:
            print(message, flush=True)
            continue
        if not _chat_turn(session, line):
            continue


# ---------------------------------------------------------------------------------------------------------
# finetune
# ---------------------------------------------------------------------------------------------------------


def add_finetune(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a model on conversations (JSONL) with a chat template",
                       description="Fine-tune a base checkpoint (or a preset from scratch) on conversations: a JSONL "
                                   "file of {\"messages\": [...]}, {\"prompt\", \"completion\"} or Alpaca "
                                   "{\"instruction\", \"input\", \"output\"} lines. Only the assistant's tokens "
                                   "and the end of turn after them are trained. The run directory becomes a chat "
                                   "checkpoint storing its template, for `decoderlab chat` and `generate --chat`.")
    start = p.add_mutually_exclusive_group()  # one of them, unless --resume
    start.add_argument("--checkpoint", default=None, metavar="DIR",
                       help="the decoderlab checkpoint to fine-tune (default: none; give it or --preset)")
    start.add_argument("--preset", default=None, choices=PRESET_NAMES,
                       help="train from scratch with this preset, the tokenizer built from the data (default: none; "
                            "give it or --checkpoint)")
    p.add_argument("--data", required=True, metavar="PATH", help="the JSONL file of conversations")
    p.add_argument("--val-data", default=None, metavar="PATH",
                   help="a held-out JSONL file (default: hold out --val-fraction of --data)")
    p.add_argument("--val-fraction", type=_number(float, 0), default=None, metavar="X",
                   help=f"share of --data held out, seeded; 0 = none, evaluate on the training data (default "
                        f"{FINETUNE_DEFAULTS['val_fraction']:g})")
    p.add_argument("--out", required=True, metavar="DIR", help="run/checkpoint directory to write")
    p.add_argument("--template", default=None, metavar="NAME",
                   help=f"chat template: {', '.join(CHAT_TEMPLATES)} (default {FINETUNE_DEFAULTS['template']})")
    p.add_argument("--seed", type=_seed(32), default=None, metavar="N",
                   help=f"random seed of the split, the batches and new weights (default {TRAIN_DEFAULTS['seed']})")
    p.add_argument("--eval-prompts", type=_number(int, 0), default=None, metavar="N",
                   help=f"held-out prompts answered greedily at the end (default "
                        f"{FINETUNE_DEFAULTS['eval_prompts']})")
    g = p.add_argument_group("training (defaults: decoderlab.finetuning.FINETUNE_DEFAULTS on TrainConfig)")
    g.add_argument("--tokenizer", default=None, choices=TOKENIZER_KINDS,
                   help=f"tokenizer built from the data, with --preset (default {FINETUNE_DEFAULTS['tokenizer']})")
    g.add_argument("--vocab-size", type=_number(int), default=None, metavar="N",
                   help=f"BPE vocabulary size, with --preset --tokenizer bpe (default {DEFAULT_BPE_VOCAB_SIZE})")
    add_train_config_options(g, FINETUNE_TRAIN_DEFAULTS, skip=_FINETUNE_SKIP,
                             helps={"batch_size": "conversations per batch per process", "lr": "peak learning rate"})
    add_run_options(g)
    add_model_shape_options(p)
    p.set_defaults(func=cmd_finetune)


#: TrainConfig flags that fine-tuning does not use (the held-out split is --val-fraction / --val-data)
_FINETUNE_SKIP = ("val_batches", "full_val_below")


def cmd_finetune(args) -> int:
    try:
        with _warnings_as_lines():
            return _finetune(args)
    except ValueError as e:
        raise ValueError(_in_flag_words(e)) from None


def _finetune(args) -> int:
    _check_out_dir(args.out)
    shape = model_overrides(args)
    if args.resume is None and args.checkpoint is None and args.preset is None:
        raise ValueError("give --checkpoint DIR (a base model to fine-tune) or --preset NAME (a model from scratch)")
    if args.resume is not None and (args.checkpoint or args.preset or shape):
        raise ValueError("--resume continues a run with its own model; give no --checkpoint, --preset or shape flags")
    scratch_only = [f for f in ("tokenizer", "vocab_size", *SHAPE_FIELDS) if getattr(args, f) is not None]
    if args.preset is None and scratch_only:
        verb = "applies" if len(scratch_only) == 1 else "apply"
        raise ValueError(f"{', '.join(_flag(f) for f in scratch_only)} {verb} with --preset (a model from scratch); a "
                         f"checkpoint keeps its tokenizer and shape")
    from .chat import get_template

    if args.template is not None:
        get_template(args.template)  # an unknown name lists the known ones, before the data is read
    if shape:
        from .model import preset

        preset(args.preset, **shape)  # the shape's errors before the data is read
    _check_strategy(args.strategy)
    from .finetuning import finetune
    from .training import NonFiniteLossError

    progress = True if sys.stdout.isatty() and not args.no_progress_bar else "plain"
    try:  # template, val fraction and tokenizer not given: the defaults, or a resumed run's own
        _, _, s = finetune(args.data, out=args.out, checkpoint=args.checkpoint, preset=args.preset,
                           template=args.template, val_data=args.val_data, val_fraction=args.val_fraction,
                           tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           model_overrides=shape or None, config_overrides=train_overrides(args, _FINETUNE_SKIP),
                           resume=args.resume, devices=args.devices, strategy=args.strategy,
                           num_nodes=args.num_nodes,
                           eval_prompts=FINETUNE_DEFAULTS["eval_prompts"] if args.eval_prompts is None
                           else args.eval_prompts, progress_bar=progress)
    except NonFiniteLossError as e:
        print(f"decoderlab: error: {e}", file=sys.stderr)
        return 1
    if s.is_global_zero:
        print(f"checkpoint written to {s.run_dir} (template {s.template!r}); talk with it: decoderlab chat "
              f"--checkpoint {s.run_dir}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# verify, explain (the glass box)
# ---------------------------------------------------------------------------------------------------------


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="recompute a checkpoint's forward pass in float64 NumPy and compare every step")
    _add_checkpoint_option(p)
    p.add_argument("text", help="the input text")
    p.add_argument("--tol", type=_number(float), default=1e-5,
                   help="tolerance per step, times max(1, max |value|) (default %(default)g)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from .glassbox import verify

    model, tok, _, _ = _load(args.checkpoint)
    report = verify(model, args.text, tol=args.tol, tokenizer=tok)
    print(report.table())
    if not report.ok:
        print(f"decoderlab: error: verify failed: some steps differ from the float64 reference by more than "
              f"--tol {args.tol}", file=sys.stderr)
    return 0 if report.ok else 1


#: the worked examples of ``decoderlab.glassbox.EXAMPLES`` (named here so that --help imports no torch)
EXAMPLE_NAMES = ("self-attention-101", "statquest-self-attention", "position-encoding")


def add_explain(sub) -> None:
    p = sub.add_parser("explain", help="print every attention number step by step (a worked example or a checkpoint)")
    p.add_argument("--example", default=None, metavar="NAME",
                   help=f"a worked example: {', '.join(EXAMPLE_NAMES)} (default: none)")
    _add_checkpoint_option(p, required=False)
    p.add_argument("text", nargs="?", default=None, help="the input text (with --checkpoint)")
    p.add_argument("--chat", action="store_true",
                   help="TEXT is a user message: explain the tokens a chat checkpoint sees before its reply, "
                        "rendered with its stored template (default: TEXT as it is)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before TEXT, with --chat (default: none)")
    p.add_argument("--layer", type=_number(int), default=None, metavar="N", help="only this layer (default: all)")
    p.add_argument("--head", type=_number(int), default=None, metavar="N", help="only this head (default: all)")
    p.add_argument("--top-k", type=_number(int), default=5, metavar="K",
                   help="next-token probabilities to show per position (default %(default)s)")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="write attention heatmaps to this PNG file (default: none)")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained HTML report to this file (default: none)")
    p.set_defaults(func=cmd_explain)


def cmd_explain(args) -> int:
    from .glassbox import explain, explain_example

    if args.example is not None:
        if args.checkpoint is not None or args.png or args.html or args.chat:
            raise ValueError("--example takes no --checkpoint, --png, --html or --chat")
        print(explain_example(args.example))
        return 0
    if args.checkpoint is None or args.text is None:
        raise ValueError("give --example NAME, or --checkpoint DIR and a TEXT")
    if args.system is not None and not args.chat:
        raise ValueError("--system applies with --chat")
    model, tok, template, _ = _load(args.checkpoint)
    text_or_ids = args.text
    if args.chat:  # the renderer of fine-tuning and chat: what the model sees before it answers
        if template is None:
            raise ValueError(f"--chat needs a chat checkpoint (written by `decoderlab finetune`); {args.checkpoint} "
                             f"has no chat template in its meta.json")
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.text}]
        text_or_ids, _ = template.render(messages, tok, add_generation_prompt=True)
    print(explain(model, text_or_ids, tok, layer=args.layer, head=args.head, top_k=args.top_k,
                  png=args.png, html=args.html))
    for path, what in ((args.png, "attention heatmaps"), (args.html, "HTML report")):
        if path:
            print(f"wrote {what} to {path}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# serve (the OpenAI-compatible server and the glass-box page; decoderlab.serve)
# ---------------------------------------------------------------------------------------------------------


#: decoderlab.serve.Limits' defaults for --help (not imported here: building the parser must not import FastAPI;
#: tests/test_package.py checks they agree)
SERVE_LIMITS = {"max_tokens": 4096, "max_body_bytes": 1_000_000, "max_messages": 256, "max_n": 8, "max_batch": 32,
                "max_queue": 64}
SERVE_LIMIT_HELP = {"max_tokens": "most tokens one choice may ask for", "max_body_bytes": "largest request body in bytes",
                    "max_messages": "most chat messages in a request", "max_n": "most choices per request",
                    "max_batch": "most rows (choices) decoded together",
                    "max_queue": "most requests waiting to join the batch before the server answers 429"}


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API, with a glass-box page at /")
    _add_checkpoint_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_number(int), default=8000, metavar="N", help="port, 0 .. 65535 (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none, open)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="allow this browser origin (repeatable; default: CORS off)")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model id clients name (default: the checkpoint's name, else the directory's name)")
    for field, default in SERVE_LIMITS.items():
        p.add_argument("--" + field.replace("_", "-"), type=_number(int), default=default, metavar="N",
                       help=f"{SERVE_LIMIT_HELP[field]}, >= 1 (default {default})")
    add_threads_option(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from .serve import Limits, serve

    for name in ("port", *SERVE_LIMITS):
        value = getattr(args, name)
        low = 0 if name == "port" else 1
        if value < low or (name == "port" and value > 65535):
            raise ValueError(f"--{name.replace('_', '-')} must be {'0 .. 65535' if name == 'port' else '>= 1'}, got {value}")
    set_threads(args)
    limits = Limits(**{name: getattr(args, name) for name in SERVE_LIMITS},
                    default_max_tokens=min(Limits.default_max_tokens, args.max_tokens))
    serve(args.checkpoint, host=args.host, port=args.port, api_key=args.api_key, cors_origins=args.cors_origin,
          limits=limits, model_id=args.model_id)
    return 0


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------

COMMANDS = [add_train, add_sample, add_generate, add_chat, add_finetune, add_verify, add_explain, add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="decoderlab",
        description="Build, verify, train, inspect and chat with decoder-only (GPT-style) transformers.",
    )
    parser.add_argument("--version", action="version", version=f"decoderlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (OSError, ValueError, KeyError, ImportError) as e:  # ImportError: a missing optional dependency
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"decoderlab: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: the command has written what it produced; one line, no traceback
        sys.stdout.flush()
        training = sys.modules.get(f"{__package__}.training")  # loaded if training ran (not imported for this)
        if training is None or not isinstance(e, training.TrainingInterrupted):  # else InterruptNotice said it
            print(f"decoderlab: interrupted ({args.command} stopped by Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
