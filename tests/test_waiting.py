"""Long waits said as they happen (decoderlab.waiting): a heartbeat line while a wait runs, a time left only
from a measurement of this machine. No test here times anything: the clock is given, the lines are awaited."""

import json
import threading

import pytest

from decoderlab.waiting import Estimate, Heartbeat, MeasuredWaits, progress, starting

SAFETY = 60  # seconds a test waits for a heartbeat thread before it fails (a net, not a measurement)


def ticking(*values):
    """A clock that returns ``values`` in turn, then its last one."""
    values = list(values)
    return lambda: values.pop(0) if len(values) > 1 else values[0]


def beats(n: int, **kwargs) -> tuple[list[str], Heartbeat]:
    """The first ``n`` lines a heartbeat says while its block waits for them."""
    lines, got = [], threading.Event()

    def say(line):
        lines.append(line)
        if len(lines) >= n:
            got.set()

    with Heartbeat("compiling x", say, every=0.001, **kwargs) as hb:
        assert got.wait(SAFETY), lines
    return lines[:n], hb


def test_a_wait_with_nothing_measured_promises_no_time():
    line = starting("compiling x", None)
    assert line == "compiling x (nothing measured yet to estimate its time from: it is said when done) ..."
    assert not any(ch.isdigit() for ch in line)
    assert starting("compiling x", Estimate(131.4, "the last one took 131 s here")) == (
        "compiling x (~131 s: the last one took 131 s here) ...")


def test_heartbeat_lines_say_the_elapsed_time_and_what_is_left_of_the_measured_time():
    lines, hb = beats(3, expected=30.0, clock=ticking(100.0, 110.0, 125.0, 140.0, 150.0))
    assert lines == ["compiling x: 10 s so far, ~20 s left", "compiling x: 25 s so far, ~5 s left",
                     "compiling x: 40 s so far, past the ~30 s measured before"]
    assert hb.seconds == 50.0  # (the clock's last value, read when the block ends)


def test_heartbeat_without_a_measured_time_says_the_elapsed_time_only():
    lines, _ = beats(2, clock=ticking(0.0, 20.0, 40.0))
    assert lines == ["compiling x: 20 s so far", "compiling x: 40 s so far"]
    assert progress("x", 5, None) == "x: 5 s so far"


def test_a_wait_inside_another_is_said_by_the_outer_one_only():
    inner_lines, outer_lines = [], []
    got = threading.Event()

    def outer_say(line):
        outer_lines.append(line)
        got.set()

    with Heartbeat("warming up", outer_say, every=0.001):
        with Heartbeat("compiling", inner_lines.append, every=0.001):
            assert got.wait(SAFETY)
            got.clear()
            assert got.wait(SAFETY)  # (the inner one had as long to speak)
    assert inner_lines == [] and outer_lines[0].startswith("warming up: ")
    lines, _ = beats(1)  # a heartbeat after them speaks again
    assert lines[0].startswith("compiling x: ")


def test_a_heartbeat_ends_with_its_block_even_when_it_raises():
    with pytest.raises(KeyError):
        with Heartbeat("x", print, every=3600) as hb:
            raise KeyError
    assert hb._thread is not None and not hb._thread.is_alive() and hb.seconds is not None


def test_the_estimate_is_the_measured_time_of_the_same_shape(tmp_path):
    waits = MeasuredWaits(tmp_path / "w.json")
    assert waits.estimate("aot compile, cpu, float32", "k30", 30) is None  # nothing measured: none
    waits.record("aot compile, cpu, float32", "k30", 30, 120.04)
    waits.record("aot compile, cpu, float32", "k30", 30, 90.0)
    waits.record("serve warm-up, cpu, float32", "k30", 30, 7.0)
    assert waits.estimate("aot compile, cpu, float32", "k30", 30) == Estimate(
        90.0, "the last one of this shape took 90 s here")
    assert waits.estimate("aot compile, cpu, q8_0", "k30", 30) is None  # another kind measures nothing here


def test_the_estimate_of_another_shape_is_scaled_from_the_nearest_measured_size_or_none(tmp_path):
    waits = MeasuredWaits(tmp_path / "w.json")
    waits.record("aot compile, cpu, float32", "a", 10, 40.0)
    waits.record("aot compile, cpu, float32", "b", 24, 100.0)
    assert waits.estimate("aot compile, cpu, float32", "c", 30) == Estimate(
        125.0, "one of 24 layers took 100 s here, scaled to 30")
    assert waits.estimate("aot compile, cpu, float32", "c", 12).seconds == 48.0  # (from the 10 layers)
    assert waits.estimate("aot compile, cpu, float32", "c", 60) is None  # no measured size within a factor 2
    assert waits.estimate("aot compile, cpu, float32", "c", 4) is None


def test_a_damaged_or_unwritable_record_costs_the_estimate_only(tmp_path):
    path = tmp_path / "w.json"
    path.write_text("{not json")
    waits = MeasuredWaits(path)
    assert waits.estimate("k", "x", 1) is None
    waits.record("k", "x", 1, 2.0)
    assert json.loads(path.read_text()) == [{"kind": "k", "key": "x", "size": 1, "seconds": 2.0}]
    path.write_text(json.dumps([{"kind": "k", "key": "x", "seconds": "soon"}, 3, {"kind": "k", "key": "x",
                                                                                    "size": 1, "seconds": 4.0}]))
    assert waits.estimate("k", "x", 1).seconds == 4.0  # (records that are not measurements are skipped)
    blocked = MeasuredWaits(path / "w.json")  # a path under a file: not writable
    blocked.record("k", "x", 1, 2.0)
    assert blocked.estimate("k", "x", 1) is None


def test_the_record_keeps_the_newest(tmp_path, monkeypatch):
    from decoderlab import waiting

    monkeypatch.setattr(waiting, "KEEP", 3)
    waits = MeasuredWaits(tmp_path / "w.json")
    for i in range(5):
        waits.record("k", str(i), 1, float(i))
    assert [r["key"] for r in waits.records()] == ["2", "3", "4"]


def test_the_record_lives_in_the_decoderlab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    assert MeasuredWaits().path == tmp_path / "waits.json"

def test_progress_lines_measure_the_remaining_time_from_the_rate_so_far():
    """A wait says what it does at once, then at most a line per `every` seconds with the time left at its own
    rate so far (none before anything is done), and the whole time at the end. The seconds here are a fake
    clock's: no timed test."""
    import io

    from decoderlab.waiting import ProgressLines

    times = iter([0.0, 2.0, 6.0, 8.0, 11.5, 20.0])
    out = io.StringIO()
    lines = ProgressLines("evaluation", 100, "held-out tokens", every=5.0, stream=out, clock=lambda: next(times))
    lines.start()
    for done in (10, 30, 40, 0 + 60, 100):  # at 2 s (quiet), 6 s, 8 s (quiet), 11.5 s, 20 s
        lines.update(done)
    assert out.getvalue().splitlines() == [
        "evaluation: 100 held-out tokens ...",
        "evaluation 30/100 held-out tokens  elapsed 0:06  ETA 0:14",  # 6 s for 30: 70 more take 14 s
        "evaluation 60/100 held-out tokens  elapsed 0:12  ETA 0:08",  # 11.5 s for 60: 40 more take 7.7 s
        "evaluation 100/100 held-out tokens in 0:20"]
    quiet = io.StringIO()
    ProgressLines("load", 3, "files", every=5.0, stream=quiet, clock=iter([0.0, 9.0]).__next__).update(0)
    assert quiet.getvalue().splitlines() == ["load: 3 files ...", "load 0/3 files  elapsed 0:09"]  # no rate yet
