"""The CPU speedrun: time to a full validation loss of 1.88 nats on tinyshakespeare (char level).

In one run, with the same number of intra-op threads:

    (a) the reference: nanoGPT's CPU "baby" recipe reproduced on Hugging Face ``GPT2LMHeadModel`` in a bare
        PyTorch loop -- 4 layers, 4 heads, d_model 128, context 64, batch 12, AdamW lr 1e-3 betas (0.9, 0.99)
        weight decay 0.1 on matrices, gradient clip 1.0, warm-up 100, cosine to 1e-4 over 2,000 steps, no
        dropout; the same 90/10 split by position and the same random training windows as decoderlab;
    (b) the default ``decoderlab train`` command (its default recipe), as a subprocess.

Validation loss is nats per token over *all* non-overlapping 64-token windows of the last 10% ("full-val").
Evaluation counts in the wall time and is kept cheap: while training, a fixed subset (the first 4 x 64
windows); all windows at the end and, for (a), whenever the subset is within ``--margin`` of the target.
(b) logs its evaluations with wall-clock times in ``summary.json`` (``eval_log``). For each: wall time of the
whole run ((b): from launching the process, imports included), the full-val losses as they come, and the wall
time at which full-val first reached the target. Prints the side-by-side table and the ratio (b)/(a).

``--threads-check`` adds item 3's row: a short default command (``--max-steps``) while another process keeps a
core busy, with automatic threads vs ``--threads 1`` vs ``--threads 2``.

    python bench/speedrun.py [--threads N] [--target 1.88] [--ref-steps 2000] [--threads-check]
                             [--train-args "..."] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SUBSET_WINDOWS = 256


def load() -> float:
    return os.getloadavg()[0]


def reference_run(steps: int, target: float, margin: float, eval_every: int, cache: Path) -> dict:
    """(a): nanoGPT's baby recipe on HF GPT2LMHeadModel in a bare loop; returns the timings and losses."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from decoderlab.data import RandomWindowBatches, SequentialWindows, corpus_tokens, read_corpus, split_tokens
    from decoderlab.tokenizers import CharTokenizer

    text = read_corpus(None)
    tok = CharTokenizer.from_text(text)
    train, val = split_tokens(corpus_tokens(text, tok, cache), 0.1)
    t0 = time.perf_counter()
    torch.manual_seed(42)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=tok.vocab_size, n_positions=64, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), fused=True)
    warmup, lr, min_lr = 100, 1e-3, 1e-4

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        r = min(1.0, (s - warmup) / max(1, steps - warmup))
        return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (lr - min_lr)

    batches = RandomWindowBatches(train, 64, 12, seed=42)
    full = SequentialWindows(val, 64, 64)

    @torch.no_grad()
    def evaluate(n_batches=None):
        model.eval()
        tot = cnt = 0
        for j in range(len(full) if n_batches is None else min(n_batches, len(full))):
            x, y = full[j]
            logits = model(input_ids=x).logits
            tot += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
            cnt += y.numel()
        model.train()
        return tot / cnt

    log, reached = [], None
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batches[step]
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % eval_every == 0 or done == steps:
            sub = evaluate(SUBSET_WINDOWS // 64)
            log.append({"step": done, "seconds": time.perf_counter() - t0, "val_loss": sub, "windows": "subset"})
            if done == steps or (reached is None and sub <= target + margin):
                v = evaluate()
                log.append({"step": done, "seconds": time.perf_counter() - t0, "val_loss": v, "windows": "all"})
                if reached is None and v <= target:
                    reached = log[-1]
    wall = time.perf_counter() - t0
    return {"wall": wall, "log": log, "reached": reached, "final": log[-1]["val_loss"], "steps": steps}


def decoderlab_run(threads: int | None, extra: list[str], target: float, out: Path) -> dict:
    """(b): the default ``decoderlab train`` command as a subprocess; timings from its summary.json."""
    cmd = [sys.executable, "-m", "decoderlab.cli", "train", "--out", str(out), "--no-progress-bar", *extra]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    unix0, t0 = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"decoderlab train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    log = [{**e, "seconds": e["unix_time"] - unix0} for e in s["eval_log"]]
    reached = next((e for e in log if e["windows"] == "all" and e["val_loss"] <= target), None)
    return {"wall": wall, "log": log, "reached": reached, "final": s["val_loss"], "steps": s["steps"],
            "tokens_per_second": s["tokens_per_second"], "cmd": " ".join(shlex.quote(c) for c in cmd[1:])}


def busy_process() -> subprocess.Popen:
    """Another process keeping one core busy (a pure-Python spin loop), until terminated."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads for both runs (default: decoderlab.threads.choose_threads())")
    ap.add_argument("--target", type=float, default=1.88)
    ap.add_argument("--margin", type=float, default=0.05, help="(a): full evaluation when subset <= target + this")
    ap.add_argument("--ref-steps", type=int, default=2000)
    ap.add_argument("--ref-eval-every", type=int, default=250)
    ap.add_argument("--train-args", default="", help="extra arguments for (b) (default: none: the default recipe)")
    ap.add_argument("--threads-check", action="store_true", help="also the --threads row under extra load")
    ap.add_argument("--check-steps", type=int, default=100)
    ap.add_argument("--skip-reference", action="store_true", help="run (b) only")
    ap.add_argument("--only-threads-check", action="store_true", help="run the --threads-check row only")
    args = ap.parse_args()

    from decoderlab.threads import choose_threads

    threads = choose_threads(args.threads)
    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-speedrun-"))
    load0 = load()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {threads} intra-op thread(s) for both runs; "
          f"load average at start {load0:.2f}", flush=True)
    if args.only_threads_check:
        threads_check(args, tmp)
        return
    a = None if args.skip_reference else reference_run(args.ref_steps, args.target, args.margin,
                                                         args.ref_eval_every, tmp / "cache")
    load1 = load()
    b = decoderlab_run(threads, shlex.split(args.train_args), args.target, tmp / "run")
    load2 = load()

    def curve(r):
        return ", ".join(f"{e['step']}: {e['val_loss']:.4f} @ {e['seconds']:.1f}s" for e in r["log"]
                         if e["windows"] == "all")

    def reached(r):
        return f"{r['reached']['seconds']:.1f} (step {r['reached']['step']})" if r["reached"] else "not reached"

    print(f"\nload average (1 min) at start / between / end: {load0:.2f} / {load1:.2f} / {load2:.2f}\n")
    print(f"| run | steps | wall s (whole run) | final full-val | s to full-val <= {args.target} | full-val as it goes |")
    print("|---|---:|---:|---:|---:|---|")
    if a:
        print(f"| (a) nanoGPT baby recipe, HF GPT2LMHeadModel, bare loop | {a['steps']} | {a['wall']:.1f} | "
              f"{a['final']:.4f} | {reached(a)} | {curve(a)} |")
    print(f"| (b) `decoderlab train` (default recipe) | {b['steps']} | {b['wall']:.1f} | {b['final']:.4f} | "
          f"{reached(b)} | {curve(b)} |")
    if a:
        if b["reached"]:
            ratio = b["reached"]["seconds"] / a["wall"]
            print(f"\nratio: (b)'s time to {args.target} / (a)'s wall time for {a['steps']} steps = {ratio:.2f} "
                  f"(target <= 0.5: {'met' if ratio <= 0.5 else 'missed'}); whole runs (b)/(a) = "
                  f"{b['wall'] / a['wall']:.2f}")
            if a["reached"]:
                print(f"time to {args.target}: (b)/(a) = {b['reached']['seconds'] / a['reached']['seconds']:.2f}")
        print(f"(b) final full-val {b['final']:.4f} (target <= {args.target}: "
              f"{'met' if b['final'] <= args.target else 'missed'}); (a) final {a['final']:.4f}")
    print(f"(b) command: {b['cmd']}")

    if args.threads_check:
        threads_check(args, tmp)


def threads_check(args, tmp: Path) -> None:
    """Item 3's row: the default command (short) while another process spins, automatic vs 1 vs 2 threads."""
    rows = []
    busy = busy_process()
    try:
        time.sleep(5)
        for label, th in (("default (automatic)", None), ("--threads 1", 1), ("--threads 2", 2)):
            la = load()
            r = decoderlab_run(th, ["--max-steps", str(args.check_steps)] + shlex.split(args.train_args),
                               99.0, tmp / f"threads-{th}")
            rows.append((label, la, r))
    finally:
        busy.terminate()
        busy.wait()
    print(f"\nthreads under load (another process spinning on one core), default command with --max-steps "
          f"{args.check_steps}:\n")
    print("| threads | load (1 min) before | wall s | train tokens/s | vs default |")
    print("|---|---:|---:|---:|---:|")
    for label, la, r in rows:
        print(f"| {label} | {la:.2f} | {r['wall']:.1f} | {r['tokens_per_second']:,.0f} | "
              f"{r['wall'] / rows[0][2]['wall']:.2f}x |")


if __name__ == "__main__":
    main()
