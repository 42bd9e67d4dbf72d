"""The GPU check: what decoderlab does on one CUDA GPU, in one run of under 8 minutes.

    python bench/gpu_check.py [--steps 200] [--preset baby-shakespeare] [--out DIR]
    python bench/gpu_check.py --dry-run     # the same parts, tiny, on the CPU: checks the script itself

Parts, each printed as a row of one table (a part that fails prints its one-line error and the rest go on):

1. training: ``--steps`` steps of the default recipe at bf16-mixed, eager and with ``compile=True``:
   tokens/s, MFU (6 N + 12 L T d FLOPs per token against the GPU's dense bf16 peak, when the GPU is one of
   those in ``PEAK_BF16``), peak memory (``torch.cuda.max_memory_allocated``), final loss;
2. FSDP on 1 device (``strategy="fsdp"``: decoderlab's FSDP2 strategy), a quarter of the steps;
3. batch-1 greedy decode, eager vs compiled (``model.compile_decode()``), tokens/s, on the trained model;
4. ``generate``, ``chat`` and ``serve`` end to end through the command line with ``--device cuda``;
5. ``torch.cuda.set_sync_debug_mode("error")`` around a steady training step (not a logging step) and a
   decode step: any host sync there raises, and the row names it.

``--dry-run`` runs every part on the CPU with a tiny model and a few steps (float32, compile with the "eager"
backend, no sync-debug mode: it is CUDA's), so that the script is known to work before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import torch

import decoderlab as dl
from decoderlab.config.defaults import TRAIN_DEFAULTS
from decoderlab.generation import KVCache, generate

#: dense bfloat16 peak FLOP/s by GPU name (NVIDIA's data sheets, SXM parts, no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12,
             "RTX 4090": 165e12, "RTX 3090": 71e12, "T4": 65e12, "V100": 125e12}
NEW_TOKENS = 255
ROWS: list[tuple[str, str]] = []


def row(part: str, result: str) -> None:
    ROWS.append((part, result))
    print(f"{part}: {result}", flush=True)


def part(name: str):
    """Run a part; a failure becomes its row (one line) and the check goes on."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- reported as the part's row
                traceback.print_exc()
                row(name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                return None
        return run
    return wrap


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(cfg) -> float:
    n = sum(p.numel() for p in dl.DecoderOnlyTransformer(cfg).parameters())
    return 6 * n + 12 * cfg.n_layer * cfg.max_len * cfg.d_model


def precision(args) -> str:
    return "32" if args.dry_run else "bf16-mixed"


def train_kwargs(args, out: Path, **more) -> dict:
    small = dict(n_layer=1, n_head=2, d_model=32, max_len=32) if args.dry_run else {}
    overrides = dict(max_steps=args.steps, eval_every=args.steps, val_batches=1, precision=precision(args))
    overrides.update(more.pop("config", {}))
    overrides["warmup"] = min(TRAIN_DEFAULTS["warmup"], overrides["max_steps"] // 4)
    return dict(preset=args.preset, out=str(out), progress_bar=False, logger=False,
                accelerator="cpu" if args.dry_run else "cuda", model_overrides=small or None,
                config_overrides=overrides, **more)


def train_row(args, name: str, out: Path, **more):
    @part(name)
    def run():
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        model, tok, s = dl.train_lm(**train_kwargs(args, out, **more))
        mem = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if torch.cuda.is_available() else "n/a"
        peak = peak_flops()
        mfu = f"{flops_per_token(model.config) * s.tokens_per_second / peak:.1%}" if peak else "n/a"
        row(name, f"{s.tokens_per_second:,.0f} tokens/s, MFU {mfu}, peak memory {mem}, train loss "
                  f"{s.train_loss:.3f}, {s.steps} steps on {s.device}")
        return model, tok
    return run()


@part("decode batch 1, eager vs compiled")
def decode_row(args, model) -> None:
    device = "cpu" if args.dry_run else "cuda"
    model = model.to(device).eval()
    options = dict(backend="eager") if args.dry_run else {}

    def timed(n_runs: int = 3) -> float:
        times = []
        for _ in range(n_runs):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            generate(model, [1], NEW_TOKENS, temperature=0)
            times.append(time.perf_counter() - t)
        return NEW_TOKENS / sorted(times)[len(times) // 2]

    model.compiled_decode = None
    want = generate(model, [1], NEW_TOKENS, temperature=0)
    eager = timed()
    t = time.perf_counter()
    model.compile_decode(**options)
    got = generate(model, [1], NEW_TOKENS, temperature=0)
    compile_s = time.perf_counter() - t
    compiled = timed()
    model.compiled_decode = None
    row("decode batch 1, eager vs compiled",
        f"eager {eager:,.0f} tokens/s, compiled {compiled:,.0f} tokens/s ({compiled / eager:.2f}x; compile "
        f"{compile_s:.0f} s), same tokens: {'yes' if got == want else 'NO'}")


def cli(*argv, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decoderlab.cli", *map(str, argv)], input=stdin, text=True,
                          capture_output=True, timeout=timeout, check=False)


@part("generate, chat, serve end to end")
def end_to_end_row(args, run_dir: Path) -> None:
    device = "cpu" if args.dry_run else "cuda"
    results = []
    r = cli("generate", "--checkpoint", run_dir, "--device", device, "--max-new-tokens", 20, "--seed", 1, "ROMEO:")
    results.append(f"generate rc {r.returncode} ({len(r.stdout)} chars)")
    r = cli("generate", "--checkpoint", run_dir, "--device", device, "--compile", "--max-new-tokens", 20,
            "--seed", 1, "ROMEO:")
    results.append(f"generate --compile rc {r.returncode}")
    r = cli("chat", "--checkpoint", run_dir, "--device", device, "--max-new-tokens", 10, stdin="hello\n")
    results.append(f"chat rc {r.returncode}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "serve", "--checkpoint", str(run_dir),
                             "--device", device, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        results.append(f"serve /v1/completions {reply['usage']['completion_tokens']} tokens")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    row("generate, chat, serve end to end", f"on {device}: " + "; ".join(results))


def sync_debug_callback(step: int, seen: dict):
    import lightning as L

    class SyncDebug(L.Callback):  # a steady step: the sync-debug mode on from its start to its end
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step + 1 == step:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, *a):
            if torch.cuda.get_sync_debug_mode():
                torch.cuda.set_sync_debug_mode(0)
                seen["step"] = step

    return SyncDebug()


@part("sync debug: a steady training step and a decode step")
def sync_row(args, model, out: Path) -> None:
    if args.dry_run:
        row("sync debug: a steady training step and a decode step", "n/a on the CPU (CUDA's sync-debug mode)")
        return
    log_every = TRAIN_DEFAULTS["log_every"]
    seen: dict = {}
    steps = log_every + 3
    dl.train_lm(**train_kwargs(args, out, callbacks=[sync_debug_callback(log_every + 2, seen)],
                               config=dict(max_steps=steps, eval_every=steps)))
    model = model.to("cuda").eval()
    cache = KVCache.for_model(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]], device="cuda"), cache=cache, check_ids=False)
        positions = torch.full((1,), cache.length, dtype=torch.long, device="cuda")
        tokens = torch.tensor([[4]], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model.decode(tokens, positions, None, cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    row("sync debug: a steady training step and a decode step",
        f"no sync in training step {seen.get('step')} nor in a decode step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default=None, help="a preset or recipe (default: train_lm's default)")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--dry-run", action="store_true", help="every part tiny, on the CPU")
    args = ap.parse_args()
    if args.dry_run:
        args.steps = min(args.steps, 4)
    elif not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here (run with --dry-run to check the script on the CPU)")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "CPU (dry run)"
    print(f"gpu_check on {where}, torch {torch.__version__}, {args.steps} steps", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(args.out or tmp)
        trained = train_row(args, f"train {precision(args)}, eager", out / "eager")
        train_row(args, f"train {precision(args)}, compiled", out / "compiled",
                  config=dict(compile="eager" if args.dry_run else True))
        small = max(2, args.steps // 4)
        train_row(args, "train FSDP on 1 device", out / "fsdp", strategy="fsdp", devices=1,
                  config=dict(max_steps=small, eval_every=small))
        if trained is not None:
            decode_row(args, trained[0])
            end_to_end_row(args, out / "eager")
            sync_row(args, trained[0], out / "sync")
    print(f"\n| part | result |\n|---|---|")
    for name, result in ROWS:
        print(f"| {name} | {result} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    sys.exit(1 if any("FAILED" in r for _, r in ROWS) else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
