"""Serving throughput: N concurrent streaming clients against a local `decoderlab` server, and the same N
requests one after another.

The server runs in a subprocess (so the clients' event loop does not share the server's interpreter) with the
`shakespeare-char` shape (6 layers, 6 heads, d_model 384, context 256; random init: speed does not depend on
the weights) and torch.set_num_threads(--threads, default 1). <EOS> is not a stop token here, so every client gets exactly
128 tokens. Each client streams one /v1/completions request (a 16-character line of tinyshakespeare as the
prompt, temperature 0.8, its own seed) with stream_options.include_usage.

Reported per N: failures (non-200, missing [DONE], or the wrong number of tokens), time to first token
(first non-empty delta) p50/p95, and aggregate tokens/s = all completion tokens / wall time. The ratio
column is aggregate tokens/s over the single stream's. The earlier target: at 16 clients >= 4x, 0 failures.

Then three more measurements (the targets of the server's sampling/structured-output/prefill issue):

* a burst of 16 requests with prompts of different lengths (8 .. 56 characters) arriving together: TTFT p95
  against a lone request's (target <= 3x; newcomers are prefilled together in one padded pass);
* the library's own decode speed (``decoderlab.generate``, 128 tokens, same shape and threads, in this
  process) against the single served stream (target >= 0.85x);
* structured output's cost per token: ``generate`` with a regex grammar (every step's token mask from
  llguidance) against the same call without (target <= 1.3x).

Usage: python bench/serve.py [--clients 1 4 16 32] [--tokens 128]
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


def run_server(port: int, threads: int) -> None:
    import torch

    import decoderlab as dl
    from decoderlab.serve import Limits, create_app

    import uvicorn

    torch.set_num_threads(threads)
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
    app = create_app(model, tok, model_id="shakespeare-char", template=None,
                     limits=Limits(max_batch=64, max_queue=128))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def one(client, url, prompt, seed, tokens):
    body = {"model": "shakespeare-char", "prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, done, got = None, False, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    got = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    if c.get("text") and ttft is None:
                        ttft = time.perf_counter() - t0
    except Exception:  # noqa: BLE001 -- a failure is counted, not raised
        return None, 0
    return (ttft if done and got == tokens else None), got


def library_speeds(tokens: int, threads: int) -> tuple[float, float]:
    """(tokens/s of ``generate`` at the bench shape, the per-token time with a grammar over the time without)."""
    import torch

    import decoderlab as dl
    from decoderlab.generation import Grammar

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    text = dl.read_corpus()

    class NoStopCharTokenizer(dl.CharTokenizer):
        @property
        def eos_id(self):
            return None

        @property
        def end_of_text_ids(self):
            return ()

    tok = NoStopCharTokenizer(set(text))
    model = dl.DecoderOnlyTransformer(dl.preset("shakespeare-char", num_tokens=tok.vocab_size)).eval()
    prompt = tok.encode(text[:16])
    grammar = Grammar.regex("[A-Za-z ,.;:!?'\\n-]+")  # never complete: all the tokens are generated

    def timed(**kw) -> float:
        best = float("inf")
        for seed in range(3):
            t0 = time.perf_counter()
            out = dl.generate(model, prompt, tokens, temperature=0.8, seed=seed, tokenizer=tok, **kw)
            best = min(best, time.perf_counter() - t0)
            assert len(out) == tokens
        return best

    timed()  # warm-up
    plain, constrained = timed(), timed(grammar=grammar)
    return tokens / plain, constrained / plain


async def measure(url, prompts, n, tokens, concurrent: bool):
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        if concurrent:
            res = await asyncio.gather(*(one(client, url, prompts[i % len(prompts)], i, tokens) for i in range(n)))
        else:
            res = [await one(client, url, prompts[i % len(prompts)], i, tokens) for i in range(n)]
        wall = time.perf_counter() - t0
    ttfts = [t for t, _ in res if t is not None]
    failures = sum(1 for t, _ in res if t is None)
    total = sum(g for _, g in res)
    q = sorted(ttfts)
    p50 = statistics.median(q) if q else float("nan")
    p95 = q[min(len(q) - 1, int(round(0.95 * (len(q) - 1))))] if q else float("nan")
    return {"failures": failures, "p50": p50, "p95": p95, "tps": total / wall, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server (default 1)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        run_server(args.serve, args.threads)
        return
    import httpx

    import decoderlab as dl

    lines = [ln for ln in dl.read_corpus().splitlines() if len(ln) >= 16]
    prompts = [ln[:16] for ln in lines[:64]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--threads", str(args.threads)])
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                if time.time() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.3)
        # warm-up at the largest N: the batch cache grows (allocates) its slots once, as a running server has
        asyncio.run(measure(url, prompts, max(args.clients), 8, True))
        rows = []
        single = None
        for n in args.clients:
            for mode in ("concurrent", "sequential"):
                if mode == "sequential" and n == 1:
                    continue
                r = asyncio.run(measure(url, prompts, n, args.tokens, mode == "concurrent"))
                if n == 1:
                    single = r["tps"]
                rows.append((n, mode, r))
                print(f"  N={n} {mode}: {r}", file=sys.stderr, flush=True)
        print(f"\n{args.tokens} tokens per client, shakespeare-char shape (random init), server torch threads = {args.threads}\n")
        seq = {n: r["tps"] for n, mode, r in rows if mode == "sequential"}
        seq[1] = single
        print("| clients | mode | failures | TTFT p50 ms | TTFT p95 ms | aggregate tokens/s | vs 1 stream "
              "| concurrent vs sequential | wall s |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n, mode, r in rows:
            vs_seq = f"{r['tps'] / seq[n]:.2f}x" if mode == "concurrent" and n in seq else ""
            print(f"| {n} | {mode} | {r['failures']} | {1000 * r['p50']:.0f} | {1000 * r['p95']:.0f} | {r['tps']:.0f} "
                  f"| {r['tps'] / single:.2f}x | {vs_seq} | {r['wall']:.1f} |")
        at16 = [r for n, mode, r in rows if n == 16 and mode == "concurrent"]
        if at16:
            print(f"\nat 16 clients: {at16[0]['tps'] / single:.2f}x a single stream "
                  f"({at16[0]['tps'] / seq.get(16, single):.2f}x the same 16 requests one after another), "
                  f"{at16[0]['failures']} failures")
        long_lines = [ln for ln in dl.read_corpus().splitlines() if len(ln) >= 56]
        mixed = [ln[: 8 + (7 * i) % 49] for i, ln in enumerate(long_lines[:16])]  # 8 .. 56 characters
        alone = asyncio.run(measure(url, [max(mixed, key=len)], 1, args.tokens, True))  # the longest, alone
        burst = asyncio.run(measure(url, mixed, 16, args.tokens, True))
        print(f"\nburst of 16, prompts of 8 .. 56 characters: TTFT p50 {1000 * burst['p50']:.0f} ms, p95 "
              f"{1000 * burst['p95']:.0f} ms, a lone request's {1000 * alone['p50']:.0f} ms: p95 "
              f"{burst['p95'] / alone['p50']:.2f}x alone; {burst['failures']} failures")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    lib_tps, cost = library_speeds(args.tokens, args.threads)
    print(f"library decode (generate, {args.tokens} tokens): {lib_tps:.0f} tokens/s; the single served stream "
          f"{single:.0f} tokens/s = {single / lib_tps:.2f}x the library's")
    print(f"structured output (a regex grammar's token mask every step): {cost:.2f}x the unconstrained time per "
          f"token")
    return


if __name__ == "__main__":
    main()
