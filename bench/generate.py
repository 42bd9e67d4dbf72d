"""Decode speed: decoderlab's KV-cache generation vs the no-cache loop vs Hugging Face ``generate``.

The ``shakespeare-char`` preset shape (6 layers, 6 heads, d_model 384, context 256, vocabulary 65) with random
weights, 255 new tokens from a 1-token prompt (filling the context exactly), greedy, batch 1 and batch 8:

    (a) ``decoderlab.generate`` / ``generate_batch`` with the KV cache,
    (b) the same with ``use_cache=False`` (the lesson's loop: the whole sequence through the model per token),
    (c) ``transformers.GPT2LMHeadModel.generate`` with the same weights (converted with ``decoderlab.hf.to_hf``),
        with its own KV cache.

All in one run; decode tokens/second = new tokens (batch x 255) / wall seconds of the whole call, median of
the repeats. Prints one table with the ratios, and whether the three produced the same tokens.

Then the compile table (``--compile-table``, or alone with ``--only-compile``): batch-1 greedy decode at the same
shape, eager (``model.decode``), compiled (``model.compile_decode()``: Inductor through its C++ wrapper, one graph
over the static KV cache; its compile time apart) and ahead of time (``compile_decode(mode="aot")``: torch.export
+ AOTInductor, a .pt2 package written to a temporary folder; its compile time apart, and the seconds a new process
takes to load it), alternating, against the floor (``--compile-batches 1,8``: one table per batch size, B rows of
one-token prompts decoded together with ``generate_batch``, the floor's products on B rows): the same weight products (every ``nn.Linear`` of the
model, the output layer included, on one token's activations) run alone in the same process, 255 times. The
ratio decode / floor says how much of a token's time is anything but the weights.

Then the inference-dtype table (``load_checkpoint(..., dtype=...)``, ``--dtype``): a shakespeare-char-shaped
model is trained here (``train_lm`` on the embedded tinyshakespeare, ``--train-steps`` steps of batch
``--train-batch``; or pass ``--checkpoint``), and in each of float32, bfloat16, float16 and GGUF's blocks q8_0,
q4_0, q4_1 (``decoderlab.quant``; decoded eagerly here, see bench/llamacpp.py for their compiled step) it gets: batch-1 decode tokens/s (255 new tokens, greedy, the variants and Hugging Face ``generate`` in
float32 with the same weights alternating within each repeat; median), the full validation loss
(``evaluate_lm`` over all non-overlapping windows of the last 10%) and its cost against float32 in nats, and
greedy agreement with float32 (share of identical tokens over 255 new tokens from each of 4 one-token prompts
taken from the validation text).

Then (alone, ``--only-batch-step``) the batch-step table: one eager decode step of B = 1 .. 32 rows over a KV cache of
128 tokens per row, against one row's step (a step reads the weights once whatever B).

Then (alone, ``--only-linears``) the linears table: the shape's 24 weight products, each after a layer norm, on B
rows in float32, bfloat16 and GGUF's blocks q8_0 / q4_0 / q4_1 (``--linear-dtypes``) -- eagerly, compiled by
Inductor through ``decoderlab.matvec.linear`` (a reduction up to ``MAX_ROWS`` rows, ``MAX_ROWS_HALF`` in bfloat16,
``F.linear`` above; over blocks at any row count), and the physical floor, a plain read of the float32 weight bytes
(``weight.sum()``): why the compiled step decodes faster, where the reduction stops paying, and whether a dtype's
products are bound by the bytes they read or by their arithmetic (GB/s against the floor's).

With ``--shape smollm2-135m``, instead: a Llama-family model of SmolLM2-135M's shape (``preset("smollm2-135m")``,
random weights) decoding batch 1 greedy -- eager, compiled (``--compiled 2``) and ahead of time -- against
``transformers``' ``LlamaForCausalLM.generate`` on the same weights, alternating, each variant's tokens checked
against eager's; then the seconds of ``verify`` (the float64 recomputation of the whole pass) on that model.

    python bench/generate.py [--threads N] [--repeats R] [--batches 1,8] [--skip-speed] [--skip-dtypes]
                             [--only-compile] [--compile-repeats 5] [--compile-batches 1,8]
                             [--only-batch-step] [--step-batches 1,4,16] [--only-linears] [--linear-rows 1,8]
                             [--linear-dtypes float32,bfloat16,q8_0,q4_0,q4_1]
                             [--checkpoint DIR] [--train-steps 200] [--train-batch 8] [--val-windows N]
    python bench/generate.py --shape smollm2-135m [--new-tokens 255] [--repeats 3] [--compiled 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

import decoderlab as dl
from decoderlab.devices import machine_line
from decoderlab.dtypes import DTYPES
from decoderlab.generation import generate, generate_batch
from decoderlab.hf import to_hf

NEW_TOKENS = 255


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on a machine shared with other jobs, a second thread "
                         "makes every parallel region wait for the OS scheduler)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of (a) and (c); (b) runs once")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--skip-speed", action="store_true", help="only the dtype table")
    ap.add_argument("--skip-dtypes", action="store_true", help="only the float32 speed table")
    ap.add_argument("--only-compile", action="store_true", help="only the compile table (eager, compiled, floor)")
    ap.add_argument("--only-batch-step", action="store_true",
                    help="only the batch-step table: one decode step of B rows against one row's")
    ap.add_argument("--only-linears", action="store_true",
                    help="only the linears table: a decode step's weight products on B rows, F.linear against "
                         "the compiled reduction (decoderlab.matvec) and a plain read of the weights")
    ap.add_argument("--linear-rows", default="1,2,4,8,16", help="rows of the linears table")
    ap.add_argument("--linear-dtypes", default="float32,bfloat16,q8_0,q4_0,q4_1", help="dtypes of the linears table")
    ap.add_argument("--step-batches", default="1,2,4,8,16,32", help="batch sizes of the batch-step table")
    ap.add_argument("--compile-repeats", type=int, default=5, help="alternating runs in the compile table")
    ap.add_argument("--compile-batches", default="1", help="rows of the compile table's decode, one table each")
    ap.add_argument("--checkpoint", default=None,
                    help="dtype table: a shakespeare-char-shaped checkpoint directory; trained there first when it "
                         "does not exist yet (default: train one in a temporary directory)")
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-precision", default="auto", choices=("auto", "32", "bf16-mixed"),
                    help="auto: bf16-mixed where the CPU has bfloat16 instructions (avx512_bf16/amx), else 32")
    ap.add_argument("--dtype-repeats", type=int, default=5, help="decode timings per dtype in the dtype table")
    ap.add_argument("--val-windows", type=int, default=None,
                    help="cap on validation windows (default: all, the full validation loss)")
    ap.add_argument("--shape", default="shakespeare-char", choices=("shakespeare-char", "smollm2-135m"),
                    help="shakespeare-char: the tables above; smollm2-135m: its own table, a Llama-family model "
                         "against transformers' LlamaForCausalLM (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="smollm2-135m: new tokens per decode")
    ap.add_argument("--compiled", type=int, default=2, choices=(0, 1, 2),
                    help="smollm2-135m: 2 = compiled and ahead of time beside eager, 1 = ahead of time only, 0 = none")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    if args.shape == "smollm2-135m":
        smollm2_table(args)
        return
    if args.only_compile:
        compile_table(args)
        return
    if args.only_batch_step:
        batch_step_table(args)
        return
    if args.only_linears:
        linears_table(args)
        return
    if not args.skip_speed:
        speed_table(args)
    compile_table(args)
    if not args.skip_dtypes:
        dtype_table(args)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()



def speed_table(args) -> None:
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer("shakespeare-char").eval()
    hf = to_hf(model).eval()
    cfg = model.config
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [[int(t)] for t in torch.randint(cfg.num_tokens, (b,), generator=torch.Generator().manual_seed(b))]

        def ours(use_cache=True):
            if b == 1:
                return [generate(model, prompts[0], NEW_TOKENS, temperature=0, use_cache=use_cache)]
            return generate_batch(model, prompts, NEW_TOKENS, temperature=0, use_cache=use_cache)

        def theirs():
            ids = torch.tensor(prompts)
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            return out[:, 1:].tolist()

        ours(), theirs()  # warm up
        t_a, t_c = [], []
        for _ in range(args.repeats):  # interleaved, so that load from other jobs hits both alike
            dt, tok_a = timed(ours)
            t_a.append(dt)
            dt, tok_c = timed(theirs)
            t_c.append(dt)
        t_b, tok_b = timed(lambda: ours(use_cache=False))
        n = b * NEW_TOKENS
        a, bb, c = n / statistics.median(t_a), n / t_b, n / statistics.median(t_c)
        same = "yes" if tok_a == tok_b == tok_c else ("a=b" if tok_a == tok_b else "no")
        rows.append((b, "(a) decoderlab, KV cache", statistics.median(t_a), a, a / c, a / bb, same))
        rows.append((b, "(b) decoderlab, no cache (lesson loop)", t_b, bb, bb / c, 1.0, ""))
        rows.append((b, "(c) HF GPT2LMHeadModel.generate", statistics.median(t_c), c, 1.0, c / bb, ""))
    # the per-token overhead (Python, dispatch, cache bookkeeping) alone: the same depth at d_model 48, where
    # the weights are tiny and compute no longer hides it
    torch.manual_seed(0)
    small = dl.DecoderOnlyTransformer("shakespeare-char", d_model=48).eval()
    small_hf = to_hf(small).eval()
    one = torch.tensor([[1]])

    def small_ours():
        return generate(small, [1], NEW_TOKENS, temperature=0)

    def small_theirs():
        with torch.inference_mode():
            return small_hf.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    small_ours(), small_theirs()
    t_a, t_c = [], []
    for _ in range(args.repeats):
        t_a.append(timed(small_ours)[0])
        t_c.append(timed(small_theirs)[0])
    a, c = NEW_TOKENS / statistics.median(t_a), NEW_TOKENS / statistics.median(t_c)
    overhead = [(1, "(a) decoderlab, KV cache, d_model 48", statistics.median(t_a), a, a / c),
                (1, "(c) HF generate, d_model 48", statistics.median(t_c), c, 1.0)]

    print(f"decode, shakespeare-char shape (6 layers, 6 heads, d_model 384, context 256), {NEW_TOKENS} new tokens "
          f"from a 1-token prompt, greedy, float32, torch {torch.__version__}, {args.threads} threads")
    print("| batch | method | s | decode tokens/s | vs (c) HF | vs (b) no cache | same tokens |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for b, name, s, tps, vs_c, vs_b, same in rows:
        print(f"| {b} | {name} | {s:.2f} | {tps:,.0f} | {vs_c:.2f}x | {vs_b:.2f}x | {same} |")
    for b, name, s, tps, vs_c in overhead:
        print(f"| {b} | {name} | {s:.2f} | {tps:,.0f} | {vs_c:.2f}x |  |  |")


# ---------------------------------------------------------------------------------------------------------
# The compile table: eager and compiled batch-1 decode against the floor
# ---------------------------------------------------------------------------------------------------------


def weight_floor(model, n_tokens: int, batch: int = 1) -> float:
    """Seconds for ``n_tokens`` steps' weight products alone: every ``nn.Linear`` of ``model`` in order (the
    blocks' projections and MLPs, the output layer) on one token per row, (batch, 1, in_features) activations."""
    import torch.nn as nn
    import torch.nn.functional as F

    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(batch, 1, w.size(1)) for w, _ in linears]
    with torch.inference_mode():
        for (w, b), x in zip(linears, inputs):  # warm up
            F.linear(x, w, b)
        t = time.perf_counter()
        for _ in range(n_tokens):
            for (w, b), x in zip(linears, inputs):
                F.linear(x, w, b)
        return time.perf_counter() - t


def read_floor(model, n_tokens: int) -> float:
    """Seconds to read the weight bytes of every ``nn.Linear`` of ``model`` ``n_tokens`` times (``weight.sum()``):
    the physical floor of a batch-1 token, the rate at which one core streams the weights from memory."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        for w in weights:
            w.sum()
        t = time.perf_counter()
        for _ in range(n_tokens):
            for w in weights:
                w.sum()
        return time.perf_counter() - t


def aot_load_seconds(path) -> float:
    """Seconds a new process takes to load an AOTInductor package (``torch._inductor.aoti_load_package``)."""
    import subprocess
    import sys

    code = ("import time, torch, torch._inductor\nt = time.perf_counter()\n"
            f"torch._inductor.aoti_load_package({str(path)!r})\nprint(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def compile_table(args) -> None:
    for b in [int(x) for x in args.compile_batches.split(",")]:
        compile_table_at(args, b)


def compile_table_at(args, b: int) -> None:
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer("shakespeare-char").eval()
    prompts = [[1 + i] for i in range(b)]  # one token each: rows of equal length, no padding

    def decode():
        if b == 1:
            return generate(model, prompts[0], NEW_TOKENS, temperature=0)
        return generate_batch(model, prompts, NEW_TOKENS, temperature=0)

    eager_tokens = decode()  # (warms the eager path up too)
    steps, tokens, compile_s = {"eager": None}, {}, {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name, options in (("compiled", {}), ("aot", {"mode": "aot", "cache_dir": cache_dir})):
            t = time.perf_counter()
            model.compile_decode(**options)
            tokens[name] = decode()  # the first call compiles
            compile_s[name] = time.perf_counter() - t
            steps[name] = model.compiled_decode
        aot_load = aot_load_seconds(next(iter(steps["aot"].packages.values())))

        def run(name):
            model.compiled_decode = steps[name]
            return decode()

        times = {"eager": [], "compiled": [], "aot": [], "floor": [], "read": []}
        for _ in range(args.compile_repeats):  # alternating: load from other jobs hits all five alike
            for name in ("eager", "compiled", "aot"):
                times[name].append(timed(lambda: run(name))[0])
            times["floor"].append(weight_floor(model, NEW_TOKENS, b))
            times["read"].append(read_floor(model, NEW_TOKENS) / b)  # (b rows share one read of the weights)
        model.compiled_decode = None
    tps = {k: b * NEW_TOKENS / statistics.median(v) for k, v in times.items()}
    same = {k: "yes" if eager_tokens == v else "no" for k, v in tokens.items()}
    print()
    print(f"compiled decode: shakespeare-char shape (random weights), batch {b}, {NEW_TOKENS} new tokens per row "
          f"from a 1-token prompt, greedy, float32, median of {args.compile_repeats} alternating runs; floor = the "
          f"same weight products (every nn.Linear, the output layer included) run alone, {NEW_TOKENS} times")
    print("| decode | tokens/s | vs floor | vs eager | vs Inductor C++ wrapper | compile s | same tokens as eager |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(f"| eager (model.decode, KV cache) | {tps['eager']:,.0f} | {tps['eager'] / tps['floor']:.2f}x | 1.00x | "
          f"{tps['eager'] / tps['compiled']:.2f}x |  |  |")
    print(f"| compiled (model.compile_decode, Inductor, C++ wrapper, static KV cache) | {tps['compiled']:,.0f} | "
          f"{tps['compiled'] / tps['floor']:.2f}x | {tps['compiled'] / tps['eager']:.2f}x | 1.00x | "
          f"{compile_s['compiled']:.0f} | {same['compiled']} |")
    print(f"| ahead of time (compile_decode(mode=\"aot\"), torch.export + AOTInductor .pt2) | {tps['aot']:,.0f} | "
          f"{tps['aot'] / tps['floor']:.2f}x | {tps['aot'] / tps['eager']:.2f}x | "
          f"{tps['aot'] / tps['compiled']:.2f}x | {compile_s['aot']:.0f} (a new process loads it in "
          f"{aot_load:.2f} s) | {same['aot']} |")
    print(f"| floor (the weight products alone) | {tps['floor']:,.0f} | 1.00x |  |  |  |  |")
    print(f"| physical floor (a plain read of the weight bytes) | {tps['read']:,.0f} | {tps['read'] / tps['floor']:.2f}x "
          f"|  |  |  |  |")
    print(f"against the physical floor: eager {tps['eager'] / tps['read']:.2f}x, compiled "
          f"{tps['compiled'] / tps['read']:.2f}x, ahead of time {tps['aot'] / tps['read']:.2f}x")
    try:
        print("load average after: %.1f %.1f %.1f" % os.getloadavg())
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------
# The linears table: a decode step's weight products, as F.linear and as the compiled reduction
# ---------------------------------------------------------------------------------------------------------


class _Products(torch.nn.Module):
    """The 24 weight products of the shakespeare-char shape (per layer: qkv, attention out, MLP up and down), each
    after a layer norm as in the model, through ``decoderlab.matvec.linear``: ``F.linear`` eagerly, the reduction
    when compiled."""

    def __init__(self, d: int = 384, n_layer: int = 6):
        super().__init__()
        shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layer
        self.linears = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in shapes)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(i) for i, _ in shapes)

    def forward(self, xs: dict) -> list:
        from decoderlab.matvec import linear

        return [linear(lin, norm(xs[lin.in_features])) for lin, norm in zip(self.linears, self.norms)]


def _block_bytes(module) -> int:
    """Bytes a product of ``module``'s linear layers reads: float weights, or a block layer's planes."""
    from decoderlab.quant import BlockLinear

    total = 0
    for m in module.modules():
        if isinstance(m, BlockLinear):
            total += sum(t.numel() * t.element_size() for t in (m.qs, m.d, m.m) if t is not None)
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def linears_table(args) -> None:
    """Per dtype and row count B: the 24 products eagerly (``F.linear``; a block layer dequantizes slices), the
    same products compiled (Inductor; ``matvec.linear`` takes the reduction up to MAX_ROWS / MAX_ROWS_HALF rows in
    float, at any row count over blocks) and the physical floor, a plain read of the float32 weight bytes
    (``weight.sum()``); median of ``--compile-repeats`` alternating rounds of 20 calls. The GB/s column is the bytes
    each dtype's products read over their time: against the floor's GB/s it says whether a product is bound by
    memory (near it) or by its arithmetic (well under it)."""
    from decoderlab.matvec import MAX_ROWS, MAX_ROWS_HALF
    from decoderlab.quant import quantize_model

    print(f"\nlinears: the 24 weight products of the shakespeare-char shape (42.5 MB in float32), each after a layer "
          f"norm; the reduction up to {MAX_ROWS} rows in float32, {MAX_ROWS_HALF} in bfloat16, any number over GGUF's "
          f"blocks; median of {args.compile_repeats} alternating rounds")
    print("| dtype | rows B | eager ms | compiled ms | compiled vs eager | fp32 read floor ms | compiled vs floor "
          "| compiled GB/s | floor GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    weights = [lin.weight for lin in _Products().linears]  # the float32 bytes the floor reads
    floor_bytes = sum(w.numel() * w.element_size() for w in weights)
    for dtype in [d for d in args.linear_dtypes.split(",")]:
        torch.manual_seed(0)
        eager = _Products().eval()
        eager = eager.to(getattr(torch, dtype)) if dtype in ("float32", "bfloat16") else quantize_model(eager, dtype)
        act = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        nbytes = _block_bytes(eager)
        for b in [int(x) for x in args.linear_rows.split(",")]:
            torch._dynamo.reset()  # one graph per row count and dtype, as the AOT step's packages
            compiled = torch.compile(eager, dynamic=False)
            xs = {n: torch.randn(b, 1, n, dtype=act) for n in (384, 1536)}
            calls = {"eager": lambda: eager(xs), "compiled": lambda: compiled(xs),
                     "floor": lambda: [w.sum() for w in weights]}
            ms = _alternate(calls, args.compile_repeats)
            print(f"| {dtype} | {b} | {ms['eager']:.2f} | {ms['compiled']:.2f} | {ms['eager'] / ms['compiled']:.2f}x | "
                  f"{ms['floor']:.2f} | {ms['floor'] / ms['compiled']:.2f}x | {nbytes / ms['compiled'] / 1e6:.1f} | "
                  f"{floor_bytes / ms['floor'] / 1e6:.1f} |")


def _alternate(calls: dict, repeats: int, n: int = 20) -> dict:
    """Median milliseconds per call of each of ``calls``, ``repeats`` rounds of ``n`` calls each, in turn."""
    times = {k: [] for k in calls}
    with torch.inference_mode():
        for f in calls.values():
            f()
        for _ in range(repeats):
            for k, f in calls.items():
                t = time.perf_counter()
                for _ in range(n):
                    f()
                times[k].append((time.perf_counter() - t) / n)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------------------------------------------------
# The batch-step table: what a decode step of B rows costs against one row's
# ---------------------------------------------------------------------------------------------------------


def batch_step_table(args, context: int = 128, steps: int = 32) -> None:
    """One decode step (``model.decode``, eager) of B rows over a KV cache holding ``context`` tokens per row,
    against B = 1: a step reads the weights once whatever B, so B rows should cost far less than B steps of one
    row. Median of ``--compile-repeats`` alternating rounds of ``steps`` steps each."""
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer("shakespeare-char").eval()
    batches = [int(b) for b in args.step_batches.split(",")]
    caches = {}
    with torch.inference_mode():
        for b in batches:  # each batch's cache prefilled once with `context` tokens
            cache = dl.KVCache.for_model(model)
            model(torch.randint(model.config.num_tokens, (b, context)), cache=cache, check_ids=False)
            caches[b] = cache

        def run(b):
            cache = caches[b]
            tokens = torch.zeros(b, 1, dtype=torch.long)
            t = time.perf_counter()
            for _ in range(steps):
                model.decode(tokens, context, None, cache)  # (not advanced: every step writes the same column)
            return (time.perf_counter() - t) / steps

        times = {b: [] for b in batches}
        for b in batches:
            run(b)
        for _ in range(args.compile_repeats):
            for b in batches:
                times[b].append(run(b))
    one = statistics.median(times[1]) if 1 in times else None
    print()
    print(f"batched decode step: shakespeare-char shape (random weights), eager model.decode over a KV cache of "
          f"{context} tokens per row, {steps} steps per round, median of {args.compile_repeats} alternating rounds")
    print("| rows B | ms per step | vs one row's step | tokens/s (B / step) | vs B steps of one row |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        ms = statistics.median(times[b])
        rel = f"{ms / one:.2f}x" if one else ""
        speed = f"{b * one / ms:.2f}x" if one else ""
        print(f"| {b} | {ms * 1e3:.2f} | {rel} | {b / ms:,.0f} | {speed} |")


# ---------------------------------------------------------------------------------------------------------
# The inference-dtype table
# ---------------------------------------------------------------------------------------------------------


def train_checkpoint(args, out: str) -> str:
    """A shakespeare-char-shaped model (6 layers, 6 heads, d_model 384, context 256; dropout off) trained for a
    few hundred steps on the embedded tinyshakespeare: enough for weights with a trained model's statistics."""
    from decoderlab.training import train_lm

    precision = args.train_precision
    if precision == "auto":
        precision = "bf16-mixed" if cpu_flags() & {"avx512_bf16", "amx_bf16"} else "32"
    t = time.perf_counter()
    _, _, s = train_lm(preset="shakespeare-char", out=out, progress_bar=False, logger=False,
                       model_overrides={"dropout": 0.0},
                       config_overrides=dict(max_steps=args.train_steps, batch_size=args.train_batch,
                                             warmup=min(50, args.train_steps // 4), lr=2e-3, min_lr=2e-4,
                                             eval_every=args.train_steps, val_batches=1, precision=precision,
                                             # Lightning refuses to clip gradients of a fused AdamW under
                                             # bf16-mixed
                                             fused=False if precision == "bf16-mixed" else None))
    print(f"trained {args.train_steps} steps of batch {args.train_batch} ({precision}) in "
          f"{time.perf_counter() - t:.0f} s: train loss {s.train_loss:.3f}")
    return out


def weight_megabytes(model) -> float:
    """Bytes of the model's parameters and buffers (shared ones once; a block layer's integers, scales and
    minimums), in MB."""
    seen, total = set(), 0
    for p in [*model.parameters(), *model.buffers()]:
        if id(p) not in seen and (p.is_floating_point() or p.dtype in (torch.int8, torch.uint8)):
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total / 1e6


def dtype_table(args) -> None:
    from decoderlab.data import corpus_tokens, read_corpus, split_tokens
    from decoderlab.training import evaluate_lm

    with tempfile.TemporaryDirectory(prefix="bench-dtypes-") as tmp:
        ckpt = args.checkpoint or os.path.join(tmp, "run")
        if not os.path.isdir(ckpt):
            train_checkpoint(args, ckpt)
        models = {d: dl.load_checkpoint(ckpt, dtype=d)[0] for d in DTYPES}
        tok = dl.load_checkpoint(ckpt)[1]
    fp32 = models["float32"]
    hf = to_hf(fp32).eval()
    val = split_tokens(corpus_tokens(read_corpus(None), tok), 0.1)[1]
    n_new = NEW_TOKENS
    one = torch.tensor([[int(val[0])]])

    def hf_generate():
        with torch.inference_mode():
            return hf.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, pad_token_id=0)[0, 1:].tolist()

    calls = {d: (lambda m=m: generate(m, [int(val[0])], n_new, temperature=0)) for d, m in models.items()}
    calls["hf"] = hf_generate
    for f in calls.values():  # warm up
        f()
    times = {k: [] for k in calls}
    for _ in range(args.dtype_repeats):  # alternating: load from other jobs hits every variant alike
        for k, f in calls.items():
            times[k].append(timed(f)[0])
    tps = {k: n_new / statistics.median(v) for k, v in times.items()}

    prompts = [[int(val[i * len(val) // 4])] for i in range(4)]
    greedy = {d: [generate(m, p, n_new, temperature=0) for p in prompts] for d, m in models.items()}
    hf_same = hf_generate() == greedy["float32"][0]

    windows = None if args.val_windows is None else args.val_windows
    losses, eval_s = {}, {}
    for d, m in models.items():
        t = time.perf_counter()
        losses[d] = evaluate_lm(m, val, m.config.max_len, batch_size=16,
                                max_batches=None if windows is None else max(1, windows // 16))
        eval_s[d] = time.perf_counter() - t
    n_windows = (len(val) - 1) // fp32.config.max_len
    if windows is not None:
        n_windows = min(n_windows, max(1, windows // 16) * 16)

    print()
    print(f"inference dtypes: shakespeare-char shape trained here, batch-1 decode of {n_new} new tokens (greedy, "
          f"1-token prompt), median of {args.dtype_repeats} alternating runs; validation loss over "
          f"{'all ' if windows is None else ''}{n_windows} non-overlapping {fp32.config.max_len}-token windows of "
          f"the last 10%; greedy agreement with float32 over {len(prompts)} prompts x {n_new} tokens")
    print("| dtype | weights MB | decode tokens/s | vs HF generate (fp32) | vs decoderlab fp32 | val loss | "
          "cost vs fp32 (nats) | greedy agreement with fp32 | first difference | eval s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for d, m in models.items():
        same = [sum(a == b for a, b in zip(g, r)) for g, r in zip(greedy[d], greedy["float32"])]
        firsts = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
                  for g, r in zip(greedy[d], greedy["float32"])]
        first = "none" if all(f is None for f in firsts) else ", ".join("-" if f is None else str(f) for f in firsts)
        print(f"| {d} | {weight_megabytes(m):.1f} | {tps[d]:,.0f} | {tps[d] / tps['hf']:.2f}x | "
              f"{tps[d] / tps['float32']:.2f}x | {losses[d]:.4f} | {losses[d] - losses['float32']:+.4f} | "
              f"{sum(same) / (len(prompts) * n_new):.1%} | {first} | {eval_s[d]:.0f} |")
    print(f"| HF GPT2LMHeadModel.generate (fp32) | {weight_megabytes(hf):.1f} | {tps['hf']:,.0f} | 1.00x | "
          f"{tps['hf'] / tps['float32']:.2f}x |  |  | {'same tokens as fp32' if hf_same else 'differs from fp32'} |  |  |")
    try:
        print("load average after: %.1f %.1f %.1f" % os.getloadavg())
    except OSError:
        pass



# ---------------------------------------------------------------------------------------------------------
# --shape smollm2-135m: a Llama-family model (SmolLM2-135M's shape) against transformers' LlamaForCausalLM
# ---------------------------------------------------------------------------------------------------------


def smollm2_verify_seconds(model, t: int = 16) -> list[str]:
    """``verify`` of the whole pass on ``t`` tokens: the float32 model against the float64 NumPy recomputation
    (tolerance 1e-5), then a float64 copy of it (1e-12); their seconds and worst step."""
    lines = []
    ids = torch.randint(0, model.config.num_tokens, (1, t), generator=torch.Generator().manual_seed(1))
    for name, m, tol in (("float32", model, 1e-5), ("float64", None, 1e-12)):
        m = m if m is not None else copy.deepcopy(model).double()
        seconds, rep = timed(lambda: dl.verify(m, ids, tol=tol))
        worst = max(rep.steps, key=lambda s: s.max_abs_diff / max(1.0, s.max_abs_ref))
        lines.append(f"verify, {name} model vs float64 NumPy, {t} tokens, tolerance {tol:g}: "
                     f"{'all ok' if rep.ok else 'FAILED'} ({len(rep.steps)} steps) in {seconds:.1f} s; worst step "
                     f"{worst.name!r}: max |diff| {worst.max_abs_diff:.2e} at max |ref| {worst.max_abs_ref:.3g}")
    return lines


def smollm2_table(args) -> None:
    """Batch-1 greedy decode of a SmolLM2-135M-shaped model (random weights, float32): ours eager, compiled and
    ahead of time against ``transformers``' ``LlamaForCausalLM.generate`` on the same weights, alternating."""
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer("smollm2-135m").eval()
    hf = to_hf(model)  # transformers' LlamaForCausalLM with the same weights (decoderlab's own exporter)
    assert type(hf).__name__ == "LlamaForCausalLM", type(hf).__name__
    prompt = torch.randint(0, model.config.num_tokens, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        diff = float((model(prompt) - hf(prompt).logits).abs().max())
    n = args.new_tokens

    def ours():
        return generate(model, prompt[0].tolist(), n, temperature=0)

    def theirs():
        with torch.inference_mode():
            return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, 8:].tolist()

    runs = {"eager": ours, "transformers": theirs}
    want, steps, compile_s = ours(), {"eager": None}, {}
    with tempfile.TemporaryDirectory() as cache_dir:
        variants = {"compiled": {}, "aot": {"mode": "aot", "cache_dir": cache_dir}}
        for name in ("compiled", "aot")[2 - args.compiled:]:  # (--compiled 1: the AOT step alone)
            options = variants[name]
            compile_s[name], tokens = timed(lambda: (model.compile_decode(**options), ours())[1])  # compiles
            steps[name] = model.compiled_decode
            assert tokens == want, f"{name} decode gave other tokens than eager's"
            runs[name] = ours
        same = theirs() == want
        times = {name: [] for name in runs}
        for _ in range(args.repeats):  # alternating: load from other jobs hits every variant alike
            for name, fn in runs.items():
                model.compiled_decode = steps.get(name)
                times[name].append(timed(fn)[0])
        model.compiled_decode = None
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    print(f"\ndecode, smollm2-135m shape ({model.num_parameters():,} parameters, random weights), batch 1, {n} new "
          f"tokens from an 8-token prompt, greedy, float32, median of {args.repeats} alternating runs; logits of the "
          f"prompt: max |ours - transformers| {diff:.1e}; transformers' tokens equal ours: {'yes' if same else 'no'}")
    print("| decode | tokens/s | vs transformers | compile s |")
    print("|---|---:|---:|---:|")
    labels = {"eager": "decoderlab eager (model.decode, KV cache of 3 heads)",
              "compiled": "decoderlab compiled (compile_decode(), Inductor C++ wrapper)",
              "aot": "decoderlab ahead of time (compile_decode(mode=\"aot\"))",
              "transformers": "transformers LlamaForCausalLM.generate (sdpa, its cache)"}
    for name in runs:
        print(f"| {labels[name]} | {tps[name]:,.1f} | {tps[name] / tps['transformers']:.2f}x | "
              f"{compile_s.get(name, 0):.0f} |")
    for line in smollm2_verify_seconds(model):
        print(line)
    print("load average after: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
