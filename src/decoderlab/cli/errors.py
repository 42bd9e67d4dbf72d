"""How a command ends, and library messages in the words of the command line.

A user's mistake (a bad path, a bad value) is one ``decoderlab: error: ...`` line and exit status 2, never a
traceback; Ctrl-C is one line and 130; a reader of standard output that went away (``| head``) ends the
command quietly with 141, as a program stopped by SIGPIPE (a training run goes on instead: see
:mod:`decoderlab.output`).
"""

from __future__ import annotations

import os
import re
import sys
from functools import lru_cache, wraps

from ..output import discard_stdout
from .options import SHAPE_OPTIONS, flag, train_fields

#: the command failed at its work (a NaN loss, verify's numbers differ)
FAILED = 1
#: a user's input: one ``decoderlab: error:`` line
USAGE = 2
#: Ctrl-C: 128 + SIGINT
INTERRUPTED = 130
#: the reader of standard output left: 128 + SIGPIPE, as a program stopped by it
CLOSED_PIPE = 141

#: the Python names in library messages -> the flags a user typed (see :func:`in_flag_words`)
FIELD_FLAGS = {**{f: flag(f) for f in (*train_fields(), *(f for f, kw, _ in SHAPE_OPTIONS if "type" in kw),
                                       "vocab_size", "val_fraction", "eval_prompts", "threads",
                                       "group_size", "kl_coef", "beta")},
               "max_epochs": "--epochs"}


@lru_cache(maxsize=1)
def _field_re() -> re.Pattern:  # compiled when first needed: not on every start
    return re.compile(r"(?<![\w./-])(" + "|".join(sorted(FIELD_FLAGS, key=len, reverse=True)) + r")(?![\w/-]|\.\w)")


def in_flag_words(message) -> str:
    """A library message in the words of the command line: ``max_steps must be ...`` -> ``--max-steps must
    be ...`` (whole words only; names inside paths and file names are left alone)."""
    return _field_re().sub(lambda m: FIELD_FLAGS[m.group(1)], str(message))


#: advice in library messages that names a Python argument -> what a user of the command line does instead
CLI_PHRASES = {
    "unknown dtype '": "unknown --dtype '",  # (the library's ValueError, which names no flag)
    "or with unk=True to map unknown characters to <unk>":
        "or use a model whose tokenizer has it (one trained with --tokenizer bpe reads any text as bytes)",
}


def in_cli_phrases(message: str) -> str:
    """``message`` with the advice of :data:`CLI_PHRASES` in the command line's terms."""
    for python, cli in CLI_PHRASES.items():
        message = message.replace(python, cli)
    return message


def error_message(e: BaseException) -> str:
    """The text of the one error line: an operating-system error as ``PATH: reason`` (no ``[Errno 2]``), a
    KeyError's message without its quotes, anything else as it reads."""
    if isinstance(e, KeyError) and e.args:
        return in_cli_phrases(str(e.args[0]))
    if isinstance(e, OSError) and e.strerror:
        where = [str(p) for p in (e.filename, e.filename2) if p is not None]
        return f"{' -> '.join(where)}: {e.strerror}" if where else e.strerror
    return in_cli_phrases(str(e))


def print_error(message) -> None:
    # a lone surrogate (command-line bytes that were not UTF-8) written as Python's own standard error writes it,
    # \udcff, whatever stream stands in for it (a strict one would raise instead of saying the error)
    line = f"decoderlab: error: {message}".encode("utf-8", "backslashreplace").decode("utf-8")
    print(line, file=sys.stderr, flush=True)


class warnings_as_lines:
    """``with warnings_as_lines():`` decoderlab's own warnings as ``decoderlab: warning: ...`` lines in the words
    of the flags (other libraries' warnings are shown as usual)."""

    def __enter__(self):
        import warnings

        self._package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        self._show = warnings.showwarning
        warnings.simplefilter("default", UserWarning)
        warnings.showwarning = self._showwarning
        return self

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if os.path.realpath(filename).startswith(self._package) and issubclass(category, UserWarning):
            print(f"decoderlab: warning: {in_flag_words(message)}", file=sys.stderr, flush=True)
        else:
            self._show(message, category, filename, lineno, file, line)


def in_flag_terms(command):
    """Decorate a command whose library calls speak of fields (``max_steps``): their warnings and
    ``ValueError`` messages are put in the flags' words."""
    @wraps(command)
    def run(args) -> int:
        try:
            with warnings_as_lines():
                return command(args)
        except ValueError as e:
            raise ValueError(in_flag_words(e)) from None
    return run


def run_command(args) -> int:
    """Run the parsed command ``args.func(args)`` and return its exit status (see the module's docstring)."""
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than in Python's exit
        return status
    except BrokenPipeError:
        discard_stdout()
        return CLOSED_PIPE
    except (OSError, ValueError, KeyError, ImportError) as e:  # ImportError: a missing optional dependency
        print_error(error_message(e))
        return USAGE
    except KeyboardInterrupt as e:  # Ctrl-C: the command has written what it produced; one line, no traceback
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            discard_stdout()
        training = sys.modules.get("decoderlab.training")  # loaded if training ran (not imported for this)
        if training is None or not isinstance(e, training.TrainingInterrupted):  # else InterruptNotice said it
            print(f"decoderlab: interrupted ({args.command} stopped by Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
