"""``decoderlab train``: a language model on text (a recipe, or a preset's shape changed by the shape flags), or
with ``--preset statquest`` the lesson's model on its two pairs (``decoderlab.training``)."""

from __future__ import annotations

from ..config.defaults import PAIR_TRAIN, TRAIN_DEFAULTS
from ..config.names import DEFAULT_BPE_VOCAB_SIZE, DEFAULT_TOKENIZER, TOKENIZERS
from ..config.recipes import DEFAULT_RECIPE, RECIPES, TRAIN_CHOICES
from ..output import KeepWriting
from .argtypes import number, seed
from .errors import FAILED, in_flag_terms, print_error
from .options import (RUN_OPTIONS, SHAPE_FIELDS, THREADS_OPTIONS, add_model_shape_options, add_options,
                      add_train_config_options, check_out_dir, check_strategy, flag, model_overrides, progress_mode,
                      set_threads, train_overrides)
from .resume import record_options, restore_options, resumed_dir

_RECIPE_TRAIN = RECIPES[DEFAULT_RECIPE].train

DESCRIPTION = ("Train a language model on text (a recipe, or a preset's shape changed by the model-shape flags), or "
               "with --preset statquest the lesson's model on its two pairs. The default recipe, "
               f"{DEFAULT_RECIPE}, is baby-shakespeare's size with rotary positions, QK-norm, ReLU² and "
               f"zero-initialised projections, trained with Muon + AdamW for {_RECIPE_TRAIN['max_steps']} steps "
               "(docs/training.md). Progress: a bar on a terminal; plain lines when the output is "
               "redirected or with --no-progress-bar. A closed output (`| head`) does not stop the run.")


def add_train(p) -> None:
    p.description = DESCRIPTION
    p.add_argument("--preset", default=None, choices=TRAIN_CHOICES,
                   help=f"a recipe ({', '.join(RECIPES)}: a model and its training settings) or a model preset "
                        f"(trained with TrainConfig's defaults); statquest trains the lesson's pairs (default "
                        f"{DEFAULT_RECIPE})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run/checkpoint directory to write (default runs/<timestamp>; statquest: runs/statquest)")
    p.add_argument("--epochs", type=number(int), default=None, metavar="N",
                   help=f"epochs of pair training, statquest only (default {PAIR_TRAIN['max_epochs']})")
    p.add_argument("--seed", type=seed(32), default=None, metavar="N",
                   help=f"random seed of the weights and batches (default {TRAIN_DEFAULTS['seed']})")
    g = p.add_argument_group("language-model training (defaults: decoderlab.training.TrainConfig)")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a UTF-8 text file or a folder of .txt files (default: the embedded tinyshakespeare)")
    g.add_argument("--tokenizer", default=None, choices=TOKENIZERS,
                   help=f"tokenizer built from the data (default {DEFAULT_TOKENIZER})")
    g.add_argument("--vocab-size", type=number(int), default=None, metavar="N",
                   help=f"BPE vocabulary size, at least 259 (default {DEFAULT_BPE_VOCAB_SIZE}; bpe only)")
    add_train_config_options(g, lesson=True, recipe=_RECIPE_TRAIN)
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the decoder blocks (default: off)")
    g.add_argument("--watch-heads", type=number(int, 1), default=None, metavar="N",
                   help="every N steps record every head's previous-token, duplicate-token and induction scores and "
                        "the loss into the run directory's head_scores.jsonl (decoderlab explain --run DIR draws "
                        "them; default: off)")
    add_options(g, RUN_OPTIONS)
    add_options(g, THREADS_OPTIONS)
    add_model_shape_options(p)
    p.set_defaults(func=cmd_train)


#: flags that apply to language-model training only (statquest trains the lesson's pairs)
_LM_ONLY = ("data", "tokenizer", "vocab_size", "max_steps", "min_lr", "warmup", "precision", "compile", "eval_every",
            "val_batches", "log_every", "grad_clip", "accumulate", "resume", "optimizer", "muon_lr", "schedule",
            "cooldown", "full_val_below", "watch_heads", *SHAPE_FIELDS)


@in_flag_terms
def cmd_train(args) -> int:
    with KeepWriting():  # a closed output must not cost the run: training goes on, its lines discarded
        if args.out is not None:
            check_out_dir(args.out)
        set_threads(args)
        name = args.preset or ("statquest" if _resumes_pairs(args) else DEFAULT_RECIPE)
        if name == "statquest":
            return _train_statquest(args)
        return _train_lm(args, name)


def _resumes_pairs(args) -> bool:
    """``--resume`` names a run of the lesson's pair training (its ``run.json`` says ``"task": "pairs"``)."""
    import json
    import os

    run_dir = resumed_dir(args)
    try:
        with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
            return json.load(f).get("task") == "pairs"
    except (TypeError, OSError, ValueError, AttributeError):
        return False


def _train_lm(args, name: str) -> int:
    if args.epochs is not None:
        raise ValueError(f"--epochs applies to --preset statquest only; a language model trains for --max-steps "
                         f"(default {_RECIPE_TRAIN['max_steps']})")
    from ..training import NonFiniteLossError, train_lm

    restore_options(args)  # a resume's options are the run's
    shape = _checked_shape(args, name)
    check_strategy(args.strategy)
    try:
        preset = name if args.resume is None else args.preset  # a resumed run keeps its own
        _, _, s = train_lm(args.data, preset=preset, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           out=args.out, config_overrides=train_overrides(args), model_overrides=shape or None,
                           resume=args.resume, devices=args.devices, strategy=args.strategy,
                           num_nodes=args.num_nodes, progress_bar=progress_mode(args),
                           callbacks=[*_watch(args), record_options(args)])
    except NonFiniteLossError as e:
        print_error(e)
        return FAILED
    if s.is_global_zero:
        _print_summary(args, name, s)
        if args.watch_heads is not None:
            from ..glassbox.watching import WATCH_FILE

            print(f"head scores recorded every {args.watch_heads} steps in {s.run_dir}/{WATCH_FILE}; draw them "
                  f"beside the loss with: decoderlab explain --run {s.run_dir} --png heads.png")
    return 0


def _watch(args) -> list:
    """``--watch-heads N``: the HeadWatch callback, writing into the run directory train_lm names."""
    if args.watch_heads is None:
        return []
    from ..headwatch import HeadWatch

    return [HeadWatch(None, every=args.watch_heads)]


def _checked_shape(args, name: str) -> dict:
    """The shape flags, refused with --resume and checked against the preset before any data is read."""
    shape = model_overrides(args)
    if args.resume is not None:
        if shape:
            raise ValueError(f"{', '.join(flag(f) for f in shape)}: a resumed run keeps its model shape "
                             f"(its config.json); give the shape flags to a new run")
        _check_not_finished(args)
    elif shape:
        from ..model import preset
        from ..config.recipes import resolve

        preset(resolve(name)[0], **shape)  # the shape's errors before the corpus is read and tokenized
    return shape


def _print_summary(args, name: str, s) -> None:
    if args.resume is not None:  # the run's own preset or recipe
        from ..checkpoint import read_meta

        name = read_meta(s.run_dir).get("preset") or name
    print(f"trained {name} ({s.num_parameters:,} parameters) for {s.steps} steps: train loss {s.train_loss:.4f} "
          f"(mean of the last {s.train_loss_steps} steps), {s.tokens_per_second:,.0f} tokens per second")
    if s.val_loss is not None:
        step = s.val_history[-1][0] if s.val_history else s.steps
        where = "" if s.device is None else f" on {s.device}"  # (the device the model trained on)
        print(f"final evaluation at step {step}{where}: val loss {s.val_loss:.4f} nats/token (perplexity "
              f"{s.val_ppl:.2f}, {s.val_bpb:.3f} bits per byte); checkpoint written to {s.run_dir}")


def _check_not_finished(args) -> None:
    """Resuming a run that already reached its --max-steps would train nothing: say so, and how to continue."""
    import json
    from pathlib import Path

    from ..checkpoint import read_meta
    from ..training import RUN_FILE, resolve_resume

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


def _train_statquest(args) -> int:
    from ..checkpoint import read_meta
    from ..lesson import LESSON_PAIRS
    from ..training import train_pairs

    lm_only = [opt for opt in _LM_ONLY if getattr(args, opt) is not None and opt != "resume"]
    lm_only += [opt for opt, default in (("devices", 1), ("strategy", "auto"), ("num_nodes", 1))
                if getattr(args, opt) != default]
    if lm_only:
        raise ValueError(
            f"--preset statquest trains the lesson's two pairs; {', '.join(flag(o) for o in lm_only)} "
            f"{'applies' if len(lm_only) == 1 else 'apply'} to language-model presets only (statquest takes "
            f"--out, --resume, --epochs, --seed, --lr, --batch-size)"
        )
    out = resumed_dir(args) or args.out or "runs/statquest"
    model, tok = train_pairs(out=out, resume=args.resume and out, max_epochs=args.epochs, seed=args.seed,
                             lr=args.lr, batch_size=args.batch_size)
    _print_lesson(model, tok, LESSON_PAIRS, read_meta(out)["epochs"], out)
    return 0


def _print_lesson(model, tok, pairs, epochs: int, out) -> None:
    """What the lesson's model learned: its loss over both pairs and its answer to each prompt."""
    import torch

    from ..lesson import greedy_response, pair_inputs_and_labels

    with torch.no_grad():
        loss = float(model.compute_loss(pair_inputs_and_labels(pairs, tok)))
    print(f"trained the lesson's model ({model.num_parameters()} parameters) for {epochs} epochs "
          f"on its two pairs: final loss {loss:.4f} (mean cross-entropy over both pairs)")
    answers = []
    for prompt, _ in pairs:
        ids = greedy_response(model, tok.encode(prompt) + [tok.eos_id], tok.eos_id)
        answers.append(tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_id else ids))
        print(f'  "{prompt}" -> {answers[-1]}')
    verdict = ('both lesson prompts are answered "awesome"' if all(a == "awesome" for a in answers)
               else 'not both lesson prompts are answered "awesome" (try more --epochs or another --seed)')
    print(f"{verdict}; checkpoint written to {out}")
