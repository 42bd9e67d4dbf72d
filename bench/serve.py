"""Serving throughput: concurrent streaming clients against local `decoderlab` servers, with chunked prefill off
and on.

Each server runs in its own process (so the clients' event loop does not share the server's interpreter) with the
`shakespeare-char` shape (6 layers, 6 heads, d_model 384, context 256; random init: speed does not depend on the
weights) and the intra-op threads `decoderlab serve` chooses by default (``decoderlab.threads.choose_threads``:
the cores the load leaves idle, at most 2; ``--threads N`` to fix them). <EOS> is not a stop token here, so every
client gets all its tokens. Each client streams one /v1/completions request (a 16-character line of
tinyshakespeare as the prompt, temperature 0.8, its own seed) with stream_options.include_usage.

The scaling table (``--clients 1 4 16 32``; ``--clients`` alone: none), one server with chunking off: per N,
failures (non-200, missing [DONE], or the wrong number of tokens), time to first token (first non-empty delta)
p50/p95, aggregate tokens/s = all completion tokens / wall time, against one stream and against the same N
requests one after another.

The targets (one server per ``--prefill-chunk`` value and one with chunking off, measured in turn, ``--repeats``
alternating rounds, medians):

* 16 concurrent streams against one stream, aggregate tokens/s (target >= 8x);
* a burst of 16 requests with prompts of 8 .. 56 characters arriving together: TTFT p95 against the burst's
  compute floor -- its own padded (16, 56) prefill pass plus one decode step of its 16 rows, timed in this
  process (target <= 1.3x);
* one served stream against the library's ``decoderlab.generate`` (same shape, threads, temperature; target
  >= 0.9x);
* a 240-token prompt sent while 15 streams run: their longest wait between two tokens, and its own TTFT (what
  chunked prefill is for).

Then the scheduler alone (no HTTP, ``--only-split`` for just this): a step of 1 and of 16 rows, and the share of it
in the model's decode step; and structured output's cost per token (``generate`` with a regex grammar against the
same call without).

``--compile``: a server with the compiled decode step too (``decoderlab serve``'s default; chunking off), its
single stream measured against the library's compiled step.

Usage: python bench/serve.py [--clients 1 4 16 32] [--tokens 128] [--threads N] [--prefill-chunk 16 64]
                             [--repeats 3] [--compile] [--only-split]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time


def bench_model():
    """The bench's model and tokenizer: the shakespeare-char shape, random init (seed 0), a character tokenizer
    with no end-of-text token (every client gets all its tokens)."""
    import torch

    import decoderlab as dl

    torch.manual_seed(0)
    text = dl.read_corpus()

    class NoStopCharTokenizer(dl.CharTokenizer):
        @property
        def eos_id(self):  # <EOS> is not a stop token: every client gets all its tokens
            return None

        @property
        def end_of_text_ids(self):  # (nor any other control token)
            return ()

    tok = NoStopCharTokenizer(set(text))
    model = dl.DecoderOnlyTransformer(dl.preset("shakespeare-char", num_tokens=tok.vocab_size)).eval()
    return model, tok


def run_server(port: int, threads: int | None, prefill_chunk: int | None, compile: bool = False) -> None:
    from decoderlab.serve import Limits, create_app
    from decoderlab.threads import set_threads

    import uvicorn

    set_threads(threads)  # None: as `decoderlab serve` chooses (the idle cores, at most 2)
    model, tok = bench_model()
    if compile:  # as `decoderlab serve` (its default; --eager: not)
        model.compile_decode()
    app = create_app(model, tok, model_id="shakespeare-char", template=None,
                     limits=Limits(max_batch=64, max_queue=128, prefill_chunk=prefill_chunk))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def one(client, url, prompt, seed, tokens, delay: float = 0.0):
    """One streamed request (sent after ``delay`` s): (TTFT or None on a failure, tokens received, the arrival
    times of its text deltas)."""
    await asyncio.sleep(delay)
    body = {"model": "shakespeare-char", "prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    done, got, times = False, 0, []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, 0, []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    got = ev["usage"]["completion_tokens"]
                if any(c.get("text") for c in ev.get("choices", [])):
                    times.append(time.perf_counter())
    except Exception:  # noqa: BLE001 -- a failure is counted, not raised
        return None, 0, []
    ok = done and got == tokens and times
    return (times[0] - t0 if ok else None), got, times


def quantile(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def measure(url, prompts, n, tokens, concurrent: bool, long_prompt: str | None = None):
    """``n`` requests (at once or one after another); with ``long_prompt``, one more request with it, sent once
    the others stream, and ``gap``: the median over the others of their longest wait between two deltas."""
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        if concurrent:
            jobs = [one(client, url, prompts[i % len(prompts)], i, tokens) for i in range(n)]
            if long_prompt is not None:
                jobs.append(one(client, url, long_prompt, n, tokens, delay=0.5))
            res = await asyncio.gather(*jobs)
        else:
            res = [await one(client, url, prompts[i % len(prompts)], i, tokens) for i in range(n)]
        wall = time.perf_counter() - t0
    out = {}
    if long_prompt is not None:
        out["long_ttft"] = float("nan") if res[-1][0] is None else res[-1][0]
        res = res[:-1]
        out["gap"] = statistics.median(max(b - a for a, b in zip(t, t[1:])) for _, _, t in res if len(t) > 1)
    ttfts = [t for t, _, _ in res if t is not None]
    total = sum(g for _, g, _ in res)
    return {"failures": sum(1 for t, _, _ in res if t is None), "p50": statistics.median(ttfts) if ttfts else
            float("nan"), "p95": quantile(ttfts, 0.95), "tps": total / wall, "wall": wall, **out}


def burst_floor(model, tok, prompts: list[str], repeats: int = 5) -> float:
    """The compute floor of a burst: its own padded prefill pass (left-padded to the longest prompt, a padding
    mask and per-row positions, as the scheduler prefills newcomers together) plus one decode step of all its
    rows; the median of ``repeats`` (seconds)."""
    import torch

    from decoderlab.generation import KVCache

    ids = [tok.encode(p) for p in prompts]
    t = max(map(len, ids))
    pads = torch.tensor([t - len(i) for i in ids]).unsqueeze(1)
    tokens = torch.tensor([[0] * (t - len(i)) + i for i in ids])
    ar = torch.arange(t).unsqueeze(0)
    mask = ar < pads
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = KVCache(model.config.n_layer, model.config.max_len)
            t0 = time.perf_counter()
            logits = model(tokens, positions=(ar - pads).clamp_min(0), padding_mask=mask, cache=cache,
                           last_only=True, check_ids=False)[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            step_mask = torch.cat([mask, torch.zeros(len(ids), 1, dtype=torch.bool)], 1)
            model.decode(nxt, t - pads, step_mask, cache).argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def library_tps(model, tok, prompt: str, tokens: int) -> float:
    """tokens/s of ``decoderlab.generate`` (temperature 0.8, as the clients), best of 3 after a warm-up."""
    import decoderlab as dl

    ids = tok.encode(prompt)
    times = []
    for seed in range(4):
        t0 = time.perf_counter()
        assert len(dl.generate(model, ids, tokens, temperature=0.8, seed=seed, tokenizer=tok)) == tokens
        times.append(time.perf_counter() - t0)
    return tokens / min(times[1:])  # (the first is the warm-up)


def grammar_cost(model, tok, prompt: str, tokens: int) -> float:
    """Structured output's cost: ``generate`` with a regex grammar over the time without, per token."""
    import decoderlab as dl
    from decoderlab.generation import Grammar

    ids = tok.encode(prompt)
    grammar = Grammar.regex("[A-Za-z ,.;:!?'\\n-]+")  # never complete: all the tokens are generated

    def timed(**kw) -> float:
        best = float("inf")
        for seed in range(3):
            t0 = time.perf_counter()
            assert len(dl.generate(model, ids, tokens, temperature=0.8, seed=seed, tokenizer=tok, **kw)) == tokens
            best = min(best, time.perf_counter() - t0)
        return best

    timed()  # warm-up
    return timed(grammar=grammar) / timed()


def step_split(model, tok, prompts: list[str], rows: int, steps: int = 64) -> tuple[float, float]:
    """The scheduler alone (no HTTP), ``rows`` rows decoding: (ms per step, the share of it in the model's decode
    step); the rest is sampling, stops, text and the batch cache's bookkeeping."""
    import torch

    from decoderlab.generation import SamplingParams
    from decoderlab.generation.scheduler import GenerationRequest, Scheduler

    inside = [0.0]

    def timed_decode(*a):
        t0 = time.perf_counter()
        out = model.decode(*a)
        inside[0] += time.perf_counter() - t0
        return out

    sch = Scheduler(model, tok, max_batch=64)
    sch.close()  # driven here, step by step
    reqs = [GenerationRequest(tok.encode(prompts[i % len(prompts)]),
                              SamplingParams(max_new_tokens=steps + 8, temperature=0.8, seed=i)) for i in range(rows)]
    model.compiled_decode = timed_decode  # (what the scheduler steps with: model.decode, timed)
    try:
        with torch.inference_mode():
            sch._step(reqs)
            for _ in range(4):
                sch._step([])
            inside[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                sch._step([])
            total = time.perf_counter() - t0
    finally:
        model.compiled_decode = None
    return 1000 * total / steps, inside[0] / total


def start_server(threads, chunk, compile: bool = False):
    """A bench server in its own process: (process, url)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, __file__, "--serve", str(port), "--prefill-chunk", *([] if chunk is None else [str(chunk)])]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if compile:
        argv.append("--compile")
    proc = subprocess.Popen(argv)
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.3)


def scaling_table(url, prompts, clients, tokens) -> None:
    """The table of N concurrent vs sequential streams (one server)."""
    rows, seq = [], {}
    for n in clients:
        for mode in ("concurrent", "sequential"):
            if mode == "sequential" and n == 1:
                continue
            r = asyncio.run(measure(url, prompts, n, tokens, mode == "concurrent"))
            rows.append((n, mode, r))
            if mode == "sequential" or n == 1:
                seq[n] = r["tps"]
            print(f"  N={n} {mode}: {r}", file=sys.stderr, flush=True)
    single = seq.get(1, rows[0][2]["tps"])
    print("| clients | mode | failures | TTFT p50 ms | TTFT p95 ms | aggregate tokens/s | vs 1 stream "
          "| concurrent vs sequential | wall s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, mode, r in rows:
        vs_seq = f"{r['tps'] / seq[n]:.2f}x" if mode == "concurrent" and n in seq else ""
        print(f"| {n} | {mode} | {r['failures']} | {1000 * r['p50']:.0f} | {1000 * r['p95']:.0f} | {r['tps']:.0f} "
              f"| {r['tps'] / single:.2f}x | {vs_seq} | {r['wall']:.1f} |")


def targets_round(url, prompts, mixed, long_prompt, tokens) -> dict:
    """One round of the target measurements on one server."""
    single = asyncio.run(measure(url, prompts, 1, tokens, True))
    many = asyncio.run(measure(url, prompts, 16, tokens, True))
    burst = asyncio.run(measure(url, mixed, 16, 32, True))
    stall = asyncio.run(measure(url, prompts, 15, tokens, True, long_prompt=long_prompt))
    return {"single": single["tps"], "x16": many["tps"] / single["tps"], "burst_p95": burst["p95"],
            "gap": stall["gap"], "long_ttft": stall["long_ttft"],
            "failures": sum(r["failures"] for r in (single, many, burst, stall))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16, 32],
                    help="the scaling table's client counts (none: no table)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the server and the library (default: as `decoderlab serve` chooses)")
    ap.add_argument("--prefill-chunk", type=int, nargs="*", default=[],
                    help="serve with each of these prefill chunks too (nothing after the flag: off only)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the target measurements, alternating")
    ap.add_argument("--only-split", action="store_true",
                    help="only the scheduler alone: a step of 1 and of 16 rows, and its share in the model")
    ap.add_argument("--compile", action="store_true",
                    help="a server with the compiled decode step too (`decoderlab serve`'s default), chunking off, "
                         "measured against the library's compiled step")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        run_server(args.serve, args.threads, args.prefill_chunk[0] if args.prefill_chunk else None, args.compile)
        return
    import decoderlab as dl
    from decoderlab.devices import machine_line
    from decoderlab.threads import set_threads

    threads = set_threads(args.threads)  # the server chooses the same way, at about the same moment
    print(machine_line(threads))
    if args.only_split:
        model, tok = bench_model()
        for rows in (1, 16):
            ms, share = step_split(model, tok, [dl.read_corpus()[:16]], rows)
            print(f"{rows} row(s): {ms:.1f} ms a scheduler step, {share:.0%} in the model's decode step")
        return
    text = dl.read_corpus()
    lines = [ln for ln in text.splitlines() if len(ln) >= 16]
    prompts = [ln[:16] for ln in lines[:64]]
    long_lines = [ln for ln in text.splitlines() if len(ln) >= 56]
    mixed = [ln[: 8 + (7 * i) % 49] for i, ln in enumerate(long_lines[:16])]  # 8 .. 56 characters
    long_prompt = text[:240]  # a long prompt (240 tokens of the 256-token context) joining 15 running streams
    model, tok = bench_model()
    configs = [(None, False), *[(c, False) for c in args.prefill_chunk], *([(None, True)] if args.compile else [])]
    servers = [start_server(args.threads, c, comp) for c, comp in configs]
    try:
        for _, url in servers:  # warm-up: the batch cache grows (allocates) its slots once, as a running server's
            asyncio.run(measure(url, prompts, 32, 8, True))
        if args.clients:
            print(f"\n{args.tokens} tokens per client, prefill chunk off\n")
            scaling_table(servers[0][1], prompts, args.clients, args.tokens)
        rounds(args, dict(zip(configs, (url for _, url in servers))), model, tok, prompts, mixed, long_prompt)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=20)
    one_ms, one_share = step_split(model, tok, prompts, 1)
    many_ms, many_share = step_split(model, tok, prompts, 16)
    print(f"\nthe scheduler alone (no HTTP), 64 steps: 1 row {one_ms:.1f} ms a step ({one_share:.0%} in the model's "
          f"decode step), 16 rows {many_ms:.1f} ms ({many_share:.0%}): 16 rows give {16 * one_ms / many_ms:.2f}x the "
          f"tokens/s of one")
    print(f"structured output (a regex grammar's token mask every step): "
          f"{grammar_cost(model, tok, prompts[0], args.tokens):.2f}x the unconstrained time per token")


def rounds(args, urls: dict, model, tok, prompts, mixed, long_prompt) -> None:
    """``--repeats`` alternating rounds of the targets on every server (``urls``: (prefill chunk, compiled) ->
    url), with the burst's floor and the library's speed (eager, and compiled for a compiled server) between them;
    then the report."""
    results = {cfg: [] for cfg in urls}
    floors, libs = [], {False: [], True: []}
    compiled = None
    if any(comp for _, comp in urls):  # the library's own compiled step, for the compiled server's "vs the library"
        compiled, _ = bench_model()
        compiled.compile_decode()
    for rnd in range(args.repeats):
        floors.append(burst_floor(model, tok, mixed))
        libs[False].append(library_tps(model, tok, prompts[0], args.tokens))
        if compiled is not None:
            libs[True].append(library_tps(compiled, tok, prompts[0], args.tokens))
        for cfg, url in urls.items():
            results[cfg].append(targets_round(url, prompts, mixed, long_prompt, args.tokens))
            print(f"  round {rnd} {cfg}: {results[cfg][-1]}", file=sys.stderr, flush=True)
    report(results, statistics.median(floors), {k: statistics.median(v) for k, v in libs.items() if v}, args)


def report(results: dict, floor: float, lib: dict, args) -> None:
    """The targets' table: the median of each measurement over the rounds, per server (decode step, prefill
    chunk); ``lib``: the library's tokens/s, eager (False) and compiled (True)."""
    import os

    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in results.items()}
    libs = ", ".join(f"{'compiled' if k else 'eager'} {v:.0f}" for k, v in lib.items())
    print(f"\nmedians of {args.repeats} alternating rounds; {args.tokens} tokens per stream; the burst's compute floor "
          f"(its padded (16, 56) prefill + one 16-row decode step, in this process) {1000 * floor:.0f} ms; "
          f"library generate tokens/s: {libs}; load average after: %.1f %.1f %.1f\n" % os.getloadavg())
    print("| decode step | prefill chunk | 16 streams vs 1 | 16 streams tokens/s | burst of 16: TTFT p95 ms | vs its floor "
          "| one stream tokens/s | vs the library | long prompt joins 15 streams: their longest gap ms | its TTFT ms "
          "| failures |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (c, comp), m in med.items():
        print(f"| {'compiled' if comp else 'eager'} | {'off' if c is None else c} | {m['x16']:.2f}x | "
              f"{m['x16'] * m['single']:.0f} | {1000 * m['burst_p95']:.0f} | {m['burst_p95'] / floor:.2f}x | "
              f"{m['single']:.0f} | {m['single'] / lib[comp]:.2f}x | {1000 * m['gap']:.0f} | "
              f"{1000 * m['long_ttft']:.0f} | {m['failures']:.0f} |")


if __name__ == "__main__":
    main()
