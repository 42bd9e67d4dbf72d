"""decoderlab against llama.cpp on the same weights: decode tokens/s and prompt tokens/s, batch 1, greedy.

Two shapes with random GPT-2 weights and a 50,257-token vocabulary (a byte-level BPE trained on the embedded
tinyshakespeare, padded with control tokens to GPT-2's size, since the output layer's cost is the vocabulary's):
``small`` (6 layers, 6 heads, d_model 384, context 256) and ``gpt2`` (GPT-2 small: 12 layers, 12 heads, 768, 1024).

Two floors: the same weight products (every ``nn.Linear``, the output layer included) run alone on one token
through ``F.linear`` in float32, and the physical one, a plain read of those float32 weight bytes (``weight.sum()``):
the rate at which one core streams them from memory. Ours: ``decoderlab.generate`` eager float32, bfloat16 and int8
(weight-only, torchao) weights, and the decode step compiled ahead of time (``compile_decode(mode="aot")``, a
package per dtype, its compile time apart) in float32, bfloat16 and float16. llama.cpp (llama-cpp-python, built
from source with its native CPU flags): the same weights written by ``decoderlab.export.to_gguf`` in f32,
f16 and q8_0. Decode: ``--new-tokens`` greedy tokens after a ``--prompt-tokens`` prompt, tokens/s over the whole
call; prompt: one prefill of ``--prefill-tokens`` tokens (ours: one forward pass into a KV cache; llama.cpp:
``Llama.eval`` of the prompt), tokens/s. Every variant runs once per round, in turn, ``--repeats`` rounds;
medians. Greedy tokens of llama.cpp f32 are compared with ours.

Skipped with a message when llama-cpp-python is absent (``pip install llama-cpp-python`` builds llama.cpp): ours
is then measured alone.

    python bench/llamacpp.py [--shapes small,gpt2] [--threads 2] [--repeats 3] [--new-tokens 128] [--skip-compiled]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import decoderlab as dl
from decoderlab.devices import machine_line
from decoderlab.attention import KVCache
from decoderlab.export import to_gguf
from decoderlab.generation import generate

SHAPES = {"small": dict(n_layer=6, n_head=6, d_model=384, max_len=256),
          "gpt2": dict(n_layer=12, n_head=12, d_model=768, max_len=1024)}
VOCAB = 50_257



def gpt2_vocab() -> dl.BPETokenizer:
    """A byte-level BPE of GPT-2's size: trained on the embedded corpus, then padded with control tokens."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = dl.BPETokenizer.train(dl.read_corpus(), VOCAB)
    short = VOCAB - tok.vocab_size
    return tok.add_special_tokens([f"<|extra_{i}|>" for i in range(short)]) if short else tok


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def ours(model, prompt, args):
    """(decode call, prefill call) of decoderlab for ``model``."""
    long_prompt = torch.tensor([list(range(2, 2 + args.prefill_tokens))])

    def decode():
        return generate(model, prompt, args.new_tokens, temperature=0, stop_at_eos=False)

    def prefill():
        with torch.inference_mode():
            return model(long_prompt, cache=KVCache.for_model(model), last_only=True, check_ids=False)

    return decode, prefill


def theirs(path, prompt, args):
    """(decode call, prefill call) of llama.cpp for the GGUF file ``path``."""
    from llama_cpp import Llama

    n_ctx = max(len(prompt) + args.new_tokens, args.prefill_tokens) + 8
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=max(args.prefill_tokens, 64), n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    long_prompt = list(range(2, 2 + args.prefill_tokens))

    def decode():
        out = []
        for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(t))
            if len(out) == args.new_tokens:
                break
        return out

    def prefill():
        llm.reset()
        llm.eval(long_prompt)

    return decode, prefill


def floor(model, args):
    """(decode call, None): the weight-product floor, every ``nn.Linear`` of ``model`` (the output layer
    included) on one token's activations, ``--new-tokens`` times: what a token's weights cost alone."""
    import torch.nn.functional as F

    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, w.size(1)) for w, _ in linears]

    def decode():
        with torch.inference_mode():
            for _ in range(args.new_tokens):
                for (w, b), x in zip(linears, inputs):
                    F.linear(x, w, b)

    return decode, lambda: None


def read_floor(model, args):
    """(decode call, None): the physical floor, a plain read of every ``nn.Linear``'s float32 weight bytes
    (``weight.sum()``), ``--new-tokens`` times: what streaming a token's weights from memory costs on one core."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def decode():
        with torch.inference_mode():
            for _ in range(args.new_tokens):
                for w in weights:
                    w.sum()

    return decode, lambda: None


def variants(shape: str, tok, tmp: str, args) -> tuple[dict, dict, dict]:
    """The calls of every variant at ``shape``: {name: (decode, prefill)}, compile seconds, weight bytes."""
    from decoderlab.dtypes import to_inference_dtype

    torch.manual_seed(0)
    cfg = dl.preset("gpt2", num_tokens=VOCAB, **SHAPES[shape])
    base = dl.DecoderOnlyTransformer(cfg).eval()
    prompt = tok.encode("ROMEO: O, she doth teach the torches to burn bright!")[: args.prompt_tokens]
    calls, notes = {}, {}
    calls["floor fp32 (weight products alone)"] = floor(base, args)
    calls["ours eager fp32"] = ours(base, prompt, args)
    calls["floor: a plain read of the fp32 weight bytes"] = read_floor(base, args)
    for d in ("bfloat16", "int8"):
        m = dl.DecoderOnlyTransformer(cfg).eval()
        m.load_state_dict(base.state_dict())
        calls[f"ours eager {d}"] = ours(to_inference_dtype(m, d), prompt, args)
    if not args.skip_compiled:  # the decode step compiled ahead of time, a package per dtype (compile time apart)
        for d, name in (("float32", "fp32"), ("bfloat16", "bfloat16"), ("float16", "float16")):
            m = dl.DecoderOnlyTransformer(cfg).eval()
            m.load_state_dict(base.state_dict())
            m = to_inference_dtype(m, d)
            m.compile_decode(mode="aot", cache_dir=os.path.join(tmp, "aot"))
            notes[f"compile s {name}"], _ = timed(lambda: generate(m, prompt, 4, temperature=0))
            calls[f"ours AOT {name}"] = ours(m, prompt, args)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp skipped, decoderlab measured alone "
              "(pip install llama-cpp-python builds it)")
        return calls, notes, {"base": base, "prompt": prompt}
    for d in ("f32", "f16", "q8_0"):
        path = os.path.join(tmp, f"{shape}-{d}.gguf")
        to_gguf(base, tok, path, dtype=d)
        calls[f"llama.cpp {d}"] = theirs(path, prompt, args)
    return calls, notes, {"base": base, "prompt": prompt}


def measure(shape: str, tok, tmp: str, args) -> None:
    calls, notes, ctx = variants(shape, tok, tmp, args)
    results = {k: {"decode": [], "prefill": []} for k in calls}
    tokens = {}
    for dec, pre in calls.values():  # warm up
        dec(), pre()
    for _ in range(args.repeats):  # alternating: the load of other jobs hits every variant alike
        for k, (dec, pre) in calls.items():
            dt, tokens[k] = timed(dec)
            results[k]["decode"].append(dt)
            results[k]["prefill"].append(timed(pre)[0])
    dec_tps = {k: args.new_tokens / statistics.median(v["decode"]) for k, v in results.items()}
    pre_tps = {k: args.prefill_tokens / statistics.median(v["prefill"]) for k, v in results.items()}
    ref = "llama.cpp f32" if "llama.cpp f32" in calls else "ours eager fp32"
    same = tokens.get("llama.cpp f32") == tokens["ours eager fp32"] if ref != "ours eager fp32" else None
    s = SHAPES[shape]
    compiles = ", ".join(f"{k[10:]} {v:.0f} s" for k, v in notes.items() if k.startswith("compile s "))
    print(f"\n{shape}: {s['n_layer']} layers, d_model {s['d_model']}, vocabulary {VOCAB:,}, random weights; decode "
          f"{args.new_tokens} greedy tokens after {len(ctx['prompt'])} prompt tokens, prefill {args.prefill_tokens} "
          f"tokens; median of {args.repeats} alternating rounds; AOT compile (apart): {compiles or 'skipped'}")
    print(f"| variant | decode tokens/s | vs {ref} | prompt tokens/s | vs {ref} |")
    print("|---|---:|---:|---:|---:|")
    for k in calls:
        pre = "" if k.startswith("floor") else f"{pre_tps[k]:,.0f} | {pre_tps[k] / pre_tps[ref]:.2f}x"
        print(f"| {k} | {dec_tps[k]:,.1f} | {dec_tps[k] / dec_tps[ref]:.2f}x | {pre or ' | '} |")
    for floor_name in ("floor fp32 (weight products alone)", "floor: a plain read of the fp32 weight bytes"):
        f = dec_tps[floor_name]
        print(f"vs the {floor_name}: " + ", ".join(f"{k} {dec_tps[k] / f:.2f}x" for k in calls
                                                  if ("fp32" in k or "f32" in k) and not k.startswith("floor")))
    if same is not None:
        print(f"greedy tokens, llama.cpp f32 vs ours eager fp32: {'identical' if same else 'DIFFER'}")
    for k in calls:
        if k.startswith("ours AOT") or k.startswith("ours eager ") and k != "ours eager fp32":
            agree = sum(a == b for a, b in zip(tokens[k], tokens["ours eager fp32"])) / len(tokens[k])
            print(f"greedy tokens, {k} vs ours eager fp32: {agree:.0%} identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="small,gpt2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=14)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--skip-compiled", action="store_true", help="leave out the AOT steps (each compiles for a "
                    "minute or more on a loaded 2-core machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    tok = gpt2_vocab()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        for shape in args.shapes.split(","):
            measure(shape, tok, tmp, args)
    try:
        print("load average after: %.1f %.1f %.1f" % os.getloadavg())
    except OSError:
        pass


if __name__ == "__main__":
    main()
