"""A training command's options, kept for its resume -- one implementation for ``train``, ``finetune`` and ``rl``.

A run records every option of its command line in its ``run.json`` (``"options"``, written before the first step
by :class:`decoderlab.training.run.RecordOptions`; paths made absolute). ``--resume`` then restores each option
not given, and refuses a given one that differs from the run's, naming both values (one line). Left alone:

- the options of the invocation (:data:`OF_THE_INVOCATION`: where it writes, its threads, its progress display):
  never stored;
- the run's model (:data:`OF_THE_MODEL`): a resume takes it from the run directory, and each command refuses these
  flags on a resume;
- the settings the library records in ``run.json`` under their own names (the train settings -- honoured from the
  next step or refused --, the data by its digest, the template, the launch): passed to the library as given,
  which restores and judges them.

So an option a command gains is kept by its resumes without a line here (``--eval-prompts`` was forgotten). (``json`` is imported when a command runs: not for ``--help``.)
"""

from __future__ import annotations

import argparse
import os

from .options import SHAPE_FIELDS, run_out

#: never stored: how this invocation runs
OF_THE_INVOCATION = ("help", "resume", "out", "threads", "no_progress_bar")
#: a resume takes the run's model and tokenizer from its directory (each command refuses these flags on a resume)
OF_THE_MODEL = ("checkpoint", "preset", "tokenizer", "vocab_size", *SHAPE_FIELDS)
#: the metavars of options that name a file or directory: stored as absolute paths
PATH_METAVARS = ("PATH", "DIR", "FILE")


def resumed_dir(args) -> str | None:
    """The run directory ``--resume`` continues (``--out`` for a bare ``--resume``); None for a new run."""
    if args.resume is None or (args.resume is True and args.out is None):
        return None
    return run_out(argparse.Namespace(out=None, resume=args.out if args.resume is True else args.resume))


def _actions(command: str) -> list[argparse.Action]:
    """The options of ``command``'s parser that a run records."""
    from .parser import build_parser

    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a for a in sub._actions if a.option_strings and a.dest not in OF_THE_INVOCATION]


def _stored(action: argparse.Action, value):
    """``value`` as run.json holds it: JSON's types (a tuple as a list), a path absolute."""
    import json

    if isinstance(value, str) and action.metavar in PATH_METAVARS:
        value = os.path.abspath(value)
    return json.loads(json.dumps(value, default=str))


def _given(action: argparse.Action, value) -> bool:
    return value is not None and value != action.default


def _flag(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def _shown(action: argparse.Action, value) -> str:
    """``--eval-prompts 5``, ``--merge``, ``no --lora-rank``."""
    flag = _flag(action)
    if value is None or value is False:
        return f"no {flag}"
    return flag if action.nargs == 0 else f"{flag} {value}"


def _settings_of(run_dir) -> set[str]:
    """The names under which the library's ``run.json`` records settings itself (its top level and its
    ``*_config`` mappings: ``train_config``, ``rl_config``)."""
    import json

    from ..training.run import RUN_FILE

    try:
        with open(os.path.join(run_dir, RUN_FILE), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return set()
    names = set(info)
    for key, value in info.items():
        if key.endswith("_config") and isinstance(value, dict):
            names |= set(value)
    return names


def restore_options(args) -> None:
    """On a resume, put the run's recorded options into ``args`` where not given; refuse one given that differs
    (see the module docstring). Nothing to do for a new run or a run that recorded none.

    Raises:
        ValueError: ``cannot resume RUN with --eval-prompts 5: the run has --eval-prompts 1, and a resume takes the
            run's options; ...`` (the first that differs).
    """
    from ..training.run import recorded_options

    run_dir = resumed_dir(args)
    stored = {} if run_dir is None else recorded_options(run_dir)
    if not stored:
        return
    library = _settings_of(run_dir)
    for action in _actions(args.command):
        name = action.dest
        if name in OF_THE_MODEL or name in library or name not in stored:
            continue
        value = getattr(args, name)
        if not _given(action, value):
            setattr(args, name, stored[name])
        elif _stored(action, value) != stored[name]:
            raise ValueError(f"cannot resume {run_dir} with {_shown(action, value)}: the run has "
                             f"{_shown(action, stored[name])}, and a resume takes the run's options; resume without "
                             f"{_flag(action)}, or start a new run")


def record_options(args):
    """The callback that records the options of this command line in the run's ``run.json``
    (:class:`decoderlab.training.run.RecordOptions`): every option of a new run (None: not given); on a resume the
    run's recorded ones with those given now on top."""
    from ..training.run import RecordOptions, recorded_options

    run_dir = resumed_dir(args)
    stored = {} if run_dir is None else recorded_options(run_dir)
    options = {a.dest: _stored(a, getattr(args, a.dest)) for a in _actions(args.command)
               if not stored or _given(a, getattr(args, a.dest))}
    return RecordOptions({**stored, **options})
