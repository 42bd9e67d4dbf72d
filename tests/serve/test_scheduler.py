"""The scheduler the server drives (``decoderlab.generation.scheduler``): rows joining mid-flight, equal
prompt lengths prefilled together and stop strings give exactly ``generate`` / ``stream_text``'s text."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import decoderlab as dl
from decoderlab.generation.scheduler import GenerationRequest, Scheduler
from decoderlab.generation.stops import TextStopMatcher
from test_generation import newline_bpe  # noqa: F401 -- the fixture: a BPE, a model that writes "\n" "\n"

from .helpers import ref_text


def test_text_stop_holds_back_and_cuts(mt):
    """The scheduler's stop strings are generation.stops' (one implementation): what could become a stop is
    held back, and the text ends exactly before it."""
    _, tok = mt

    def push(s, text):
        ids, matched = s.feed(tok.encode(text))
        return tok.decode(ids), matched is not None

    s = TextStopMatcher(["ab", "xyz"], tok.decode)
    assert push(s, "qa") == ("q", False)  # "a" could start "ab"
    assert push(s, "c") == ("ac", False)
    assert push(s, "xy") == ("", False)
    assert push(s, "zzz") == ("", True)  # ends exactly before "xyz"
    s = TextStopMatcher(["ab"], tok.decode)
    assert push(s, "xa") == ("x", False) and tok.decode(s.flush()) == "a"


def test_scheduler_joins_rows_mid_flight_greedy_exact(mt):
    """Rows that join a running batch at different steps still give exactly generate(temperature=0)."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=8)
    try:
        results = {}
        done = threading.Event()
        prompts = ["a", "hello there", "x y z", "the long prompt, with words: ok"]

        def on(i):
            def f(ev):
                if ev[0] == "delta":
                    results[i] = results.get(i, "") + ev[2]
                elif ev[0] == "done":
                    results[f"done{i}"] = True
                    if all(f"done{j}" in results for j in range(len(prompts))):
                        done.set()
            return f

        for i, p in enumerate(prompts):
            sch.submit(GenerationRequest(prompt_ids=tok.encode(p), max_tokens=45, temperature=0, on_event=on(i)))
            time.sleep(0.01 * i)
        assert done.wait(30)
        for i, p in enumerate(prompts):
            assert results.get(i, "") == ref_text(mt, tok.encode(p), 45, 0, None)
    finally:
        sch.close()


def test_scheduler_prefills_equal_lengths_together_and_stays_exact(mt):
    """Newcomers with prompts of equal length are prefilled in one forward pass; seeded and greedy rows still
    give exactly generate's tokens (driven step by step on this thread, so the grouping is certain)."""
    model, tok = mt
    sch = Scheduler(model, tok, max_batch=16)
    sch.close()  # no thread: _step is driven here
    prompts = ["abcd", "hey!", "wxyz", "a b.", "ab", "hello there"]
    texts = {i: "" for i in range(len(prompts))}

    def on(i):
        def f(ev):
            if ev[0] == "delta":
                texts[i] += ev[2]
        return f

    reqs = [GenerationRequest(prompt_ids=tok.encode(p), max_tokens=40, temperature=0 if i % 2 else 0.9, seed=i,
                              on_event=on(i)) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        sch._step(reqs[:4])  # four prompts of 4 tokens: one prefill of a (4, 4) batch
        sch._step(reqs[4:])  # joining a running batch
        while sch._rows:
            sch._step([])
    for i, p in enumerate(prompts):
        assert texts[i] == ref_text(mt, tok.encode(p), 40, 0 if i % 2 else 0.9, i), p


def _run(sch: Scheduler, **fields) -> tuple[str, str]:
    """One request through the scheduler's thread: (its text, its finish reason)."""
    out = {"text": "", "finish": None}
    done = threading.Event()

    def on(ev):
        if ev[0] == "delta":
            out["text"] += ev[2]
        elif ev[0] == "finish":
            out["finish"] = ev[2]
        elif ev[0] in ("done", "error"):
            done.set()

    sch.submit(GenerationRequest(on_event=on, **fields))
    assert done.wait(30)
    return out["text"], out["finish"]


def test_scheduler_stops_as_stream_text_when_a_stop_begins_inside_a_token(newline_bpe):
    """A byte-level BPE whose model writes "\\n" one token at a time, and "x" -> "ab" -> "c": the stop "\\n\\n"
    is found across tokens, the stop "bc" begins inside the token "ab"; the scheduler's text is stream_text's,
    ending exactly before the stop."""
    tok, model, ids = newline_bpe
    sch = Scheduler(model, tok, max_batch=4)
    try:
        for prompt, stop in (("p", "\n\n"), ("x", "bc"), ("x", "c\n"), ("p", ["zz", "a\n\n"]), ("p", None)):
            want = "".join(dl.stream_text(model, tok, prompt, 6, temperature=0, stop=stop))
            got = _run(sch, prompt_ids=tok.encode(prompt), max_tokens=6, temperature=0, stop=stop)
            assert got == (want, "length" if stop is None else "stop"), (prompt, stop)
        assert _run(sch, prompt_ids=tok.encode("x"), max_tokens=6, temperature=0, stop="bc") == ("a", "stop")
        with pytest.raises(ValueError, match="top_k"):  # generate's own checks
            sch.submit(GenerationRequest(prompt_ids=[ids["p"]], max_tokens=3, top_k=-1))
    finally:
        sch.close()
