"""A long-running command (a server) started for a test and waited for by its own word: the line it prints once
it is ready, or its exit -- never a fixed number of seconds, which a loaded machine outlasts (a server whose
warm-up took longer than the wait was then asked anyway: "Connection refused").

``with running(argv, r"serving .* on (http://\\S+)") as proc: url = proc.ready.group(1)``; a command that exits
first, or prints nothing ready within :data:`SAFETY` seconds, fails the test with everything it printed."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time

#: a safety net, not a deadline: a command that printed nothing ready in this long is taken to hang
SAFETY = 15 * 60


class Running:
    """A started command whose output (standard error, with standard output unless that was closed) is read as it
    comes, so that the command never blocks on a full pipe.

    Attributes:
        proc: the ``subprocess.Popen``.
        ready: the match of the readiness pattern (set by :meth:`wait_for`).
    """

    def __init__(self, argv, *, env=None, close_stdout: bool = False):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE if close_stdout else subprocess.STDOUT)
        if close_stdout:  # (the command writes to a closed pipe: what a test of that checks)
            self.proc.stdout.close()
        stream = self.proc.stderr if close_stdout else self.proc.stdout
        self.lines: list[str] = []
        self._ended = False
        self._more = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()
        self.ready: re.Match | None = None

    def _read(self, stream) -> None:
        for raw in stream:
            with self._more:
                self.lines.append(raw.decode("utf-8", "replace"))
                self._more.notify_all()
        with self._more:
            self._ended = True  # the output ended: the command exited (or closed it)
            self._more.notify_all()

    def text(self) -> str:
        """Everything read so far."""
        with self._more:
            return "".join(self.lines)

    def wait_for(self, pattern: str, safety: float = SAFETY) -> re.Match:
        """The first line (read so far or to come) that matches ``pattern`` (``re.search``).

        Raises:
            AssertionError: the output ended (the command exited) first, or nothing matched within ``safety``
                seconds -- naming the exit status and with everything the command printed.
        """
        give_up, seen = time.monotonic() + safety, 0
        with self._more:
            while True:
                for line in self.lines[seen:]:
                    if m := re.search(pattern, line):
                        self.ready = m
                        return m
                seen = len(self.lines)
                if self._ended:
                    break
                left = give_up - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.proc.args!r} printed no line matching {pattern!r} in {safety:g} s "
                                         f"(a safety net: it is taken to hang); its output:\n{self.text()}")
                self._more.wait(left)
        status = self.proc.wait()
        raise AssertionError(f"{self.proc.args!r} exited with status {status} before printing a line matching "
                             f"{pattern!r}; its output:\n{self.text()}")

    def finish(self, timeout: float = 60) -> str:
        """Wait for the command to exit (after a signal sent to it) and return all it printed."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return self.text()

    def stop(self) -> None:
        """Terminate the command if it still runs, then kill it if it does not stop within 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running(argv, ready: str, *, env=None, close_stdout: bool = False, safety: float = SAFETY):
    """Start ``argv`` and yield its :class:`Running` once a line of its output matches ``ready`` (see
    :meth:`Running.wait_for`); stopped when the block ends."""
    proc = Running(argv, env=env, close_stdout=close_stdout)
    try:
        proc.wait_for(ready, safety)
        yield proc
    finally:
        proc.stop()
