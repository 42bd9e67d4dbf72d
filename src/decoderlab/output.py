"""Standard output that may be a closed pipe: ``decoderlab train ... | head -4`` closes the read end after four
lines, and every later write to standard output raises ``BrokenPipeError`` (Python ignores SIGPIPE).

A progress line must never stop a training run: :func:`print_line` writes a line and, once the reader is
gone, sends the rest of the process's output to ``os.devnull`` (:func:`discard_stdout`), so that the run goes
on and Python's own flush at exit has nothing to complain about. :class:`KeepWriting` does the same for a
whole command whose output is a side matter (training, serving). :class:`quiet_imports` keeps other
libraries' import-time notices off the output unless ``--verbose``. Ground layer: imports nothing from decoderlab (a long wait's
lines: :mod:`decoderlab.waiting`).
"""

from __future__ import annotations

import os
import sys


def _same_file(fd_a: int, fd_b: int) -> bool:
    try:
        a, b = os.fstat(fd_a), os.fstat(fd_b)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def discard_stdout() -> None:
    """Point file descriptor 1 (and 2, when it is the same pipe: ``2>&1 | head``) at ``os.devnull``: what is
    still buffered and every later write then succeed without a reader. Safe to call more than once."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        if _same_file(2, 1):
            os.dup2(devnull, 2)
        os.dup2(devnull, 1)
    finally:
        os.close(devnull)


def print_line(line: str, file=None) -> bool:
    """``print(line, file=file, flush=True)`` (``file`` defaults to ``sys.stdout``); on a closed pipe the
    output is discarded from then on (:func:`discard_stdout`) instead of raising. Returns False when the line
    found no reader."""
    stream = sys.stdout if file is None else file
    try:
        print(line, file=stream, flush=True)
        return True
    except BrokenPipeError:
        if stream is sys.stdout or stream is sys.__stdout__:
            discard_stdout()
        return False


class KeepWriting:
    """A stand-in for ``sys.stdout`` whose writes never raise ``BrokenPipeError``: once the reader is gone, the
    output goes to ``os.devnull`` and the command carries on (``with KeepWriting(): train(...)``). Everything
    else (``isatty``, ``fileno``, ``encoding`` ...) is the real stream's."""

    def __init__(self, stream=None):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            discard_stdout()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            discard_stdout()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __enter__(self) -> "KeepWriting":
        self._stream, self._saved = (self._stream or sys.stdout), sys.stdout
        sys.stdout = self
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout = self._saved


#: loggers of other libraries whose import-time notices concern no user of decoderlab (torchao's "Failed to
#: load ..._C_mxfp8" for CUDA-only kernels a CPU build lacks, torch pytree's deprecation of how torchao
#: registers its enums): shown only with ``decoderlab --verbose`` (``DECODERLAB_VERBOSE=1``)
QUIET_LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")


class quiet_imports:
    """``with quiet_imports(): import peft`` -- the import-time warnings of :data:`QUIET_LOGGERS` (and their
    Python warnings) muted for the block, unless ``DECODERLAB_VERBOSE`` is set; errors still show."""

    def __enter__(self):
        import logging
        import warnings

        self._on = not os.environ.get("DECODERLAB_VERBOSE")
        if self._on:
            self._loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
            self._levels = [log.level for log in self._loggers]
            for log in self._loggers:
                log.setLevel(logging.ERROR)
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            for module in ("torchao", "torch.utils._pytree"):
                warnings.filterwarnings("ignore", module=module)
        return self

    def __exit__(self, *exc):
        if self._on:
            self._warnings.__exit__(*exc)
            for log, level in zip(self._loggers, self._levels):
                log.setLevel(level)
        return False
