"""Attention kernels: forward+backward time and peak memory of ``explicit`` vs ``sdpa`` at T = 256, 1024, 4096.

One ``MultiHeadAttention`` layer (d_model 384, 6 heads, causal, with its qkv and output projections), batch 1,
float32 on the CPU, 2 threads. Both kernels share the projections; only the attention kernel differs.

What is measured:

- time: median wall time of ``layer(x).backward(grad)`` over a few repetitions after one warm-up step; the two
  kernels' steps alternate in one process, so both see the same background load (read the ratio).
- peak memory, per (kernel, T) in a fresh subprocess so that one configuration's freed memory cannot hide the
  next one's: growth of the process's peak resident set size during one forward+backward step. Before the
  step, freed memory is handed back to the OS (``malloc_trim``) and the kernel's high-water mark is reset to
  the current RSS (``echo 5 > /proc/self/clear_refs``); afterwards ``VmHWM - VmRSS(before)`` is the most
  memory the step held at once (tensors, autograd buffers, allocator slack). Linux only.
- saved for backward: bytes of the distinct tensors autograd keeps for the backward pass (counted with
  ``torch.autograd.graph.saved_tensors_hooks``; the input and the weights, which exist anyway, are left out).

Expected: ``explicit`` materialises (6, T, T) similarity and percent matrices (96 MiB each in float32 at
T = 4096), so its memory grows ~T^2; ``sdpa``'s fused causal kernel keeps only (6, T) row statistics besides
its (T, d_model) inputs and output, and grows ~T.

Run: ``python bench/attention.py`` (about a minute on a quiet machine); prints one markdown table.

``python bench/attention.py --gqa-decode``: grouped-query attention's two ways to a kernel for one decode step
(one query per row over a KV cache of T_k keys, SmolLM2-135M's heads: 9 query heads, 3 key/value heads of 64),
each through ``F.scaled_dot_product_attention``: the keys and values repeated for each query head
(``repeat_interleave``, Hugging Face's ``repeat_kv``) or handed over as they are (``enable_gqa=True``); batch 1
unmasked and batch 8 with a padding mask, one thread, alternating, median microseconds per step.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine, spinning threads of a 2-thread
# torch process fight the other jobs (measured here: a 40 ms step took 250 ms). Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

D_MODEL, N_HEAD = 384, 6
TS = (256, 1024, 4096)
KERNELS = ("explicit", "sdpa")
REPS = {256: 15, 1024: 7, 4096: 3}

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _build(kernel: str, t: int):
    import torch

    from decoderlab.attention import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEAD, kernel=kernel, out_proj=True)
    x = torch.randn(1, t, D_MODEL, requires_grad=True)
    grad = torch.randn(1, t, D_MODEL)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(grad)

    return layer, x, step


def memory_worker(kernel: str, t: int) -> dict:
    """Peak RSS growth of one forward+backward step and the bytes saved for backward (fresh process)."""
    import torch

    torch.set_num_threads(2)
    layer, x, step = _build(kernel, t)

    # bytes saved for backward (distinct storages, without the input and the weights)
    baseline_ptrs = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        s = tensor.untyped_storage()
        if s.data_ptr() not in baseline_ptrs:
            saved[s.data_ptr()] = s.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    saved_bytes = sum(saved.values())
    del out

    # peak resident memory of one forward+backward step, above what the process holds before it
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    rss_before = _status_kib("VmRSS")
    step()
    peak_kib = _status_kib("VmHWM") - rss_before
    return dict(kernel=kernel, T=t, peak_mib=peak_kib / 1024, saved_mib=saved_bytes / 2**20)


def run_memory(kernel: str, t: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--memory", kernel, str(t)], capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker {kernel} T={t} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_kernels(t: int) -> dict[str, float]:
    """Median forward+backward seconds per kernel; the kernels' steps alternate so both see the same load."""
    steps = {k: _build(k, t)[2] for k in KERNELS}
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in KERNELS}
    for _ in range(REPS[t]):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    import torch

    torch.set_num_threads(2)
    started = time.perf_counter()
    results = {(k, t): run_memory(k, t) for t in TS for k in KERNELS}
    for t in TS:
        for k, seconds in time_kernels(t).items():
            results[(k, t)]["ms"] = 1e3 * seconds
    print(f"MultiHeadAttention d_model={D_MODEL} n_head={N_HEAD} batch 1, causal, float32 CPU, "
          f"torch {torch.__version__}, 2 threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"forward+backward; time = median of "
          f"{'/'.join(str(REPS[t]) for t in TS)} repetitions at T={'/'.join(map(str, TS))}")
    print()
    print("| T | explicit ms | sdpa ms | time explicit/sdpa | explicit peak MiB | sdpa peak MiB "
          "| peak explicit/sdpa | explicit saved MiB | sdpa saved MiB | saved explicit/sdpa |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in TS:
        e, s = results[("explicit", t)], results[("sdpa", t)]
        print(f"| {t} | {e['ms']:.1f} | {s['ms']:.1f} | {e['ms'] / s['ms']:.2f} "
              f"| {e['peak_mib']:.1f} | {s['peak_mib']:.1f} | {e['peak_mib'] / max(s['peak_mib'], 1e-9):.1f} "
              f"| {e['saved_mib']:.1f} | {s['saved_mib']:.1f} | {e['saved_mib'] / max(s['saved_mib'], 1e-9):.1f} |")
    print()
    for k in KERNELS:
        lo, hi = results[(k, TS[0])], results[(k, TS[-1])]
        print(f"{k}: T x{TS[-1] // TS[0]} -> peak memory x{hi['peak_mib'] / max(lo['peak_mib'], 1e-9):.1f}, "
              f"saved for backward x{hi['saved_mib'] / max(lo['saved_mib'], 1e-9):.1f}, "
              f"time x{hi['ms'] / lo['ms']:.1f}")
    print(f"(total {time.perf_counter() - started:.0f} s)")


def gqa_decode(reps: int = 200) -> None:
    """The ``--gqa-decode`` table (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    h, kv, dh = 9, 3, 64
    g = h // kv
    ways = {
        "repeat_interleave": lambda q, k, v, m: F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), attn_mask=m),
        "enable_gqa": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
    }
    print(f"one decode step's attention, {h} query heads / {kv} key-value heads of {dh}, float32 CPU, 1 thread, "
          f"torch {torch.__version__}, median of {reps} alternating calls")
    print()
    print("| batch | T_k | repeat_interleave us | enable_gqa us | enable_gqa / repeat | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in (1, 8):
        for t_k in (128, 512, 2048):
            q, k, v = torch.randn(b, h, 1, dh), torch.randn(b, kv, t_k, dh), torch.randn(b, kv, t_k, dh)
            mask = None if b == 1 else torch.rand(b, 1, 1, t_k) > 0.1  # True = attend
            outs = {name: fn(q, k, v, mask) for name, fn in ways.items()}
            times = {name: [] for name in ways}
            for _ in range(reps):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    fn(q, k, v, mask)
                    times[name].append(time.perf_counter() - t0)
            a, e = (1e6 * statistics.median(times[n]) for n in ways)
            diff = float((outs["repeat_interleave"] - outs["enable_gqa"]).abs().max())
            print(f"| {b} | {t_k} | {a:.1f} | {e:.1f} | {e / a:.2f} | {diff:.1e} |")
    print("load average after: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--gqa-decode":
        gqa_decode()
    elif len(sys.argv) == 4 and sys.argv[1] == "--memory":
        print(json.dumps(memory_worker(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
