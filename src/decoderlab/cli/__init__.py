"""The ``decoderlab`` command line: thin commands over the library API.

Each subcommand parses its options and calls one library function; the commands hold no logic the Python
API lacks, and no copies of its settings: the defaults and choices in the help are read from
``decoderlab.config`` (plain data, so that ``--help`` imports no torch). Errors a user can cause (bad paths,
bad values) print one ``decoderlab: error: ...`` line and exit 2.

    parser.py     the parser with one-line errors, and the table of commands
    options.py    the option groups several commands share, and their readers
    argtypes.py   argparse types with errors in our words
    errors.py     how a command ends: error lines, exit statuses, library messages in the flags' words
    resume.py     a training run's options recorded for its resume, restored or refused (train, finetune, rl)
    train.py, generate.py (+ sample), chat.py, finetune.py, glassbox.py (verify, explain),
                  interpret.py (lens, heads, patch), serve.py, export.py
                  one module per command family
"""

from __future__ import annotations

import importlib
import os
import sys

from .parser import build_parser

#: names loaded from their command module on first use (PEP 562), so that a start imports only its command's
_LAZY = {"CHAT_HELP": "chat", "chat_command": "chat", "unescape": "generate"}

__all__ = ["CHAT_HELP", "build_parser", "chat_command", "main", "unescape"]


def main(argv: list[str] | None = None) -> int:
    """Run ``decoderlab ARGV`` (default ``sys.argv[1:]``) and return its exit status (``decoderlab`` console
    script, ``python -m decoderlab.cli``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "--verbose" in argv
    if verbose:  # anywhere on the line: other libraries' import notices are shown too
        argv.remove("--verbose")
    args = build_parser(argv).parse_args(argv)
    args.verbose = verbose or getattr(args, "verbose", False)  # a command's own --verbose (generate's) as well
    from .errors import run_command
    from .options import stop_announcing

    before = os.environ.get("DECODERLAB_VERBOSE")
    if verbose:
        os.environ["DECODERLAB_VERBOSE"] = "1"
    try:
        return run_command(args)
    finally:  # for this command only (main may run again in the same process: tests, notebooks)
        stop_announcing()
        if verbose and before is None:
            os.environ.pop("DECODERLAB_VERBOSE", None)
        elif verbose:
            os.environ["DECODERLAB_VERBOSE"] = before


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'decoderlab.cli' has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
