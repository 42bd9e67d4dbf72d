"""decoderlab's CPU kernels (``decoderlab.kernels``) on SmolLM2-135M's products, one thread: our op against
``F.linear`` on the dequantized float32 weight and against a plain read of the op's weight bytes (the memory floor).

Shapes (SmolLM2-135M: d_model 576, d_ff 1536, 9 query heads and 3 key/value heads of 64, vocabulary 49152): q and o
(576 x 576), k and v (192 x 576), gate and up (1536 x 576), down (576 x 1536), the output layer (49152 x 576); and
"step", one token's products with a distinct weight each -- 30 layers of q, k, v, o, gate, up, down and the output
layer (134M weights) -- as a decode step reads them. Each at 1, 8 and 16 rows of float32 activations. A K-quant
(256-weight blocks) fits only the 1536-wide down projection: the others (576 wide) are left out of its single
products, and its step holds what llama.cpp's quantizer writes there instead (q4_k -> q5_0, q5_k -> q5_1, q6_k ->
q8_0), as a Q4_K_M file of SmolLM2 does.

Types: GGUF's q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k (``torch.ops.decoderlab.block_linear`` on ``kernels.pack``'s
layout of random valid blocks: random bytes, float16 scales of about 1e-3) and bf16, f16, f32
(``torch.ops.decoderlab.dense_linear``). ``F.linear``: the float32 weight (gguf.quants' dequantization of the same
blocks for a single product; for the step, random float32 weights of the same shapes -- its time does not depend on
the values). The read: the float32 sum of the op's weight bytes (denormals flushed), the rate one core streams them.

Every alternative of a row runs in turn, ``--repeats`` rounds (each call repeated to ~5 ms), medians; ratios:
F.linear / ours (> 1: ours is faster) and ours / read (1 = at the memory floor) of the medians, and again of each
alternative's least round (on a shared, loaded machine the least is the nearest to the uncontended cost). The single products' weights sit
in cache between calls (each is under 2 MB but the output layer's); the step's 134M weights come from memory (or a
large last-level cache), as in decoding.

    python bench/kernels.py [--types q4_k,bf16,...] [--rows 1,8,16] [--repeats 5] [--isa avx2] [--no-step]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from decoderlab import kernels
from decoderlab.devices import machine_line

PRODUCTS = {"q, o": (576, 576), "k, v": (192, 576), "gate, up": (1536, 576), "down": (576, 1536),
            "output": (49152, 576)}
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
N_LAYER = 30
TYPES = "q8_0,q4_0,q4_1,q5_0,q5_1,q4_k,q5_k,q6_k,bf16,f16,f32"
#: the type llama.cpp's quantizer writes instead of a K-quant for a matrix whose width is no multiple of 256
#: (``llama-quant.cpp``): SmolLM2's 576-wide matrices in a K-quant file
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
DENSE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def random_blocks(name: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of valid random blocks: random quants and scale bytes, float16 scales of about 1e-3."""
    t = kernels.TYPES[name]
    raw = rng.integers(0, 256, size=(out, inp // t.block, t.bytes), dtype=np.uint8)
    starts = {"q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}.get(name, (0,))
    for at in starts:
        raw[..., at:at + 2] = (rng.uniform(0.5, 1.5, raw.shape[:2]) * 1e-3).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def type_for(name: str, inp: int) -> str:
    """``name``, or llama.cpp's fallback where a K-quant's 256-weight blocks do not fit the width."""
    return FALLBACK[name] if name in FALLBACK and inp % 256 else name


def weight(name: str, out: int, inp: int, rng, dequantize: bool):
    """(our op's call on x, the bytes it reads, the float32 weight for F.linear or None)."""
    name = type_for(name, inp)
    if name in DENSE:
        w = torch.from_numpy(rng.standard_normal((out, inp), dtype=np.float32)).to(DENSE[name])
        return (lambda x: torch.ops.decoderlab.dense_linear(x, w)), w.view(torch.uint8).reshape(-1), \
            (w.float() if dequantize else None)
    raw = random_blocks(name, out, inp, rng)
    packed = kernels.pack(raw, name, (out, inp))
    number = kernels.TYPES[name].number
    f32 = None
    if dequantize:
        import gguf

        f32 = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name.upper()]))
    return (lambda x: torch.ops.decoderlab.block_linear(x, packed, number, out)), packed, f32


def per_call(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median, least) seconds per call of each function, run in turn (the order rotating) for ``repeats`` rounds,
    each call repeated until a round of it takes ~5 ms."""
    counts = {}
    for name, fn in fns.items():
        fn()
        t = time.perf_counter()
        fn()
        counts[name] = max(1, int(0.005 / max(time.perf_counter() - t, 1e-7)))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            for _ in range(counts[name]):
                fns[name]()
            times[name].append((time.perf_counter() - t) / counts[name])
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def _read(buf: torch.Tensor):
    """A plain read of the bytes: their float32 sum, torch's fastest reduction here (the bytes' denormals flushed,
    ``main``'s ``set_flush_denormal``, so that no value takes a slow path)."""
    floats = buf.view(torch.float32)
    return lambda: floats.sum()


def row(label: str, name: str, shape: str, rows: int, t: dict, nbytes: int) -> str:
    (ours, ours_min), (lin, lin_min), (read, read_min) = t["ours"], t["F.linear"], t["read"]
    return (f"| {name} | {label} | {shape} | {rows} | {ours * 1e6:.1f} | {lin * 1e6:.1f} | {read * 1e6:.1f} | "
            f"{lin / ours:.2f} | {ours / read:.2f} | {lin_min / ours_min:.2f} | {ours_min / read_min:.2f} | "
            f"{nbytes / ours_min / 1e9:.1f} |")


def single_products(name: str, rows_list, repeats: int, rng) -> list[str]:
    lines = []
    for label, (out, inp) in PRODUCTS.items():
        if type_for(name, inp) != name:
            continue
        ours, buf, f32 = weight(name, out, inp, rng, dequantize=True)
        for rows in rows_list:
            x = torch.randn(rows, inp)
            t = per_call({"ours": lambda: ours(x), "F.linear": lambda: F.linear(x, f32), "read": _read(buf)},
                         repeats)
            lines.append(row(label, name, f"{out} x {inp}", rows, t, buf.numel()))
    return lines


def step_weights(rng) -> list[torch.Tensor]:
    """The step's float32 weights for F.linear: 30 layers' seven products and the output layer."""
    shapes = LAYER * N_LAYER + [PRODUCTS["output"]]
    return [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for s in shapes]


def step(name: str, rows_list, repeats: int, rng, f32s: list[torch.Tensor]) -> list[str]:
    made = [weight(name, *w.shape, rng, dequantize=False) for w in f32s]
    ours_fns, bufs = [m[0] for m in made], [m[1] for m in made]
    reads = [_read(b) for b in bufs]
    lines = []
    for rows in rows_list:
        xs = {inp: torch.randn(rows, inp) for inp in (576, 1536)}
        fns = {"ours": lambda: [f(xs[w.shape[1]]) for f, w in zip(ours_fns, f32s)],
               "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in f32s],
               "read": lambda: [r() for r in reads]}
        t = per_call(fns, repeats)
        label = f"step ({FALLBACK[name]} where 576 wide)" if name in FALLBACK else "step"
        lines.append(row(label, name, f"{len(f32s)} products", rows, t, sum(b.numel() for b in bufs)))
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=TYPES)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isa", default=None, help="an instruction set (avx2, avx-vnni, avx512-vnni); default the best")
    p.add_argument("--no-step", action="store_true", help="leave out the whole step's products")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # random bytes read as floats hold denormals
    kernels.load()
    if args.isa:
        kernels.set_isa(args.isa)
    rows_list = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(machine_line(1))
    print(f"kernels: {kernels.isa()} (this CPU runs {', '.join(kernels.available_isas())})\n")
    print("| type | product | out x in | rows | ours µs | F.linear µs | read µs | F.linear / ours | ours / read "
          "| least: F.linear / ours | least: ours / read | ours GB/s (least) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    f32s = None if args.no_step else step_weights(rng)
    for name in args.types.split(","):
        for line in single_products(name, rows_list, args.repeats, rng):
            print(line, flush=True)
        if f32s is not None:
            for line in step(name, rows_list, args.repeats, rng, f32s):
                print(line, flush=True)


if __name__ == "__main__":
    main()
