"""The glass box's cost: ``run_with_cache`` against a plain forward pass, and a patching sweep.

The shakespeare-char shape (6 layers, 6 heads, d_model 384, 65 tokens, T = 256), float32, eval mode, no
gradients, one intra-op thread, timed as the CPU time of the calling thread (``time.thread_time``): on a
shared machine the wall time of a pass swings 2x with the other jobs, the CPU time it takes much less.

- plain forward ``model(ids)`` (no hook point installed: the ``is None`` test per point is all it pays);
- ``run_with_cache`` with no filter (all 106 hook points kept; every layer runs the explicit
  attention kernel, which has the pattern) and with ``names_filter`` one layer (``blocks.3.*``);
- one KV-cache decode step (``model.decode``, 1 token after 128), the engine's hot path;
- a ``layer,head`` activation-patching sweep (``over="attn_head"``): 6 x 6 = 36 patched passes of 64
  tokens plus the clean run.

The three forward variants alternate in every round, so they see the same background load; the table gives
medians over the rounds and ratios, and the minor page faults of each pass: a cache keeps every activation
(about 500 MB at B = 8), and memory that the allocator has handed back to the kernel is faulted in afresh
on first touch (2-3 us a page on this VM). The last two columns repeat the measurement with glibc told to
keep freed memory (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``): what the recording itself costs. With ``--baseline DIR`` (a ``src`` directory of another checkout, e.g. the commit before
the hook points), the plain forward and the decode step are also timed there, in alternating subprocesses:
the price of the hook points when they are off.

Run: ``python bench/glassbox.py [--baseline /path/to/old/src]`` (a few minutes on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads sleep: a shared machine's other jobs run

SRC = Path(__file__).resolve().parents[1] / "src"
SHAPE = dict(n_layer=6, n_head=6, d_model=384, max_len=256, num_tokens=65)


def _model():
    import torch

    import decoderlab as dl

    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset("shakespeare-char", dropout=0.0, **SHAPE)).eval()


def _ms(fn, reps: int = 1) -> float:
    """CPU milliseconds of the calling thread per call (all of the work, with one intra-op thread)."""
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps * 1e3


def plain_only(rounds: int) -> dict:
    """Median plain-forward (B=1 and 8, T=256) and decode-step times of the decoderlab on sys.path."""
    import torch

    from decoderlab.attention import KVCache

    torch.set_num_threads(1)
    model = _model()
    out = {}
    with torch.no_grad():
        for b in (1, 8):
            ids = torch.randint(0, 65, (b, 256), generator=torch.Generator().manual_seed(b))
            model(ids)
            out[f"forward B={b}"] = statistics.median(_ms(lambda: model(ids)) for _ in range(rounds))
        cache = KVCache.for_model(model)
        model(torch.randint(0, 65, (1, 128)), cache=cache)
        tok = torch.tensor([[3]])

        def step():
            cache.length = 128
            model.decode(tok, 128, None, cache)
        step()
        out["decode step"] = statistics.median(_ms(step, 20) for _ in range(rounds))
    return out


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def cache_rounds(rounds: int) -> list[tuple]:
    """(what, B, T, median CPU ms, ratio to the plain forward, median minor page faults) rows."""
    import torch

    from decoderlab import glassbox as gb

    torch.set_num_threads(1)
    model = _model()
    rows = []
    for b in (1, 8):
        ids = torch.randint(0, 65, (b, 256), generator=torch.Generator().manual_seed(b))
        runs = {
            "plain forward": lambda: model(ids),
            "run_with_cache, no filter": lambda: gb.run_with_cache(model, ids),
            "run_with_cache, names_filter one layer": lambda: gb.run_with_cache(
                model, ids, names_filter=lambda n: n.startswith("blocks.3.")),
        }
        times = {k: [] for k in runs}
        faults = {k: [] for k in runs}
        with torch.no_grad():
            for fn in runs.values():
                fn()  # warm-up
            for _ in range(rounds):
                for name, fn in runs.items():
                    before = _faults()
                    times[name].append(_ms(fn))
                    faults[name].append(_faults() - before)
        base = statistics.median(times["plain forward"])
        for name, ts in times.items():
            rows.append((name, b, 256, statistics.median(ts), statistics.median(ts) / base,
                         statistics.median(faults[name])))
    return rows


#: glibc keeps freed memory instead of handing it back (then a new cache reuses mapped pages, no page faults)
KEEP_MEMORY = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}


def patch_sweep() -> tuple[float, tuple]:
    import torch

    from decoderlab import glassbox as gb

    torch.set_num_threads(1)
    model = _model()
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 65, (1, 64), generator=g)
    corrupt = clean.clone()
    corrupt[0, 20] = (corrupt[0, 20] + 1) % 65
    start, cpu = time.perf_counter(), time.thread_time()
    table = gb.activation_patching(model, clean, corrupt, gb.logit_difference(5, 6), over="attn_head",
                                   by="layer,head")
    return time.perf_counter() - start, time.thread_time() - cpu, tuple(table.shape)


def baseline_compare(baseline: str, rounds: int, pairs: int) -> dict[str, tuple[float, float]]:
    """{what: (before ms, after ms)}: medians over ``pairs`` alternating subprocess pairs."""
    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(pairs):
        got = []
        for src in (baseline, str(SRC)):
            env = {**os.environ, "PYTHONPATH": src}
            r = subprocess.run([sys.executable, __file__, "--plain-json", str(rounds)], env=env, capture_output=True,
                               text=True, check=True)
            got.append(json.loads(r.stdout.strip().splitlines()[-1]))
        for key in got[0]:
            results.setdefault(key, []).append((got[0][key], got[1][key]))
    return {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in results.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--baseline", help="a src/ directory of another checkout, for the plain forward before/after")
    p.add_argument("--plain-json", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cache-json", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain_json:
        print(json.dumps(plain_only(args.plain_json)))
        return 0
    sys.path.insert(0, str(SRC))
    if args.cache_json:
        print(json.dumps(cache_rounds(args.cache_json)))
        return 0
    print("| what | B | T | CPU ms (median) | vs plain forward | minor page faults | memory kept: CPU ms | kept: vs plain |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|")
    kept = subprocess.run([sys.executable, __file__, "--cache-json", str(args.rounds)], capture_output=True, text=True,
                          check=True, env={**os.environ, **KEEP_MEMORY, "PYTHONPATH": str(SRC)})
    for (name, b, t, ms, ratio, faults), (*_, ms_kept, ratio_kept, _) in zip(
            cache_rounds(args.rounds), json.loads(kept.stdout.strip().splitlines()[-1])):
        print(f"| {name} | {b} | {t} | {ms:.1f} | {ratio:.2f}x | {faults:,.0f} | {ms_kept:.1f} | {ratio_kept:.2f}x |")
    wall, cpu, shape = patch_sweep()
    print(f"\nlayer,head patching sweep (attn_head, {shape[0]} layers x {shape[1]} heads, 64 tokens): {wall:.2f} s wall, "
          f"{cpu:.2f} s CPU")
    if args.baseline:
        print("\n| hook points off: plain pass | before CPU ms | after CPU ms | after / before |\n|---|---:|---:|---:|")
        for name, (before, after) in baseline_compare(args.baseline, args.rounds, 4).items():
            print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
