"""decoderlab against llama.cpp on the same weights: decode tokens/s and prompt tokens/s, batch 1, greedy; and with
a trained model (``--checkpoint``, or a GGUF file in ``--shapes``) perplexity on held-out text and greedy agreement.

Shapes (``--shapes``, comma-separated): ``small`` (6 layers, 6 heads, d_model 384, context 256) and ``gpt2`` (GPT-2
small: 12 layers, 12 heads, 768, 1024), each with random GPT-2 weights and a 50,257-token vocabulary (a byte-level
BPE trained on the embedded tinyshakespeare, padded with control tokens to GPT-2's size, since the output layer's
cost is the vocabulary's) -- or the path of a GGUF file (a real model, e.g. SmolLM2-135M-Instruct.Q4_1.gguf), which
llama.cpp reads as it is and decoderlab through its GGUF loader (``decoderlab.gguf``, when present).

Ours (``--ours``, ``MODE:DTYPE`` items): ``decoderlab.generate`` with the decode step eager (``eager:``), compiled
ahead of time (``aot:``, ``compile_decode(mode="aot")``: a package per dtype, its compile time apart) or by
``torch.compile`` (``compile:``, ``compile_decode()``; its compile time apart too), in float32,
bfloat16 or GGUF's blocks q8_0 / q4_0 / q4_1 (``decoderlab.quant``). Two floors: the weight
products (every ``nn.Linear``, the output layer included) alone on one token through ``F.linear`` in float32, and a
plain read of those float32 weight bytes (``weight.sum()``), the rate one core streams them from memory.

llama.cpp (``--theirs``; llama-cpp-python, built from source with its native CPU flags): the same weights written by
``decoderlab.export.to_gguf`` in f32, f16, q8_0, q4_0 and q4_1 -- the block types byte for byte the blocks ours
decodes -- each loaded once with llama.cpp's defaults and once with ``use_extra_bufts=False`` (no repacked CPU
buffer types: llama.cpp's AMX and repacked int8 paths off; named in the row). Each llama.cpp variant runs in a
process of its own: a variant that crashes (llama.cpp's AMX int8 kernel segfaults on some CPUs,
ggml-org/llama.cpp#20824) is a row saying so, and the others go on.

Decode: ``--new-tokens`` greedy tokens after a ``--prompt-tokens`` prompt, tokens/s over the whole call; prompt: one
prefill of ``--prefill-tokens`` tokens (ours: one forward pass into a KV cache; llama.cpp: ``Llama.eval``). Every
variant runs once per round, in turn, ``--repeats`` rounds; medians; ratios against llama.cpp's variant of the
same weight type where it ran. Greedy tokens of each variant are compared with ours eager float32.

Accuracy (``--checkpoint DIR``, a trained GPT-2-shaped decoderlab checkpoint, e.g. ``bench/generate.py``'s; or a
GGUF file in ``--shapes``): perplexity over ``--ppl-windows`` non-overlapping windows of held-out text (the last 10%
of the checkpoint's corpus, or ``--text`` for a GGUF file) for ours at each dtype and llama.cpp at each type of the
same weights (its logits of every position, ``logits_all``), and greedy agreement of ours with ours float32.

Skipped with a message when llama-cpp-python is absent (``pip install llama-cpp-python`` builds llama.cpp): ours is
then measured alone.

    python bench/llamacpp.py [--shapes small,gpt2,FILE.gguf] [--threads 1] [--repeats 3] [--new-tokens 64]
                             [--ours eager:float32,aot:q8_0,...] [--theirs f32,q8_0,...] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import decoderlab as dl
from decoderlab.attention import KVCache
from decoderlab.devices import cpu_features, machine_line
from decoderlab.dtypes import to_inference_dtype
from decoderlab.export import to_gguf
from decoderlab.generation import generate

SHAPES = {"small": dict(n_layer=6, n_head=6, d_model=384, max_len=256),
          "gpt2": dict(n_layer=12, n_head=12, d_model=768, max_len=1024)}
VOCAB = 50_257
OURS = "eager:float32,aot:float32,aot:bfloat16,aot:q8_0,aot:q4_0,aot:q4_1"
THEIRS = "f32,f16,q8_0,q4_0,q4_1"
#: llama.cpp's type of the same weights as each of our dtypes (the ratio column)
SAME_WEIGHTS = {"float32": "f32", "bfloat16": "f16", "float16": "f16", "q8_0": "q8_0", "q4_0": "q4_0",
                "q4_1": "q4_1"}
#: llama.cpp's type name (--theirs) -> the --dtype that writes it (to_gguf speaks our names)
WRITTEN_AS = {"f32": "float32", "f16": "float16"}


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


# ---------------------------------------------------------------------------------------------------------
# llama.cpp, one process per variant
# ---------------------------------------------------------------------------------------------------------


def no_extra_bufts() -> None:
    """llama.cpp without its repacked CPU buffer types (AMX, repacked int8) in this process:
    llama_model_params.use_extra_bufts, which Llama() does not take, set False on its defaults."""
    import llama_cpp.llama_cpp as low

    defaults = low.llama_model_default_params

    def without_extra_bufts():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = without_extra_bufts


def worker() -> None:
    """The child process of one llama.cpp variant: its settings on the first line of standard input, then one JSON
    command per line (decode, prefill, nll), one JSON answer per line on standard output."""
    import faulthandler

    import numpy as np
    from llama_cpp import Llama

    faulthandler.enable()
    cfg = json.loads(sys.stdin.readline())
    if not cfg["extra_bufts"]:
        no_extra_bufts()
    t = time.perf_counter()
    llm = Llama(model_path=cfg["path"], n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_threads=cfg["threads"],
                n_threads_batch=cfg["threads"], logits_all=cfg["logits_all"], verbose=False)
    print(json.dumps({"load_s": time.perf_counter() - t}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t = time.perf_counter()
        if cmd["cmd"] == "decode":
            out = []
            for tok in llm.generate(cmd["prompt"], top_k=1, temp=0.0, reset=True):
                out.append(int(tok))
                if len(out) == cmd["n"]:
                    break
            answer = {"tokens": out}
        elif cmd["cmd"] == "prefill":
            llm.reset()
            llm.eval(cmd["ids"])
            answer = {}
        else:  # nll: mean negative log-likelihood of each window's next tokens
            total, count = 0.0, 0
            for window in cmd["windows"]:
                llm.reset()
                llm.eval(window)
                logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
                logits -= logits.max(axis=1, keepdims=True)
                logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
                total -= float(logp[np.arange(len(window) - 1), window[1:]].sum())
                count += len(window) - 1
            answer = {"nll": total / count}
        answer["s"] = time.perf_counter() - t
        print(json.dumps(answer), flush=True)


class Peer:
    """One llama.cpp variant in a process of its own (:func:`worker`). A call returns its answer, or None once the
    process has died; :attr:`crash` then says how (the signal, and the known issue it matches)."""

    def __init__(self, name: str, path: str, extra_bufts: bool, args, n_ctx: int, logits_all: bool = False):
        self.name, self.crash, self.phase = name, None, "loading"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._send({"path": path, "n_ctx": n_ctx, "n_batch": min(n_ctx, 512), "threads": args.threads,
                    "extra_bufts": extra_bufts, "logits_all": logits_all})
        self.load = self._answer()

    def _send(self, obj) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def _answer(self):
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        code = self.proc.wait()
        self.log.seek(0)
        tail = [s for s in self.log.read().strip().splitlines() if s.strip()][-1:] or [""]
        if code < 0:
            what = f"{signal.Signals(-code).name} while {self.phase}"
            if -code == signal.SIGSEGV and {"amx_int8", "amx_tile"} & set(cpu_features()) and "extra" not in self.name:
                what += " (llama.cpp's AMX int8 kernel, ggml-org/llama.cpp#20824)"
        else:
            what = f"exit status {code} while {self.phase}: {tail[0][:120]}"
        self.crash = f"crashed: {what}"
        return None

    def __call__(self, cmd: str, **kw):
        if self.crash is not None:
            return None
        self.phase = {"decode": "decoding", "prefill": "reading the prompt", "nll": "scoring text"}[cmd]
        self._send({"cmd": cmd, **kw})
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp skipped, decoderlab measured alone "
              "(pip install llama-cpp-python builds it)")
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# decoderlab
# ---------------------------------------------------------------------------------------------------------


def ours(model, prompt, args):
    """(decode call, prefill call) of decoderlab for ``model``; each returns (seconds, tokens)."""
    long_prompt = torch.tensor([list(range(2, 2 + args.prefill_tokens))])

    def decode():
        return timed(lambda: generate(model, prompt, args.new_tokens, temperature=0, stop_at_eos=False))

    def prefill():
        with torch.inference_mode():
            return timed(lambda: model(long_prompt, cache=KVCache.for_model(model), last_only=True, check_ids=False))

    return decode, prefill


def theirs(peer: Peer, prompt, args):
    """(decode call, prefill call) of a llama.cpp variant; None from either once it has crashed."""
    long_prompt = list(range(2, 2 + args.prefill_tokens))

    def decode():
        a = peer("decode", prompt=list(prompt), n=args.new_tokens)
        return None if a is None else (a["s"], a["tokens"])

    def prefill():
        a = peer("prefill", ids=long_prompt)
        return None if a is None else (a["s"], None)

    return decode, prefill


def floors(model, args) -> dict:
    """The two floors of the module docstring as (decode call, None), each returning (seconds, None)."""
    import torch.nn.functional as F

    linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, w.size(1)) for w, _ in linears]

    def products():
        with torch.inference_mode():
            for _ in range(args.new_tokens):
                for (w, b), x in zip(linears, inputs):
                    F.linear(x, w, b)

    def read():
        with torch.inference_mode():
            for _ in range(args.new_tokens):
                for w, _ in linears:
                    w.sum()

    return {"floor fp32 (weight products alone)": (lambda: timed(products), None),
            "floor: a plain read of the fp32 weight bytes": (lambda: timed(read), None)}


def our_model(make, spec: str, cache: str):
    """``make(dtype)`` -> a model; ``spec`` "MODE:DTYPE": its step compiled ahead of time for ``aot``, by
    torch.compile for ``compile`` (Inductor, C++ wrapper), eager for ``eager``."""
    mode, dtype = spec.split(":")
    model = make(dtype)
    if mode == "aot":
        model.compile_decode(mode="aot", cache_dir=cache)
    elif mode == "compile":
        model.compile_decode()
    return model


# ---------------------------------------------------------------------------------------------------------
# the variants of a shape
# ---------------------------------------------------------------------------------------------------------


def gpt2_vocab() -> dl.BPETokenizer:
    """A byte-level BPE of GPT-2's size: trained on the embedded corpus, then padded with control tokens."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = dl.BPETokenizer.train(dl.read_corpus(), VOCAB)
    short = VOCAB - tok.vocab_size
    return tok.add_special_tokens([f"<|extra_{i}|>" for i in range(short)]) if short else tok


def peers(files: dict[str, str], args, n_ctx: int, logits_all: bool = False) -> dict[str, Peer]:
    """A llama.cpp process per GGUF file of ``files`` ({type: path}), and for each block type a second one with
    ``use_extra_bufts=False``."""
    out = {}
    for kind, path in files.items():
        for extra in (True, False) if kind not in ("f32", "f16") else (True,):
            name = f"llama.cpp {kind}" + ("" if extra else " (use_extra_bufts=False)")
            out[name] = Peer(name, path, extra, args, n_ctx, logits_all)
    return out


def synthetic(shape: str, tok, tmp: str, args):
    """(calls {name: (decode, prefill)}, prompt, peers) of every variant at a synthetic ``shape``."""
    torch.manual_seed(0)
    cfg = dl.preset("gpt2", num_tokens=VOCAB, **SHAPES[shape])
    base = dl.DecoderOnlyTransformer(cfg).eval()
    prompt = tok.encode("ROMEO: O, she doth teach the torches to burn bright!")[: args.prompt_tokens]

    def make(dtype):
        m = dl.DecoderOnlyTransformer(cfg).eval()
        m.load_state_dict(base.state_dict())
        m = to_inference_dtype(m, dtype)
        try:  # where the one loader puts a model's weights (a tree before it: where they are)
            from decoderlab.kernels import huge_pages
        except ImportError:
            return m
        huge_pages(m)
        return m

    calls = floors(base, args)
    for spec in args.ours.split(","):
        calls[f"ours {spec.replace(':', ' ')}"] = ours(our_model(make, spec, os.path.join(tmp, "aot")), prompt, args)
    running = {}
    if llama_cpp_available():
        files = {}
        for kind in args.theirs.split(","):
            files[kind] = os.path.join(tmp, f"{shape}-{kind}.gguf")
            to_gguf(base, tok, files[kind], dtype=WRITTEN_AS.get(kind, kind))
        running = peers(files, args, max(len(prompt) + args.new_tokens, args.prefill_tokens) + 8)
        calls.update({name: theirs(p, prompt, args) for name, p in running.items()})
    return calls, prompt, running


def gguf_loader(path: str):
    """``make(dtype)`` -> our model of the GGUF file at ``path`` through the one loader a user's command reads it
    with (``decoderlab.chat.load_model``: on the CPU, the weights in huge pages) -- float32: dequantized; a block
    type: the file's matrices of that type as they are, every other one quantized from its float32 values --
    SmolLM2's Q8_0 embedding too, at q4_1 --, or None without decoderlab's GGUF loader in this tree."""
    try:
        from decoderlab.chat import load_model
        from decoderlab.gguf import load_gguf  # noqa: F401  (a tree that reads GGUF files)
    except ImportError:
        print("decoderlab's GGUF loader (decoderlab.gguf) is not in this tree: llama.cpp measured alone")
        return None

    def make(dtype):
        return load_model(path, dtype=None if dtype == "float32" else dtype).model

    return make


def gguf_files(path: str, make, tok, tmp: str, kinds) -> dict[str, str]:
    """{type: GGUF path}: the file itself for its own type, and ours float32 written at each other type of
    ``kinds`` (``decoderlab.export.to_gguf``, where it writes this architecture; skipped, said, where not)."""
    own, files = file_type(path), {}
    files[own] = path
    for kind in [k for k in kinds if k != own]:
        files[kind] = os.path.join(tmp, f"{os.path.basename(path)}-{kind}.gguf")
        if os.path.exists(files[kind]):  # (written for the speed table already)
            continue
        try:
            to_gguf(make("float32"), tok, files[kind], dtype=WRITTEN_AS.get(kind, kind))
        except (ValueError, NotImplementedError) as e:
            files.pop(kind)
            print(f"llama.cpp {kind} of {os.path.basename(path)} skipped: decoderlab cannot write it here ({e})")
    return files


def gguf_file(path: str, tmp: str, args):
    """(calls, prompt, peers) for a GGUF file: ours loads it at each dtype of ``--ours`` (:func:`gguf_loader`);
    llama.cpp reads the file as it is and ours written at the other types of ``--theirs``."""
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    calls, make = {}, gguf_loader(path)
    if make is not None:
        for spec in args.ours.split(","):
            calls[f"ours {spec.replace(':', ' ')}"] = ours(our_model(make, spec, os.path.join(tmp, "aot")), prompt, args)
    running = {}
    if llama_cpp_available():
        if make is None:
            files = {file_type(path): path}
        else:
            from decoderlab.gguf import load_gguf

            files = gguf_files(path, make, load_gguf(path)[1], tmp, args.theirs.split(","))
        running = peers(files, args, max(len(prompt) + args.new_tokens, args.prefill_tokens) + 8)
        calls.update({name: theirs(p, prompt, args) for name, p in running.items()})
    return calls, prompt, running


def file_type(path: str) -> str:
    """The GGML type most of a GGUF file's matrices have, as our name (``q4_1``) where it is one of ours."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors
                                 if len(t.shape) == 2)
    return counts.most_common(1)[0][0]


# ---------------------------------------------------------------------------------------------------------
# measuring and printing
# ---------------------------------------------------------------------------------------------------------


def measure(calls: dict, args) -> tuple[dict, dict, dict, dict]:
    """Warm every variant up (an AOT step compiles there: its seconds kept apart), then ``--repeats`` rounds of
    every variant in turn. Returns (decode seconds, prefill seconds, tokens, warm-up seconds) by variant; a
    variant that crashed has no seconds."""
    dec, pre, tokens, warm = ({k: [] for k in calls}, {k: [] for k in calls}, {}, {})
    for name, (decode, _) in calls.items():
        t = time.perf_counter()
        decode()
        warm[name] = time.perf_counter() - t
    for _ in range(args.repeats):  # alternating: the load of other jobs hits every variant alike
        for name, (decode, prefill) in calls.items():
            got = decode()
            if got is None:
                continue
            dec[name].append(got[0])
            tokens[name] = got[1]
            if prefill is not None:
                p = prefill()
                if p is not None:
                    pre[name].append(p[0])
    return dec, pre, tokens, warm


def reference(name: str, rates: dict) -> str | None:
    """The llama.cpp variant of the same weights as ``name`` that ran (its default buffers first)."""
    if name.startswith("llama.cpp"):
        return name.split(" (")[0] if name.split(" (")[0] in rates else name
    kind = SAME_WEIGHTS.get(name.split()[-1])
    for cand in (f"llama.cpp {kind}", f"llama.cpp {kind} (use_extra_bufts=False)"):
        if cand in rates:
            return cand
    return None


def report(title: str, calls: dict, peers_: dict, args, prompt) -> None:
    dec, pre, tokens, warm = measure(calls, args)
    rate = {k: args.new_tokens / statistics.median(v) for k, v in dec.items() if v}
    prate = {k: args.prefill_tokens / statistics.median(v) for k, v in pre.items() if v}
    compiles = ", ".join(f"{k[5:]} {warm[k]:.0f} s" for k in calls if k.startswith(("ours aot", "ours compile")))
    print(f"\n{title}; decode {args.new_tokens} greedy tokens after {len(prompt)} prompt tokens, prefill "
          f"{args.prefill_tokens} tokens; median of {args.repeats} alternating rounds; AOT compile + first call "
          f"(apart): {compiles or 'none'}")
    print("| variant | decode tokens/s | vs llama.cpp, same weights | prompt tokens/s | vs llama.cpp, same weights | "
          "greedy tokens = ours eager fp32 | = llama.cpp, same weights |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_tokens = tokens.get("ours eager float32")
    for k in calls:
        peer = peers_.get(k)
        if peer is not None and peer.crash is not None:
            print(f"| {k} | {peer.crash} | | | | | |")
            continue
        if k not in rate:
            print(f"| {k} | (no result) | | | | | |")
            continue
        ref = reference(k, rate)
        vs = f"{rate[k] / rate[ref]:.2f}x ({ref[10:]})" if ref and not k.startswith("llama") else ""
        pvs = f"{prate[k] / prate[ref]:.2f}x" if ref and k in prate and ref in prate and not k.startswith("llama") else ""
        same = theirs_same = ""
        if base_tokens and tokens.get(k) is not None and not k.startswith("floor"):
            same = f"{sum(a == b for a, b in zip(tokens[k], base_tokens)) / len(base_tokens):.0%}"
        if ref and not k.startswith(("llama", "floor")) and tokens.get(ref) and tokens.get(k):
            theirs_same = f"{sum(a == b for a, b in zip(tokens[k], tokens[ref])) / len(tokens[ref]):.0%}"
        print(f"| {k} | {rate[k]:,.1f} | {vs} | {f'{prate[k]:,.0f}' if k in prate else ''} | {pvs} | {same} | "
              f"{theirs_same} |")
    for f in [k for k in rate if k.startswith("floor")]:
        print(f"vs the {f}: " + ", ".join(f"{k} {rate[k] / rate[f]:.2f}x" for k in rate if not k.startswith("floor")))


# ---------------------------------------------------------------------------------------------------------
# accuracy: perplexity on held-out text, greedy agreement
# ---------------------------------------------------------------------------------------------------------


def held_out(args, tokenizer, max_len: int) -> list[list[int]]:
    """``--ppl-windows`` non-overlapping windows of ``max_len`` tokens of held-out text: the last 10% of the
    checkpoint's corpus (the validation split training left out), or of ``--text``."""
    from decoderlab.data import read_corpus, split_tokens

    text = read_corpus(args.text)
    ids = split_tokens(torch.tensor(tokenizer.encode(text)), 0.1)[1].tolist()
    return [ids[i:i + max_len] for i in range(0, len(ids) - max_len, max_len)][: args.ppl_windows]


def nll(model, windows) -> float:
    """Mean negative log-likelihood (nats) of every window's next tokens under ``model``."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            logits = model(torch.tensor([w]))[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
            count += len(w) - 1
    return total / count


def accuracy(source: str, args, tmp: str) -> None:
    """Perplexity of ours at each dtype and of llama.cpp at each type of the same weights, and greedy agreement
    of ours with ours float32 (4 prompts from the held-out text x ``--new-tokens``)."""
    is_gguf = source.endswith(".gguf")
    if is_gguf:
        from decoderlab.gguf import load_gguf

        tok, make = load_gguf(source)[1], gguf_loader(source)
    else:
        base, tok = dl.load_checkpoint(source)
        make = lambda d: to_inference_dtype(dl.load_checkpoint(source)[0], d)  # noqa: E731
    dtypes = ["float32", *[d for d in ("q8_0", "q4_0", "q4_1", "bfloat16") if d in args.ours]]
    models = {d: make(d) for d in dtypes}
    max_len = min(models["float32"].config.max_len, args.ppl_len)
    windows = held_out(args, tok, max_len)
    ppl = {f"ours {d}": float(torch.tensor(nll(m, windows)).exp()) for d, m in models.items()}
    prompts = [w[:4] for w in windows[:4]]
    greedy = {d: [generate(m, p, args.new_tokens, temperature=0, stop_at_eos=False) for p in prompts]
              for d, m in models.items()}
    if llama_cpp_available():
        if is_gguf:
            files = gguf_files(source, make, tok, tmp, args.theirs.split(","))
        else:
            files = {}
            for kind in args.theirs.split(","):
                files[kind] = os.path.join(tmp, f"acc-{kind}.gguf")
                to_gguf(base, tok, files[kind], dtype=WRITTEN_AS.get(kind, kind))
        for name, peer in peers(files, args, max_len + 8, logits_all=True).items():
            a = peer("nll", windows=windows)
            ppl[name] = peer.crash if a is None else float(torch.tensor(a["nll"]).exp())
            peer.close()
    n = sum(len(w) - 1 for w in windows)
    print(f"\naccuracy: {source}; perplexity over {len(windows)} held-out windows of {max_len} tokens ({n:,} "
          f"predictions); greedy agreement with ours float32 over {len(prompts)} prompts x {args.new_tokens} tokens")
    print("| variant | perplexity | vs ours float32 | greedy tokens = ours float32 |")
    print("|---|---:|---:|---:|")
    for k, v in ppl.items():
        if isinstance(v, str):
            print(f"| {k} | {v} | | |")
            continue
        d = k.split()[-1]
        agree = ""
        if k.startswith("ours"):
            same = sum(a == b for g, r in zip(greedy[d], greedy["float32"]) for a, b in zip(g, r))
            agree = f"{same / (len(prompts) * args.new_tokens):.1%}"
        print(f"| {k} | {v:.4f} | {v / ppl['ours float32'] - 1:+.2%} | {agree} |")


# ---------------------------------------------------------------------------------------------------------
# the table of issue 46: each variant in a fresh process per round -- load time, peak memory, decode, prompt
# ---------------------------------------------------------------------------------------------------------

#: the kinds of GGUF file of the table, by the --dtype decoderlab's exporter writes each with (Q4_K_M: llama.cpp's
#: quantizer, when llama-cpp-python is there)
TABLE_FILES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "q8_0": "q8_0"}


def run_one() -> None:
    """The child process of one variant and round (``--run-one JSON``): load the file, decode, read a prompt;
    prints one JSON line: load seconds, decode tokens/s, prompt tokens/s, peak resident bytes, the tokens."""
    spec = json.loads(sys.argv[sys.argv.index("--run-one") + 1])
    n, prompt, long_prompt = spec["new_tokens"], spec["prompt"], spec["long_prompt"]
    t = time.perf_counter()
    if spec["who"] == "llama.cpp":
        from llama_cpp import Llama

        if not spec.get("extra_bufts", True):
            no_extra_bufts()

        llm = Llama(model_path=spec["path"], n_ctx=len(long_prompt) + n + 16, n_batch=512, n_threads=spec["threads"],
                    n_threads_batch=spec["threads"], verbose=False)
        load = time.perf_counter() - t

        def decode(count):
            out = []
            for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                out.append(int(tok))
                if len(out) == count:
                    return out

        def prefill():
            llm.reset()
            llm.eval(long_prompt)
    else:
        torch.set_num_threads(spec["threads"])
        from decoderlab.chat import load_model

        model = load_model(spec["path"], dtype=spec["dtype"]).model  # the one loader, as the command reads it
        if spec["mode"] == "aot":
            model.compile_decode(mode="aot", cache_dir=spec["cache"])
        load = time.perf_counter() - t

        def decode(count):
            return generate(model, prompt, count, temperature=0, stop_at_eos=False)[-count:]

        def prefill():
            with torch.inference_mode():
                model(torch.tensor([long_prompt]), cache=KVCache.for_model(model), last_only=True, check_ids=False)
    decode(4)  # warm
    s, tokens = timed(lambda: decode(n))
    p, _ = timed(prefill)
    batch = None
    if spec["who"] == "ours" and spec["mode"] == "eager":  # a step of 8 rows (the server's, the rollouts') vs 1
        from decoderlab.generation import generate_batch

        # the decode steps alone: each call less the same call for one token (its prompt's prefill and set-up),
        # so 8 prompts' prefill of 8x the rows does not count as stepping
        def rows8(count):
            return generate_batch(model, [prompt] * 8, count, temperature=0, stop_at_eos=False)

        b8, b1, s1 = timed(lambda: rows8(n))[0], timed(lambda: rows8(1))[0], timed(lambda: decode(1))[0]
        batch = (b8 - b1) / (s - s1)
    # VmHWM, not ru_maxrss: Linux keeps the parent's high-water mark in ru_maxrss across the exec
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"load_s": load, "decode": n / s, "prompt": len(long_prompt) / p, "peak": peak,
                      "tokens": tokens, "batch8": batch}), flush=True)


def _spawn(spec: dict, src: str | None) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    if src:
        env["PYTHONPATH"] = src
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--run-one", json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=3600)
    lines = [s for s in r.stdout.splitlines() if s.startswith("{")]
    if r.returncode or not lines:
        print(f"  {spec['name']}: failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:] or ''}")
        return None
    return json.loads(lines[-1])


def table_files(path: str, tmp: str, llama: bool, kinds: str = "") -> dict[str, str]:
    """{kind: GGUF path}: the file itself, and ours of its float32 weights written as each of
    :data:`TABLE_FILES` (the same weights in every row); a Q4_K_M by llama.cpp's quantizer where it is. ``kinds``
    (comma-separated): only those written (``--kinds``; "the file's own type" alone writes none)."""
    from decoderlab.gguf import load_gguf

    files = {file_type(path): path}
    wanted = set(kinds.split(",")) if kinds else set(TABLE_FILES) | {"q4_k_m"}
    wanted |= {"f32"} if "q4_k_m" in wanted else set()  # (llama.cpp quantizes the F32 file)
    if not wanted - set(files):
        return files
    model, tok, _ = load_gguf(path, dtype="float32")
    for kind, dtype in ((k, d) for k, d in TABLE_FILES.items() if k in wanted):
        files[kind] = os.path.join(tmp, f"{kind}.gguf")
        to_gguf(model, tok, files[kind], dtype=dtype, modelfile=False)
    if llama and "q4_k_m" in wanted and "f32" in files:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        files["q4_k_m"] = os.path.join(tmp, "q4_k_m.gguf")
        if llama_cpp.llama_model_quantize(files["f32"].encode(), files["q4_k_m"].encode(), params) != 0:
            print("llama.cpp's quantizer failed: no Q4_K_M row")
            files.pop("q4_k_m")
    return files


def issue_table(path: str, args, tmp: str) -> None:
    """The issue's table for the GGUF file at ``path``: for each kind of file, llama.cpp and ours (the default
    load, ``--dtype auto``; and ``--ours-aot``'s AOT step), plus the old path (``--old-src``: another checkout's
    ``src``, its default load and its block dtype eager); ``--repeats`` rounds, each variant a fresh process in
    turn; medians."""
    llama = llama_cpp_available()
    files = table_files(path, tmp, llama, args.kinds)
    if args.kinds:
        files = {k: f for k, f in files.items() if k in args.kinds.split(",")}
    from decoderlab.gguf import load_gguf

    tok = load_gguf(path)[1]
    text = dl.read_corpus()
    ids = tok.encode(text[len(text) // 2:len(text) // 2 + 4000])
    base = dict(threads=args.threads, new_tokens=args.new_tokens, prompt=ids[:args.prompt_tokens],
                long_prompt=ids[:args.prefill_tokens], cache=os.path.join(tmp, "aot"))
    variants = []
    for kind, f in files.items():
        if llama:
            variants.append(({**base, "name": f"llama.cpp {kind}", "who": "llama.cpp", "path": f}, None))
        variants.append(({**base, "name": f"ours {kind}", "who": "ours", "path": f, "dtype": None,
                          "mode": "eager"}, None))
        if kind in args.ours_aot.split(","):
            variants.append(({**base, "name": f"ours {kind} aot", "who": "ours", "path": f, "dtype": None,
                              "mode": "aot"}, None))
        if args.old_src:
            for dtype in [None]:  # (the old block dtypes eager: 1.2-4.8 tok/s, left out for time)
                variants.append(({**base, "name": f"old {kind}" + (f" --dtype {dtype}" if dtype else " (default)"),
                                  "who": "ours", "path": f, "dtype": dtype, "mode": "eager"}, args.old_src))
    for spec, src in variants:  # an AOT package compiles here, once, timed apart
        if spec.get("mode") == "aot":
            got = _spawn(spec, src)
            print(f"  {spec['name']}: compile + load {got['load_s']:.0f} s" if got else "")
    runs = {spec["name"]: [] for spec, _ in variants}
    for r in range(args.repeats):
        for spec, src in variants:
            got = _spawn(spec, src)
            if got is None and spec["who"] == "llama.cpp" and spec.get("extra_bufts", True) \
                    and {"amx_int8", "amx_tile"} & set(cpu_features()):
                # llama.cpp's AMX int8 kernel segfaults on some CPUs (ggml-org/llama.cpp#20824): its rows from
                # here on without the extra buffer types, said under the table
                spec["extra_bufts"] = False
                print(f"  {spec['name']}: again without llama.cpp's extra buffer types (AMX, repacked int8)")
                got = _spawn(spec, src)
            if got:
                runs[spec["name"]].append(got)
        print(f"  round {r + 1} of {args.repeats} done", flush=True)
    print_issue_table(path, files, runs, args, [spec for spec, _ in variants])


def print_issue_table(path: str, files: dict, runs: dict, args, specs: list) -> None:
    def med(name, key):
        return statistics.median(g[key] for g in runs[name]) if runs.get(name) else None

    print(f"\n{os.path.basename(path)}: decode {args.new_tokens} greedy tokens after {args.prompt_tokens}, prompt "
          f"{args.prefill_tokens} tokens; each variant a fresh process per round, {args.repeats} interleaved rounds, "
          f"medians; ratios against llama.cpp on the same file")
    print("| file | variant | decode tok/s | vs llama.cpp | prompt tok/s | vs llama.cpp | peak MB | vs llama.cpp | "
          "load s | greedy = llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, f in files.items():
        ref = f"llama.cpp {kind}"
        for name in [n for n in runs if n == ref or n.split()[1] == kind]:
            if not runs[name]:
                print(f"| {kind} | {name} | (failed) | | | | | | | |")
                continue
            d, p, m, ld = (med(name, k) for k in ("decode", "prompt", "peak", "load_s"))
            rd, rp, rm = (med(ref, k) for k in ("decode", "prompt", "peak"))
            same = ""
            if runs.get(ref) and name != ref:
                a, b = runs[name][0]["tokens"], runs[ref][0]["tokens"]
                same = f"{sum(x == y for x, y in zip(a, b)) / len(b):.0%}"
            ratio = lambda x, y: f"{x / y:.2f}x" if y and name != ref else ""  # noqa: E731
            print(f"| {kind} | {name} | {d:.1f} | {ratio(d, rd)} | {p:.0f} | {ratio(p, rp)} | {m / 1e6:.0f} | "
                  f"{ratio(m, rm)} | {ld:.1f} | {same} |")
    plain = [s["name"] for s in specs if s.get("extra_bufts") is False]
    if plain:
        print("without llama.cpp's extra buffer types (its AMX int8 kernel crashed, ggml-org/llama.cpp#20824): "
              + ", ".join(plain))
    steps = [(n, statistics.median(g["batch8"] for g in got)) for n, got in runs.items()
             if got and got[0].get("batch8")]
    if steps:
        print("a decode step of 8 rows over one of 1 row (target <= 2.5x): "
              + ", ".join(f"{n} {r:.2f}x" for n, r in steps))


def agreement(path: str, args) -> None:
    """Greedy top-1 agreement over ``--agreement`` teacher-forced tokens of held-out text (the second half of the
    embedded corpus): ours by default (``--dtype auto``: the decode step's products, one token at a time through
    the KV cache) against ours float32 (the dequantized weights) and llama.cpp on the same file (its logits of
    every position from one batched evaluation, and from one token a step)."""
    from decoderlab.gguf import load_gguf

    text = dl.read_corpus()
    tok = load_gguf(path)[1]
    ids = tok.encode(text[len(text) // 2:])[:args.agreement + 1]
    top = {}
    for name, dtype in (("ours default", None), ("ours float32", "float32")):
        model = load_gguf(path, dtype=dtype)[0]
        cache, picks = KVCache.for_model(model), []
        with torch.inference_mode():
            for t in range(len(ids) - 1):  # the engine's step (model.decode: the fused C++ step where it applies)
                out = model.decode(torch.tensor([[ids[t]]]), cache.length, None, cache)
                cache.advance(1)
                picks.append(int(out[0].argmax()))
        top[name] = picks
    if llama_cpp_available():
        import numpy as np
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=len(ids) + 8, n_batch=512, n_threads=args.threads,
                    n_threads_batch=args.threads, logits_all=True, verbose=False)
        llm.eval(ids[:-1])
        top["llama.cpp"] = [int(i) for i in np.asarray(llm.scores[:len(ids) - 1]).argmax(-1)]
        llm.reset()  # and a token a step, as its decoding runs: its own two paths differ in the last bits too
        for i in ids[:-1]:
            llm.eval([i])
        top["llama.cpp a token a step"] = [int(i) for i in np.asarray(llm.scores[:len(ids) - 1]).argmax(-1)]
    print(f"\ngreedy top-1 agreement, {os.path.basename(path)}, {len(ids) - 1} teacher-forced tokens of held-out "
          f"text (ours one token a step, as decoding runs)")
    names = list(top)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = sum(x == y for x, y in zip(top[a], top[b]))
            print(f"  {a} = {b}: {same / len(top[a]):.1%} ({same} of {len(top[a])})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="small,gpt2", help="small, gpt2 and/or paths of GGUF files")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=14)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--ours", default=OURS, help=f"MODE:DTYPE items (default {OURS})")
    ap.add_argument("--theirs", default=THEIRS, help=f"llama.cpp types of the same weights (default {THEIRS})")
    ap.add_argument("--checkpoint", default=None, help="a trained GPT-2-shaped checkpoint: the accuracy table")
    ap.add_argument("--text", default=None, help="held-out text for a GGUF file's accuracy (its last 10%%; default: "
                                                 "the embedded tinyshakespeare)")
    ap.add_argument("--ppl-windows", type=int, default=16)
    ap.add_argument("--ppl-len", type=int, default=256)
    ap.add_argument("--skip-speed", action="store_true", help="only the accuracy tables")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", default=None, help="a GGUF file: issue 46's table (fresh process per variant and "
                                                  "round: load time, peak memory, decode, prompt), then exit")
    ap.add_argument("--kinds", default="", help="--table: only these kinds of file (q4_1,q8_0,...; default all)")
    ap.add_argument("--ours-aot", default="", help="kinds of file (--table) whose AOT step is measured too")
    ap.add_argument("--old-src", default=None, help="another checkout's src/ (--table): its default load and block "
                                                    "dtype eager as the old path")
    ap.add_argument("--agreement", type=int, default=0, help="with --table: greedy top-1 agreement over this many "
                                                             "teacher-forced tokens")
    if "--run-one" in sys.argv:
        return run_one()
    args = ap.parse_args()
    if args.worker:
        return worker()
    if args.table:
        torch.set_num_threads(args.threads)
        print(machine_line(args.threads))
        with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
            if args.repeats:
                issue_table(args.table, args, tmp)
            if args.agreement:
                agreement(args.table, args)
        print("load average after: %.1f %.1f %.1f" % os.getloadavg())
        return None
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads))
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        shapes = args.shapes.split(",")
        tok = gpt2_vocab() if not args.skip_speed and set(shapes) & set(SHAPES) else None
        for shape in ([] if args.skip_speed else shapes):
            if shape in SHAPES:
                calls, prompt, running = synthetic(shape, tok, tmp, args)
                s = SHAPES[shape]
                title = f"{shape}: {s['n_layer']} layers, d_model {s['d_model']}, vocabulary {VOCAB:,}, random weights"
            else:
                calls, prompt, running = gguf_file(shape, tmp, args)
                title = f"{os.path.basename(shape)} (llama.cpp reads the file; ours loads it at each dtype)"
            try:
                report(title, calls, running, args, prompt)
            finally:
                for p in running.values():
                    p.close()
        for source in [args.checkpoint] * bool(args.checkpoint) + [s for s in shapes if s.endswith(".gguf")]:
            accuracy(source, args, tmp)
    print("load average after: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
