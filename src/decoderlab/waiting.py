"""Long waits said as they happen: a line every ``every`` seconds while one runs (:class:`Heartbeat`), and a
remaining-time estimate only where this machine measured one (:class:`MeasuredWaits`: the seconds that an
earlier wait of the same kind took here) -- never a figure hoped for. A compile's time depends on the machine,
its load, the compiler's disk cache and the model's depth (SmolLM2-135M's first ``--aot`` compile took 79 s on
one machine and 477 s on a loaded one), so no fixed range is true for everyone.

The lines share one wording: ``compiling ... (the last one of this model's shape took 131 s here) ...`` when a
wait starts, ``compiling ...: 40 s so far, ~91 s left`` while it runs, and ``... in 128 s`` when it is done.
A wait whose work is counted (tokens evaluated) says its count instead, with the time left measured from its own
rate so far (:class:`ProgressLines`; :func:`clock` writes the times). Imports only :mod:`decoderlab.files` (its
record is written atomically) and :mod:`decoderlab.output`, so that any layer above may say its waits.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .output import print_line

#: seconds between two heartbeat lines
EVERY = 20.0

#: how many records :class:`MeasuredWaits` keeps (the newest)
KEEP = 200

_ACTIVE = {"n": 0}  # heartbeats running in this process (only the outermost one speaks)
_LOCK = threading.Lock()


def cache_root() -> Path:
    """``$DECODERLAB_CACHE``, else ``$XDG_CACHE_HOME/decoderlab`` (``~/.cache/decoderlab``)."""
    return Path(os.environ.get("DECODERLAB_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decoderlab")


@dataclass(frozen=True)
class Estimate:
    """How long a wait should take, from a measurement on this machine: ``seconds``, and ``basis``, the words
    that say what was measured (``"the last one of this model's shape took 131 s here"``)."""

    seconds: float
    basis: str


def starting(doing: str, estimate: Estimate | None) -> str:
    """The line that opens a wait: ``doing`` and the measured estimate, or that there is none yet."""
    if estimate is None:
        return f"{doing} (nothing measured yet to estimate its time from: it is said when done) ..."
    return f"{doing} (~{estimate.seconds:.0f} s: {estimate.basis}) ..."


def progress(doing: str, elapsed: float, expected: float | None) -> str:
    """A heartbeat line: the seconds waited so far and, where an earlier time was measured, those left."""
    line = f"{doing}: {elapsed:.0f} s so far"
    if expected is None:
        return line
    if elapsed < expected:
        return f"{line}, ~{expected - elapsed:.0f} s left"
    return f"{line}, past the ~{expected:.0f} s measured before"


class Heartbeat:
    """While a ``with`` block runs, one :func:`progress` line through ``say`` every ``every`` seconds, from a
    background thread, so that a wait of minutes (a compile) is never silent.

    Args:
        doing: what is waited for (``"compiling the decode step ahead of time"``).
        say: called with each line (a ``decoderlab:`` line on standard error, say).
        expected: the seconds this wait is expected to take, measured earlier on this machine
            (:meth:`MeasuredWaits.estimate`), or None: then no time left is said.
        every: seconds between lines (None: :data:`EVERY`).
        clock: monotonic seconds (tests give their own).

    Attributes:
        seconds: how long the block took (set when it ends).

    Only the outermost heartbeat of a process speaks: a wait inside another (a compile inside the server's
    warm-up) is said already, with the outer wait's estimate.
    """

    def __init__(self, doing: str, say: Callable[[str], None], *, expected: float | None = None,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.doing, self.say, self.expected, self.clock = doing, say, expected, clock
        self.every = EVERY if every is None else every
        self.seconds: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self._start = self.clock()
        with _LOCK:
            outermost = _ACTIVE["n"] == 0
            _ACTIVE["n"] += 1
        if outermost:
            self._thread = threading.Thread(target=self._beat, name="decoderlab-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        with _LOCK:
            _ACTIVE["n"] -= 1
        self.seconds = self.clock() - self._start

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            self.say(progress(self.doing, self.clock() - self._start, self.expected))


class MeasuredWaits:
    """The seconds that waits took on this machine, kept between processes in a JSON file (default
    ``cache_root()/waits.json``), so that the next wait of a kind can say how long it will take from a
    measurement.

    A record is a wait's ``kind`` (``"aot compile, cpu, float32"``: what is done, where, in what dtype), its
    ``key`` (exactly what was done: a model's shape), its ``size`` (the model's layers: a compile's work grows
    with the layers it unrolls) and its seconds. A file that cannot be read or written costs the estimate, never
    the wait itself.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_root() / "waits.json"

    def records(self) -> list[dict]:
        """The records, oldest first ([] when the file is missing or unreadable)."""
        try:
            records = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []

    def record(self, kind: str, key: str, size: int, seconds: float) -> None:
        """Keep one measured wait (the newest :data:`KEEP` are kept)."""
        from .files import atomic_write_text

        records = self.records() + [{"kind": kind, "key": key, "size": size, "seconds": seconds}]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(records[-KEEP:], indent=0))
        except OSError:
            pass  # (a read-only cache: no estimate next time, nothing else lost)

    def estimate(self, kind: str, key: str, size: int) -> Estimate | None:
        """The seconds a wait of ``kind`` on ``key`` of ``size`` should take here: the last measured one of the
        same key; else the last one of the same kind whose size is nearest, within a factor of 2, scaled by the
        sizes' ratio; else None (nothing measured is near enough to say)."""
        same = [r for r in self.records() if r.get("kind") == kind and _number(r.get("seconds"))]
        exact = [r for r in same if r.get("key") == key]
        if exact:
            return Estimate(exact[-1]["seconds"], f"the last one of this shape took {exact[-1]['seconds']:.0f} s "
                                                  f"here")
        near = [r for r in same if _number(r.get("size")) and r["size"] > 0 and 0.5 <= size / r["size"] <= 2]
        if not near or size <= 0:
            return None
        r = min(reversed(near), key=lambda r: abs(r["size"] - size))  # (the newest of the nearest)
        return Estimate(r["seconds"] * size / r["size"], f"one of {r['size']} layers took {r['seconds']:.0f} s "
                                                         f"here, scaled to {size}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def clock(seconds: float) -> str:
    """``seconds`` as M:SS, or H:MM:SS from an hour on."""
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressLines:
    """Plain lines (logs, pipes, terminals alike) of a wait of ``total`` ``unit``, so that no wait over about
    ``every`` seconds is silent::

        evaluation: 65,536 held-out tokens ...                                   (start)
        evaluation 12,288/65,536 held-out tokens  elapsed 0:21  ETA 1:31          (update, at most one per ``every`` s)
        evaluation 65,536/65,536 held-out tokens in 1:52                          (update with done == total)

    The remaining time is measured, never promised: what is left at this wait's own rate so far (elapsed / done),
    so no line has one before the first unit is done. ``clock``: the seconds counter (``time.perf_counter``; a
    test gives its own). Lines go through :func:`print_line` (a closed pipe never stops the work) to ``stream``
    (standard output by default).
    """

    def __init__(self, what: str, total: int, unit: str, *, every: float = 5.0, stream=None, clock=time.perf_counter):
        self.what, self.total, self.unit, self.every = what, int(total), unit, float(every)
        self.stream, self._clock = stream, clock
        self._t0 = self._last = None

    def start(self) -> "ProgressLines":
        """The first line (what is about to be done), and the clock started."""
        self._t0 = self._last = self._clock()
        print_line(f"{self.what}: {self.total:,} {self.unit} ...", self.stream)
        return self

    def update(self, done: int) -> None:
        """``done`` of ``total`` are done: a line when ``every`` seconds passed since the last one, or at the end."""
        if self._t0 is None:
            self.start()
        now = self._clock()
        elapsed = now - self._t0
        count = f"{self.what} {done:,}/{self.total:,} {self.unit}"
        if done >= self.total:
            print_line(f"{count} in {clock(elapsed)}", self.stream)
        elif now - self._last >= self.every:
            eta = f"  ETA {clock(elapsed / done * (self.total - done))}" if done > 0 else ""
            print_line(f"{count}  elapsed {clock(elapsed)}{eta}", self.stream)
        else:
            return
        self._last = now
