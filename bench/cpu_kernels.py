"""decoderlab's CPU kernels (``decoderlab.kernels``) on SmolLM2-135M's products, one thread: our op against llama.cpp's
own CPU products on the same bytes (ggml), ``F.linear`` on the dequantized float32 weight, and a plain read of the
op's weight bytes (the memory floor).

Shapes (SmolLM2-135M: d_model 576, d_ff 1536, 9 query heads and 3 key/value heads of 64, vocabulary 49152): q and o
(576 x 576), k and v (192 x 576), gate and up (1536 x 576), down (576 x 1536), the output layer (49152 x 576; a
prompt wants its last row's logits only: not at prompt rows), each at ``--rows`` and ``--prompt-rows`` rows of
float32 activations (a batch's decode step, a prompt); and "step", one token's products with a distinct weight each
-- 30 layers of q, k, v, o, gate, up, down and the output layer (134M weights) -- as a decode step reads them, at
``--rows``: once as 211 calls, once as 121 (a layer's q, k, v in one ``block_linear_many`` / ``dense_linear_many``
call, its gate and up in another). A K-quant (256-weight blocks) fits only the 1536-wide down projection: the others
(576 wide) are left out of its single products, and its step holds what llama.cpp's quantizer writes there instead
(q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0), as a Q4_K_M file of SmolLM2 does.

Types: GGUF's q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k (``torch.ops.decoderlab.block_linear`` on
``kernels.pack``'s layout of random valid blocks: random bytes, float16 scales of about 1e-3) and bf16, f16, f32
(``torch.ops.decoderlab.dense_linear``). ggml: ``ggml_mul_mat`` in llama-cpp-python's ``libggml-cpu`` (the build
llama.cpp runs; without its repacked buffer types, as ``use_extra_bufts=False``), on a one-thread pool, the GGUF bytes
of the same blocks: it quantizes the activations to the type's vec_dot_type as ours do; left out when
llama-cpp-python is absent. ``F.linear``: the float32 weight (gguf.quants' dequantization of the same blocks for a
single product; for the step, random float32 weights of the same shapes -- its time does not depend on the values).
The read: the float32 sum of the op's weight bytes (denormals flushed), the rate one core streams them.

Every alternative of a row runs in turn, ``--repeats`` rounds (each call repeated to ~5 ms), medians; ratios:
ggml / ours and F.linear / ours (> 1: ours is faster), ours / read (1 = at the memory floor) of the medians, and
again of each alternative's least round (on a shared, loaded machine the least is the nearest to the uncontended
cost). The single products' weights sit in cache between calls (each is under 2 MB but the output layer's); the
step's 134M weights come from memory (or a large last-level cache), as in decoding.

    python bench/cpu_kernels.py [--types q4_k,bf16,...] [--rows 1,8,16] [--prompt-rows 128] [--repeats 5]
                            [--isa avx2] [--no-step] [--no-ggml]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from dataclasses import dataclass

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
DENSE_OF = {kernels.TYPES[k].number: v for k, v in DENSE.items()}
#: a layer's products that share an input, by their index in LAYER: q, k, v; o; gate, up; down
SHARED = ((0, 1, 2), (3,), (4, 5), (6,))


class GGML:
    """llama.cpp's own CPU products (the ``libggml-cpu`` that llama-cpp-python ships, as llama.cpp runs them without
    its repacked "extra" buffer types): ``ggml_mul_mat`` nodes on the same GGUF bytes, one graph per call, on a
    threadpool of one thread. Each node quantizes its activations to the weight's ``vec_dot_type`` (q8_0 / q8_1 /
    q8_K, bf16 for BF16, f16 for F16) and runs ggml's ``vec_dot`` per row, or llamafile's tinyBLAS where it takes the
    type and shape. ``GGML.load()`` is None when llama-cpp-python is absent."""

    class _Init(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    class _Plan(ctypes.Structure):
        _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                    ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                    ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]

    class _PoolParams(ctypes.Structure):
        _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                    ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]

    @classmethod
    def load(cls):
        try:
            import llama_cpp
        except ImportError:
            return None
        ggml = cls(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
        ggml.version = llama_cpp.__version__
        return ggml

    def __init__(self, lib: str):
        P, i64 = ctypes.c_void_p, ctypes.c_int64
        self.base = base = ctypes.CDLL(os.path.join(lib, "libggml-base.so"))
        self.cpu = cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"))
        for fn, args, res in ((base.ggml_init, [self._Init], P),
                              (base.ggml_new_tensor_2d, [P, ctypes.c_int, i64, i64], P),
                              (base.ggml_get_data, [P], P), (base.ggml_mul_mat, [P, P, P], P),
                              (base.ggml_new_graph, [P], P), (base.ggml_build_forward_expand, [P, P], None),
                              (base.ggml_free, [P], None), (base.ggml_tensor_overhead, [], ctypes.c_size_t),
                              (base.ggml_graph_overhead, [], ctypes.c_size_t),
                              (base.ggml_threadpool_params_default, [ctypes.c_int], self._PoolParams),
                              (cpu.ggml_threadpool_new, [ctypes.POINTER(self._PoolParams)], P),
                              (cpu.ggml_graph_plan, [P, ctypes.c_int, P], self._Plan),
                              (cpu.ggml_graph_compute, [P, ctypes.POINTER(self._Plan)], ctypes.c_int)):
            fn.argtypes, fn.restype = args, res
        cpu.ggml_cpu_init()
        params = base.ggml_threadpool_params_default(1)
        self.pool = cpu.ggml_threadpool_new(ctypes.byref(params))
        self.keep = []

    def products(self, weights: list[tuple[int, bytes, int, int]], xs: dict[int, torch.Tensor]):
        """A call running ``x @ W.T`` for each (GGML type number, the file's bytes as numpy, out, in) weight, x the
        float32 rows of ``xs[in]``: one graph of ggml_mul_mat nodes."""
        weights = [(n, np.ascontiguousarray(b).reshape(-1).view(np.uint8), o, i) for n, b, o, i in weights]
        base, size = self.base, sum(b.nbytes for _, b, _, _ in weights)
        size += sum(x.numel() * 4 for x in xs.values()) + sum(o * xs[i].shape[0] * 4 for _, _, o, i in weights)
        size += (3 * len(weights) + len(xs)) * base.ggml_tensor_overhead() + base.ggml_graph_overhead() + (1 << 20)
        ctx = base.ggml_init(self._Init(size, None, False))
        inputs = {}
        for inp, x in xs.items():
            inputs[inp] = base.ggml_new_tensor_2d(ctx, 0, inp, x.shape[0])
            ctypes.memmove(base.ggml_get_data(inputs[inp]), x.contiguous().data_ptr(), x.numel() * 4)
        graph = base.ggml_new_graph(ctx)
        for number, data, out, inp in weights:
            w = base.ggml_new_tensor_2d(ctx, number, inp, out)
            ctypes.memmove(base.ggml_get_data(w), data.ctypes.data, data.nbytes)
            base.ggml_build_forward_expand(graph, base.ggml_mul_mat(ctx, w, inputs[inp]))
        plan = self.cpu.ggml_graph_plan(graph, 1, self.pool)
        work = ctypes.create_string_buffer(plan.work_size + 64)
        plan.work_data = ctypes.cast(work, ctypes.c_void_p)
        self.keep.append((ctx, work, plan))
        compute, ref = self.cpu.ggml_graph_compute, ctypes.byref(plan)
        return lambda: compute(graph, ref)

    def free(self) -> None:
        """Free every graph's memory (its calls must not run again)."""
        for ctx, _, _ in self.keep:
            self.base.ggml_free(ctx)
        self.keep.clear()


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


@dataclass
class Weight:
    """One product's weight: our op's call on x, the bytes it reads (the packed weight, or the 16/32-bit weight
    itself), GGML's type number and the file's bytes (what ggml multiplies), and the float32 weight for F.linear
    (None unless asked)."""

    call: object
    buf: torch.Tensor
    number: int
    raw: object
    out: int
    inp: int
    f32: torch.Tensor | None
    dense: bool = False


def fused(weights: list[Weight]):
    """One call of the ``_many`` op for weights that share an input (a layer's q, k, v; its gate, up)."""
    if len(weights) == 1:
        return weights[0].call
    if weights[0].dense:
        op, ws = torch.ops.decoderlab.dense_linear_many.default, [w.buf.view(DENSE_OF[w.number]).reshape(w.out, w.inp)
                                                                  for w in weights]
        return lambda x: op(x, ws)
    op, ps = torch.ops.decoderlab.block_linear_many.default, [w.buf for w in weights]
    numbers, outs = [w.number for w in weights], [w.out for w in weights]
    return lambda x: op(x, ps, numbers, outs)


def weight(name: str, out: int, inp: int, rng, dequantize: bool) -> Weight:
    name = type_for(name, inp)
    number = kernels.TYPES[name].number
    if name in DENSE:
        w = torch.from_numpy(rng.standard_normal((out, inp), dtype=np.float32)).to(DENSE[name])
        data = w.view(torch.uint8).reshape(-1)
        return Weight(lambda x: torch.ops.decoderlab.dense_linear(x, w), data, number, data.numpy(), out, inp,
                      w.float() if dequantize else None, dense=True)
    raw = random_blocks(name, out, inp, rng)
    packed = kernels.pack(raw, name, (out, inp))
    f32 = None
    if dequantize:
        import gguf

        f32 = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name.upper()]))
    return Weight(lambda x: torch.ops.decoderlab.block_linear(x, packed, number, out), packed, number, raw, out, inp,
                  f32)


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


HEADER = ("| type | product | out x in | rows | ours µs | ggml µs | F.linear µs | read µs | ggml / ours | "
          "F.linear / ours | ours / read | least: ggml / ours | least: ours / read | ours GB/s (least) |\n"
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def row(label: str, name: str, shape: str, rows: int, t: dict, nbytes: int, ours: str = "ours") -> str:
    (us, us_min), (read, read_min) = t[ours], t["read"]
    cells = [f"{us * 1e6:.1f}"]
    cells += [f"{t[k][0] * 1e6:.1f}" if k in t else "-" for k in ("ggml", "F.linear")]
    cells += [f"{read * 1e6:.1f}"]
    cells += [f"{t[k][0] / us:.2f}" if k in t else "-" for k in ("ggml", "F.linear")]
    cells += [f"{us / read:.2f}", f"{t['ggml'][1] / us_min:.2f}" if "ggml" in t else "-", f"{us_min / read_min:.2f}",
              f"{nbytes / us_min / 1e9:.1f}"]
    return f"| {name} | {label} | {shape} | {rows} | " + " | ".join(cells) + " |"


def single_products(name: str, rows_list, repeats: int, rng, ggml) -> list[str]:
    lines = []
    for label, (out, inp) in PRODUCTS.items():
        if type_for(name, inp) != name:
            continue
        w = weight(name, out, inp, rng, dequantize=True)
        for rows in rows_list:
            if label == "output" and rows > 16:  # a prompt's logits: only the last row's are wanted
                continue
            x = torch.randn(rows, inp)
            fns = {"ours": lambda: w.call(x), "F.linear": lambda: F.linear(x, w.f32), "read": _read(w.buf)}
            if ggml is not None:
                fns["ggml"] = ggml.products([(w.number, w.raw, out, inp)], {inp: x})
            t = per_call(fns, repeats)
            lines.append(row(label, name, f"{out} x {inp}", rows, t, w.buf.numel()))
            if ggml is not None:
                ggml.free()
    return lines


def step_weights(rng) -> list[torch.Tensor]:
    """The step's float32 weights for F.linear: 30 layers' seven products and the output layer."""
    shapes = LAYER * N_LAYER + [PRODUCTS["output"]]
    return [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for s in shapes]


def step(name: str, rows_list, repeats: int, rng, f32s: list[torch.Tensor], ggml) -> list[str]:
    made = [weight(name, *w.shape, rng, dequantize=False) for w in f32s]
    reads = [_read(w.buf) for w in made]
    calls = []  # q/k/v and gate/up as one call each: 4 calls a layer, and the output layer's
    for i0 in range(0, N_LAYER * len(LAYER), len(LAYER)):
        for group in SHARED:
            ws = [made[i0 + j] for j in group]
            calls.append((fused(ws), ws[0].inp))
    calls.append((made[-1].call, made[-1].inp))
    lines = []
    for rows in rows_list:
        xs = {inp: torch.randn(rows, inp) for inp in (576, 1536)}
        fns = {"ours": lambda: [w.call(xs[w.inp]) for w in made],
               "ours fused": lambda: [c(xs[inp]) for c, inp in calls],
               "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in f32s],
               "read": lambda: [r() for r in reads]}
        if ggml is not None:
            fns["ggml"] = ggml.products([(w.number, w.raw, w.out, w.inp) for w in made], xs)
        t = per_call(fns, repeats)
        if ggml is not None:
            ggml.free()
        label = f"step ({FALLBACK[name]} where 576 wide)" if name in FALLBACK else "step"
        nbytes = sum(w.buf.numel() for w in made)
        lines.append(row(label, name, f"{len(f32s)} products", rows, t, nbytes))
        lines.append(row(f"{label}, {len(calls)} calls", name, "q/k/v, gate/up fused", rows, t, nbytes, "ours fused"))
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=TYPES)
    p.add_argument("--rows", default="1,8,16", help="rows of a decode step (single products and the step)")
    p.add_argument("--prompt-rows", default="128", help="rows of a prompt (single products only); '' for none")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isa", default=None, help="an instruction set (avx2, avx-vnni, avx512-vnni); default the best")
    p.add_argument("--no-step", action="store_true", help="leave out the whole step's products")
    p.add_argument("--no-ggml", action="store_true", help="leave out llama.cpp's products")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # random bytes read as floats hold denormals
    kernels.load()
    if args.isa:
        kernels.set_isa(args.isa)
    rows_list = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    ggml = None if args.no_ggml else GGML.load()
    print(machine_line(1))
    print(f"kernels: {kernels.isa()} (this CPU runs {', '.join(kernels.available_isas())}); ggml: "
          f"{'llama-cpp-python ' + ggml.version if ggml else 'absent'}\n")
    print(HEADER)
    f32s = None if args.no_step else step_weights(rng)
    for name in args.types.split(","):
        prompt = [int(r) for r in args.prompt_rows.split(",") if r]
        for line in single_products(name, rows_list + prompt, args.repeats, rng, ggml):
            print(line, flush=True)
        if f32s is not None:
            for line in step(name, rows_list, args.repeats, rng, f32s, ggml):
                print(line, flush=True)


if __name__ == "__main__":
    main()
