"""The option groups several commands share, and the functions that read them back.

Each group is a table: add a flag to a command family by adding a row (an :func:`option`, or a row of
``TRAIN_OPTIONS`` / ``SHAPE_OPTIONS``); its reader (:func:`given`, :func:`train_overrides`,
:func:`model_overrides`) then returns it with the others. The defaults shown in the help come from
``decoderlab.config`` (plain data, no torch); the library checks the values and its messages are put in the
flags' words (:func:`decoderlab.cli.errors.in_flag_words`). One thing has one spelling in every command:
``tests/cli/test_vocabulary.py`` walks every parser against its table of canonical spellings, so look there (and
at how other commands spell an option) before adding one.

    CHECKPOINT_OPTIONS  --checkpoint, --dtype                        generate, sample, chat (the others:
                                                                     --checkpoint alone)
    DTYPE_OPTIONS       --dtype                                      serve, verify
    DEVICE_OPTIONS      --device                                     generate, sample, chat, explain, serve
    COMPILE_OPTIONS     --compile (a compiled decode step)           generate, sample
    AOT_OPTIONS         --aot (the step compiled ahead of time)      generate, sample, chat
    EAGER_OPTIONS       --eager (no compiled step)                   generate, sample, chat, serve
    SAMPLING_OPTIONS    --max-new-tokens, --temperature, --top-k,    generate, sample, chat
                        --top-p, --seed, --min-p, the penalties,
                        --json-schema
    THREADS_OPTIONS     --threads                                    every command that computes (all but tasks,
                                                                     export: tests/cli/test_vocabulary.py)
    TRAIN_OPTIONS       TrainConfig's flags (+ --optimizer,          train, finetune
                        --schedule, --precision)
    SHAPE_OPTIONS       ModelConfig's shape flags                    train, finetune
    RUN_OPTIONS         --resume, --devices, --strategy,             train, finetune (rl, sae: --resume,
                        --num-nodes, --no-progress-bar               --no-progress-bar)
    LORA_OPTIONS        --lora-rank, --lora-alpha, --lora-dropout,   finetune, rl
                        --lora-targets, --merge
"""

from __future__ import annotations

import os
import re
import sys
from collections import namedtuple

from ..config.defaults import DEFAULT_MAX_NEW_TOKENS, PAIR_TRAIN, TRAIN_DEFAULTS
from ..config.names import (DEFAULT_LORA_TARGETS, DEVICES, DTYPES, LORA_TARGETS, MLPS, NORMS, OPTIMIZERS,
                            POSITIONS, PRECISIONS, SCHEDULES)
from ..config.presets import FIELD_DEFAULTS, PRESETS
from .argtypes import DEVICES_HELP, devices, json_file, number, seed

#: one flag of a group: its option strings and ``add_argument``'s keywords; a callable ``help`` is called with
#: the keywords given to :func:`add_options` (a command's own wording)
Option = namedtuple("Option", "flags kwargs")


def option(*flags: str, **kwargs) -> Option:
    return Option(flags, kwargs)


def dest(opt: Option) -> str:
    """The attribute an option's value lands in (argparse's rule: the first long flag, ``-`` -> ``_``)."""
    if "dest" in opt.kwargs:
        return opt.kwargs["dest"]
    long = next((f for f in opt.flags if f.startswith("--")), opt.flags[0])
    return long.lstrip("-").replace("-", "_")


def add_options(parser, options, **wording) -> None:
    """Add a group's ``options`` to ``parser`` (or an argument group); values not given are None unless the
    row says otherwise."""
    for opt in options:
        kwargs = {"default": None, **opt.kwargs}
        if callable(kwargs.get("help")):
            kwargs["help"] = kwargs["help"](wording)
        parser.add_argument(*opt.flags, **kwargs)


def given(args, options) -> dict:
    """``{dest: value}`` of the ``options`` given on the command line (not None)."""
    return {d: getattr(args, d) for d in map(dest, options) if getattr(args, d, None) is not None}


def flag(field: str) -> str:
    """``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + field.replace("_", "-")


# ---------------------------------------------------------------------------------------------------------
# a checkpoint to load, in a dtype
# ---------------------------------------------------------------------------------------------------------

#: the Hugging Face families are decoderlab.hf.ARCHITECTURES' (tests/cli/test_options.py checks each is named)
CHECKPOINT_HELP = ("a decoderlab checkpoint or training run directory, a Hugging Face directory of a GPT-2, Llama, "
                   "Mistral, Qwen2, Qwen3, Apertus, Arcee or Gemma3 model (config.json, model.safetensors or "
                   "pytorch_model.bin, tokenizer.json or vocab.json + merges.txt), or a GGUF file of llama.cpp / "
                   "ollama (FILE.gguf: llama, qwen2, qwen3, gemma3 or gpt2; its weights dequantized, its tokenizer "
                   "and chat template used)")

#: checked by load_checkpoint (one error line listing the choices), not by argparse's choices
DTYPE_OPTIONS = (
    option("--dtype", metavar="DTYPE",
           help=f"weights for inference: auto, {', '.join(DTYPES)} (default auto: a GGUF file's own types on the "
                "CPU -- its blocks kept, as much memory as the file --, any other checkpoint float32, as trained; "
                "bfloat16 and float16 halve the bytes read per token; q8_0 ... q6_k are GGUF's blocks -- 4.5 to 8.5 "
                "bits a weight -- for every linear layer and the output layer, multiplied by decoderlab's CPU "
                "kernels; the K-quants q4_k, q5_k, q6_k only as a GGUF file holds them)"),
)

CHECKPOINT_OPTIONS = (
    option("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP),
    *DTYPE_OPTIONS,
)


def add_checkpoint_option(parser, required: bool = True, *, role: str = "", default: str = "none") -> None:
    """``--checkpoint`` alone (verify, explain, serve, ...), with the one help text of every command: ``role``
    says what the command does with it ("the base model to fine-tune"), ``default`` what an optional one
    defaults to."""
    parser.add_argument("--checkpoint", required=required, default=None, metavar="PATH",
                        help=(f"{role}: " if role else "") + CHECKPOINT_HELP
                        + ("" if required else f" (default: {default})"))


def check_checkpoint(path) -> None:
    """``--checkpoint PATH`` is something the front door reads (a decoderlab checkpoint or run directory, a
    Hugging Face directory, a GGUF file), checked before a command's other work -- its data read, its output
    made, its port bound --, with the one message of a path that is none
    (:func:`decoderlab.chat.checkpoint_kind`). The commands that load through :func:`load_model` get the
    same check there, first."""
    if path is not None:
        from ..chat import checkpoint_kind

        checkpoint_kind(path)


#: where the model runs (checked by decoderlab.devices.resolve_device: one line naming what the machine has)
DEVICE_OPTIONS = (
    option("--device", metavar="DEVICE",
           help=f"where the model runs: {', '.join(DEVICES)} (default auto: a CUDA GPU, else Apple MPS, else the "
                "CPU)"),
)

#: generate, sample: a step compiled in this process (serve compiles its step unless --eager)
COMPILE_OPTIONS = (
    option("--compile", action="store_true", default=False,
           help="decode with a step compiled in this run (torch.compile: one graph over a static KV cache; the "
                "first token waits for the compiler, said on standard error with its time; default: a package "
                "compiled ahead of time when one is cached for this model, else eager)"),
)


#: generate, sample, chat: the ahead-of-time step (the server's batch cache is not static: no AOT there)
AOT_OPTIONS = (
    option("--aot", action="store_true", default=False,
           help="decode with an ahead-of-time compiled step (torch.export + AOTInductor), compiling it first if "
                "none is cached: a .pt2 package of code compiled once (its time said on standard error and kept, "
                "so that the next compile says how long it should take) into "
                "~/.cache/decoderlab/aot ($DECODERLAB_CACHE/aot) and loaded by every later run of a model of the same "
                "shape and dtype, with or without --aot (default: such a package when one is "
                "cached, else eager)"),
)

#: generate, sample, chat, serve: no compiled step at all
EAGER_OPTIONS = (
    option("--eager", action="store_true", default=False,
           help="decode eagerly, op by op: no compiled step and no cached package (default: serve compiles its "
                "decode step for a model of a million parameters or more; generate, sample and chat use a package compiled ahead of time for this model's shape "
                "and dtype when one is cached)"),
)


def device(args):
    """The ``torch.device`` of ``--device`` (auto where the command has no such flag)."""
    from ..devices import resolve_device

    try:
        return resolve_device(getattr(args, "device", None))
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def decode_mode(args) -> str:
    """How a command decodes: ``"eager"`` (``--eager``), ``"compile"`` (``--compile``), ``"aot"`` (``--aot``: a
    package, compiled if missing), or ``"cached"`` -- the default of generate, sample and chat: a package compiled
    ahead of time when one is cached for the model, else eager.

    Raises:
        ValueError: two of --eager, --compile, --aot.
    """
    given_ = [f for f in ("eager", "compile", "aot") if getattr(args, f, False)]
    if len(given_) > 1:
        if given_ == ["compile", "aot"]:
            raise ValueError("--compile and --aot are two ways to compile the decode step: give one")
        raise ValueError(f"--eager decodes without a compiled step: give it without {' or '.join(flag(f) for f in given_[1:])}")
    return given_[0] if given_ else "cached"


def load_model(args):
    """``(model, tokenizer, template, meta)`` of ``--checkpoint`` through the one loader
    (``decoderlab.chat.load_model``: a decoderlab checkpoint or a Hugging Face GPT-2 directory; the template is
    the stored one, None for a base model), its weights in ``--dtype`` where the command has it (float32 for a
    GGUF file where it has not: those commands read the weights), on
    ``--device`` (the CPU for a command without it), decoding as :func:`decode_mode` says where the command has
    those flags (:func:`use_decode_step`)."""
    from ..chat import load_model as load

    from ..chat import checkpoint_kind

    mode = decode_mode(args)
    where = device(args) if hasattr(args, "device") else "cpu"
    dtype = getattr(args, "dtype", None)
    if not hasattr(args, "dtype") and checkpoint_kind(args.checkpoint) == "gguf":
        # a command without --dtype reads the weights (the glass box's maps, its float64 reference): a GGUF
        # file's blocks dequantized, not multiplied through 8-bit activations as the decoding commands' default
        dtype = "float32"
    loaded = load(args.checkpoint, dtype=dtype, device=where)
    say_gguf(loaded.meta)
    if any(hasattr(args, f) for f in ("eager", "compile", "aot")):
        use_decode_step(loaded.model, mode)
    return loaded


def use_decode_step(model, mode: str) -> None:
    """Give ``model`` the decode step ``mode`` names (:func:`decode_mode`), saying on standard error what the user
    waits for: a compile is announced when it starts (:func:`announce_compiles`); in the ``"cached"`` mode a model
    with no package cached decodes eagerly, and a terminal -- or anyone, for block-quantized weights, which decode
    eagerly several times slower than float32 -- is told once how to get the fast step."""
    if mode == "eager":
        return
    announce_compiles()
    if mode == "compile":
        model.compile_decode()
        return
    from ..aot import AOTDecodeStep

    from .. import fastdecode
    from ..quant import block_dtype

    step = AOTDecodeStep(model, compile_missing=mode == "aot", notify=say)
    if mode == "aot" or step.has_package((1, False)):
        model.compiled_decode = step
    elif compile_pays(model) and fastdecode.why_not(model) and (sys.stderr.isatty() or block_dtype(model)):
        # (eager block weights are slow: said wherever stderr goes; never for a model too small for a compile to
        # pay -- the lesson's 37 parameters -- nor one whose eager step is one C++ call, as fast as the AOT step)
        say("decoding eagerly: no compiled decode step is cached for this model's shape and dtype; run once with "
            "--aot to compile one (once: its time is said) that every later run loads (--eager: no compiled step "
            "and no note)")


def compile_pays(model) -> bool:
    """A model of at least ``decoderlab.config.COMPILE_PAYS_FROM`` parameters (why that many: its comment)."""
    from ..config.defaults import COMPILE_PAYS_FROM

    return model.num_parameters() >= COMPILE_PAYS_FROM


def say(line: str) -> None:
    """One ``decoderlab:`` line on standard error, at once."""
    print(f"decoderlab: {line}", file=sys.stderr, flush=True)


#: announce_compiles' state: "beat" (the heartbeat of the compile under way, if any), "last" (the seconds the last
#: compile took, or None) and "callbacks" (the two registered with dynamo); empty when not announcing
_COMPILING: dict = {}


def announce_compiles() -> None:
    """Until :func:`stop_announcing`, say on standard error when ``torch.compile`` starts compiling -- with the
    time the last compile of this process took, measured, or none --, how long it has run every
    ``decoderlab.waiting.EVERY`` seconds, and how long it took (dynamo's compile callbacks): a first token that
    waits minutes for the compiler is never silent, and no time is promised that was not measured here."""
    if _COMPILING:
        return
    from torch._dynamo.callback import callback_handler

    from ..waiting import Estimate, Heartbeat, starting

    def start(_args=None) -> None:
        last = _COMPILING.get("last")
        estimate = None if last is None else Estimate(last, f"the last compile of this run took {last:.0f} s")
        say(starting("compiling the decode step with torch.compile, once per kind of step", estimate))
        _COMPILING["beat"] = Heartbeat("compiling the decode step", say, expected=last).__enter__()

    def end(_args=None) -> None:
        beat = _COMPILING.pop("beat", None)
        if beat is not None:
            beat.__exit__(None, None, None)
            _COMPILING["last"] = beat.seconds
            say(f"compiled the decode step in {beat.seconds:.0f} s")

    _COMPILING.update(last=None, callbacks=(start, end))
    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)


def stop_announcing() -> None:
    """Undo :func:`announce_compiles` (``decoderlab.cli.main`` calls it as a command ends: a process that runs
    several commands -- tests, a notebook -- announces only inside the ones that compile)."""
    if _COMPILING:
        from torch._dynamo.callback import callback_handler

        start, end = _COMPILING["callbacks"]
        if "beat" in _COMPILING:  # a compile cut short (an error, Ctrl-C): its heartbeat stops, unsaid
            _COMPILING["beat"].__exit__(None, None, None)
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)
        _COMPILING.clear()


def say_gguf(meta: dict) -> None:
    """A GGUF file loaded: one line on standard error saying what it is and what was dequantized, at what cost
    (``meta["gguf"]``, :class:`decoderlab.gguf.GGUFInfo`)."""
    from ..gguf import DequantReport

    info = meta.get("gguf")
    if info:
        name = f", {info['name']}" if info["name"] else ""
        print(f"decoderlab: read {info['path']} ({info['architecture']}{name}): {DequantReport(**info['dequantized'])}",
              file=sys.stderr, flush=True)


#: what a --png / --html file is called in the line that says where it was written
WRITTEN = {"png": "PNG", "html": "HTML page"}


def say_wrote(path, kind: str) -> None:
    """The one line every command says of a ``--png`` / ``--html`` file (``kind``) it wrote: ``wrote the HTML page
    to PATH`` on standard output, after what it printed -- as export, sae and tasks name the files they write."""
    print(f"wrote the {WRITTEN[kind]} to {path}", flush=True)


def no_chat_template(directory) -> ValueError:
    return ValueError(f"--chat needs a chat checkpoint (written by `decoderlab finetune`); {directory} has no chat "
                      f"template in its meta.json")


# ---------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------

#: the bounds of each type are SamplingParams' (decoderlab.generation.params), checked again there; here they are
#: checked as the line is parsed, so that a bad value is named as its flag before a model loads
SAMPLING_OPTIONS = (
    option("--max-new-tokens", type=number(int, 0), metavar="N",
           help=f"longest continuation in tokens (default {DEFAULT_MAX_NEW_TOKENS}; the lesson's model answers "
                "until <EOS>)"),
    option("--temperature", type=number(float, 0), metavar="T", help=lambda wording: wording["temperature_help"]),
    option("--top-k", type=number(int, 0), metavar="K",
           help="sample among the K most probable tokens; 0 = no top-k filter (default: no filter)"),
    option("--top-p", type=number(float, 0, maximum=1, above=True), metavar="P",
           help="nucleus sampling: the most probable tokens up to probability P in (0, 1] (default: no filter)"),
    option("--seed", type=seed(63), metavar="N", help="seed for reproducible sampling (default: fresh entropy)"),
    option("--min-p", type=number(float, 0, maximum=1), metavar="P",
           help="keep tokens at least P times as probable as the most probable, P in [0, 1] (default 0: off)"),
    option("--repetition-penalty", type=number(float, 0, above=True), metavar="R",
           help="CTRL's penalty on every token of the prompt and the reply so far, > 0 (default 1: off)"),
    option("--frequency-penalty", type=number(float, -2, maximum=2), metavar="F",
           help="OpenAI's: lower a token's logit by F per time it was generated, -2 .. 2 (default 0: off)"),
    option("--presence-penalty", type=number(float, -2, maximum=2), metavar="F",
           help="OpenAI's: lower the logit of every token generated so far by F, -2 .. 2 (default 0: off)"),
    option("--json-schema", type=json_file, metavar="FILE",
           help="structured output: the reply is JSON valid against the JSON schema in FILE (a token mask; the "
                "reply ends when the JSON is complete; default: free text)"),
)


def sampling_params(args, **more):
    """The sampling flags given and ``more`` (``stop=``, ``stop_at_eos=``, ...) as one
    ``decoderlab.generation.SamplingParams``: checked there (``--top-k 0`` is no filter there), the flags not
    given keep its defaults."""
    from ..generation import SamplingParams

    return SamplingParams.of(None, **given(args, SAMPLING_OPTIONS), **more)


# ---------------------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------------------

THREADS_OPTIONS = (
    option("--threads", type=number(int, 1), metavar="N",
           help="PyTorch intra-op threads (default: the cores the 1-minute load average leaves idle, at most 2; "
                "see decoderlab.threads)"),
)


def set_threads(args) -> int:
    """``torch.set_num_threads`` from ``--threads``, or chosen from the machine's cores and load."""
    from ..threads import set_threads as set_torch_threads

    try:
        return set_torch_threads(getattr(args, "threads", None))
    except ValueError as e:
        raise ValueError(f"--{e}") from None


# ---------------------------------------------------------------------------------------------------------
# TrainConfig's flags (train, finetune)
# ---------------------------------------------------------------------------------------------------------

#: (flag, TrainConfig field, argparse type, help); each help gets "(default ...)"; the values are checked by
#: TrainConfig, whose messages are put in the flags' words
TRAIN_OPTIONS = (
    ("--max-steps", "max_steps", number(int), "optimizer steps"),
    ("--batch-size", "batch_size", number(int), "sequences per batch per process (statquest: pairs per batch)"),
    ("--lr", "lr", number(float), "peak learning rate (statquest: Adam's learning rate)"),
    ("--min-lr", "min_lr", number(float), "learning rate at the end of the cosine decay"),
    ("--warmup", "warmup", number(int), "steps of linear warm-up (keep it below --max-steps)"),
    ("--eval-every", "eval_every", number(int), "optimizer steps between evaluations (and checkpoints)"),
    ("--val-batches", "val_batches", number(int), "evaluate on at most this many batches of 64 windows"),
    ("--log-every", "log_every", number(int), "optimizer steps between progress lines and logged train-loss rows"),
    ("--grad-clip", "grad_clip", number(float), "clip the gradient norm to this, 0 = no clipping"),
    ("--accumulate", "accumulate", number(int), "batches per optimizer step (gradient accumulation)"),
    ("--muon-lr", "muon_lr", number(float), "Muon's peak learning rate, with --optimizer muon"),
    ("--cooldown", "cooldown", number(float), "with --schedule wsd: the last fraction of --max-steps that decays"),
    ("--full-val-below", "full_val_below", number(float),
     "with --val-batches: also evaluate all validation windows whenever the subset's loss is at or below this"),
)

#: (flag, TrainConfig field, choices, help) of the TrainConfig fields that are a choice
TRAIN_CHOICE_OPTIONS = (
    ("--optimizer", "optimizer", OPTIMIZERS, "adamw: AdamW for every parameter; muon: Muon for the blocks' weight "
                                             "matrices, AdamW (--lr) for embeddings, gains and biases"),
    ("--schedule", "schedule", SCHEDULES, "after the warm-up: cosine decay to --min-lr, or wsd (flat, then a "
                                          "linear decay over the last --cooldown)"),
    ("--precision", "precision", PRECISIONS,
     "auto = bf16-mixed on a CUDA GPU with bfloat16, 16-mixed on older GPUs, 32 on the CPU and Apple MPS; "
     "32 = float32; bf16-mixed / 16-mixed = bfloat16 / float16 autocast (16-mixed with a gradient scaler, GPUs "
     "only), float32 weights"),
)

#: TrainConfig fields some commands set with flags of their own (train: --compile, --seed)
TRAIN_OWN_FIELDS = ("compile", "seed")


def _shown(field: str, defaults: dict) -> str:
    value = defaults[field]
    if value is None:
        return "never" if field == "full_val_below" else "all"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default_text(field: str, defaults: dict, recipe: dict | None, lesson: bool) -> str:
    """"(default 450; 2000 with a plain model preset; statquest 30)": the recipe's value first where it sets
    the field, the lesson's where ``lesson``."""
    extra = f"; statquest {PAIR_TRAIN[field]:g}" if lesson and field in PAIR_TRAIN else ""
    if recipe is not None and field in recipe and recipe[field] != defaults[field]:
        return f"(default {_shown(field, recipe)}; {_shown(field, defaults)} with a plain model preset{extra})"
    return f"(default {_shown(field, defaults)}{extra})"


def add_train_config_options(group, defaults: dict = TRAIN_DEFAULTS, *, skip: tuple = (),
                             helps: dict | None = None, lesson: bool = False, recipe: dict | None = None) -> None:
    """Add the ``TrainConfig`` flags of :data:`TRAIN_OPTIONS` and :data:`TRAIN_CHOICE_OPTIONS` (less ``skip``)
    to ``group``, each help ending with its default from ``defaults`` (and statquest's with ``lesson``). With
    ``recipe`` (the default recipe's fields), a field it sets shows the recipe's value as the default and
    ``defaults``' as the one of a plain model preset. ``helps`` replaces the text of some fields. Read back by
    :func:`train_overrides`."""
    for flag_, field, kind, text in TRAIN_OPTIONS:
        if field not in skip:
            group.add_argument(flag_, dest=field, type=kind, default=None, metavar="N" if kind.integer else "X",
                               help=f"{(helps or {}).get(field, text)} "
                                    f"{_default_text(field, defaults, recipe, lesson)}")
    for flag_, field, choices, text in TRAIN_CHOICE_OPTIONS:
        if field not in skip:
            group.add_argument(flag_, dest=field, default=None, choices=choices,
                               help=f"{text} {_default_text(field, defaults, recipe, lesson)}")


def train_fields(skip: tuple = ()) -> list[str]:
    """The TrainConfig fields that have a flag (less ``skip``)."""
    return [f for _, f, _, _ in (*TRAIN_OPTIONS, *TRAIN_CHOICE_OPTIONS) if f not in skip] + list(TRAIN_OWN_FIELDS)


def train_overrides(args, skip: tuple = ()) -> dict:
    """The ``TrainConfig`` fields given with :func:`add_train_config_options`' flags (and ``--seed``,
    ``--compile`` where the command has them), as ``{field: value}``."""
    return {f: getattr(args, f) for f in train_fields(skip) if getattr(args, f, None) is not None}


# ---------------------------------------------------------------------------------------------------------
# the model's shape (train, finetune)
# ---------------------------------------------------------------------------------------------------------

#: (ModelConfig field, argparse keywords, help) of the shape flags
SHAPE_OPTIONS = (
    ("n_layer", dict(type=number(int), metavar="N"), "decoder blocks"),
    ("n_head", dict(type=number(int), metavar="N"), "attention heads; must divide --d-model"),
    ("n_kv_head", dict(type=number(int, 0), metavar="N"),
     "key/value heads, grouped-query attention (1: multi-query; 0: --n-head's); must divide --n-head"),
    ("d_model", dict(type=number(int), metavar="N"), "values per token, the embedding size"),
    ("max_len", dict(type=number(int), metavar="N"),
     "context length in tokens; each data split needs more tokens than this"),
    ("dropout", dict(type=number(float), metavar="P"), "dropout probability in [0, 1)"),
    ("position", dict(choices=POSITIONS), "position encoding"),
    ("rope_theta", dict(type=number(float), metavar="BASE"), "the rotary base of --position rope"),
    ("norm", dict(choices=NORMS), "normalisation (pre-norm)"),
    ("mlp", dict(choices=MLPS), "MLP after attention"),
)
SHAPE_FIELDS = tuple(field for field, _, _ in SHAPE_OPTIONS)


def add_model_shape_options(parser) -> None:
    """Add the model-shape flags of :data:`SHAPE_OPTIONS` to ``parser``: ``ModelConfig`` fields on top of
    ``--preset``, each help listing the presets' values. :func:`model_overrides` reads them back."""
    g = parser.add_argument_group("model shape (ModelConfig fields on top of --preset; default: the preset's)")
    for field, kwargs, text in SHAPE_OPTIONS:
        # statquest trains the lesson's fixed model
        values = ", ".join(f"{name} {shape.get(field, FIELD_DEFAULTS.get(field))}"
                           for name, shape in PRESETS.items() if name != "statquest")
        g.add_argument(flag(field), default=None, help=f"{text} (default: {values})", **kwargs)


def model_overrides(args) -> dict:
    """The ``ModelConfig`` fields given with :func:`add_model_shape_options`' flags, as ``{field: value}``."""
    return {f: getattr(args, f) for f in SHAPE_FIELDS if getattr(args, f, None) is not None}


# ---------------------------------------------------------------------------------------------------------
# a training run: where, resumed or not, on which devices (train, finetune)
# ---------------------------------------------------------------------------------------------------------

RUN_OPTIONS = (
    option("--resume", nargs="?", const=True, metavar="RUN_DIR",
           help="continue a run: its directory or a .ckpt; without a value: --out (default: a new run)"),
    option("--devices", type=devices, default="1", metavar="N", help=f"{DEVICES_HELP}, per node (default %(default)s)"),
    option("--strategy", default="auto",
           help="Lightning strategy: auto, ddp, ddp_spawn, deepspeed, ..., or fsdp (decoderlab's FSDP2: one "
                "unit per decoder block, float32 gradient reduction, GPUs or CPUs) (default %(default)s)"),
    option("--num-nodes", type=number(int, 1), default=1, metavar="N", help="machines (default %(default)s)"),
    option("--no-progress-bar", action="store_true",
           help="plain progress lines instead of the bar (the default when the output is not a terminal)"),
)


def run_out(args) -> str:
    """The run directory a command writes: ``--out``; on a resume without it, the run directory ``--resume``
    names (a directory, or the one a ``.ckpt`` belongs to: the parent of its ``lightning/``), so that a run
    directory alone resumes a run (it records its data and settings in ``run.json``)."""
    if args.out is not None:
        return args.out
    resume = getattr(args, "resume", None)
    if resume is None:
        raise ValueError("give --out DIR (the run/checkpoint directory to write)")
    if resume is True:
        raise ValueError("--resume without a value continues --out; give --resume RUN_DIR or --out RUN_DIR")
    path = os.path.normpath(str(resume))
    if not path.endswith(".ckpt"):
        return path
    parent = os.path.dirname(path) or "."
    if os.path.basename(parent) == "lightning":
        return os.path.dirname(parent) or "."
    return parent


def progress_mode(args):
    """A bar on a terminal; plain lines when the output is redirected or with ``--no-progress-bar``."""
    return True if sys.stdout.isatty() and not args.no_progress_bar else "plain"


def check_strategy(strategy: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    known = ("auto", *StrategyRegistry.available_strategies())
    if strategy not in known:
        common = [k for k in known if not re.search(r"find_unused|stage|offload|debug", k)]
        raise ValueError(f"--strategy {strategy!r} is not a Lightning strategy; known: {', '.join(common)} (and "
                         f"variants such as fsdp_cpu_offload, deepspeed_stage_2)")


def check_out_dir(out) -> None:
    """``--out`` must be a directory, or a path that can be made one: an existing file, or a place where no
    directory can be made (``/proc/x``), gets one sentence naming ``--out`` before any work is done."""
    # os.path rather than pathlib: --help and the argument checks stay quick to start (bench/startup.py)
    path = os.path.normpath(str(out))
    p = path
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p or not parent:
            break
        p = parent
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"--out {out} is a file, not a directory" if p == path
                         else f"--out {out}: {p} is a file, not a directory")
    if not os.path.exists(path):
        _try_making(path, out)


def _try_making(path: str, out) -> None:
    """Make ``path`` and remove what was made: the run makes it later, after reading and tokenizing its data."""
    missing, head = [], path
    while head and not os.path.exists(head):
        missing.append(head)
        head = os.path.dirname(head)
    made = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:  # made meanwhile (another process of the same run)
                continue
            made.append(directory)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot make this directory ({e.strerror or e})") from None
    finally:
        for directory in reversed(made):
            try:
                os.rmdir(directory)
            except OSError:  # something was put in it meanwhile: it is the run's now
                pass


# ---------------------------------------------------------------------------------------------------------
# LoRA adapters (finetune, rl)
# ---------------------------------------------------------------------------------------------------------

LORA_OPTIONS = (
    option("--lora-rank", type=number(int), metavar="R",
           help="train LoRA adapters of rank R (PEFT) instead of every weight; the run directory keeps the adapter "
                "and a pointer to its base, checked on every load (default: none, every weight trains)"),
    option("--lora-alpha", type=number(float), metavar="A", help="LoRA's alpha; the scale is A/R (default: R)"),
    option("--lora-dropout", type=number(float), metavar="P", help="dropout on the adapters' input (default 0)"),
    option("--lora-targets", metavar="LIST",
           help=f"comma-separated layer groups to adapt: {', '.join(LORA_TARGETS)} "
                f"(default {','.join(DEFAULT_LORA_TARGETS)})"),
    option("--merge", action="store_true", default=False,
           help="also write the merged model once at the end, in the base's dtype, as an ordinary checkpoint in "
                "RUN_DIR/merged (default: the adapter only; decoderlab export writes a merged copy any time)"),
)


def lora_options(args) -> dict | None:
    """``{"rank", "alpha", "dropout", "targets"}`` of the LoRA flags given (None without ``--lora-rank``).

    Raises:
        ValueError: ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets`` or ``--merge`` without
            ``--lora-rank`` (on a new run; a resume keeps the run's own adapters).
    """
    more = [f for f in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(args, f) is not None]
    if args.lora_rank is None:
        if more or (args.merge and getattr(args, "resume", None) is None):
            named = ", ".join(flag(f) for f in more) or "--merge"
            raise ValueError(f"{named} needs --lora-rank R (the adapters' rank)")
        return None
    out = {"rank": args.lora_rank}
    for f in more:
        out[f.removeprefix("lora_")] = getattr(args, f)
    return out
