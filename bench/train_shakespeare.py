"""Benchmark: the nanoGPT baby recipe (``decoderlab train --preset baby-shakespeare-nanogpt``; the default
before the speedrun recipe) -- baby-shakespeare, char level, embedded tinyshakespeare.

Prints the validation loss every 250 steps (full validation: all non-overlapping windows of the last 10%),
wall time, training tokens per second, peak resident memory and MFU (model FLOP/s over this machine's matmul
FLOP/s, measured here in fp32 and bf16), and -- in the same process, same shape, same optimizer, same batches --
Hugging Face ``GPT2LMHeadModel`` trained for 100 steps, for a tokens-per-second ratio. Targets:
validation loss <= 1.88 nats within 2,000 steps; tokens/s >= 3x Hugging Face's; peak memory < 1 GB.

    .venv/bin/python bench/train_shakespeare.py [--steps 2000] [--compare-steps 100] [--threads N] [--bf16]
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def matmul_gflops(dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Median GFLOP/s of (m x k) @ (k x n) in ``dtype`` over ~``seconds``."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times) / 1e9


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 N (forward + backward of the non-embedding weights and the output layer)
    plus attention's 12 * n_layer * d_model * T (PaLM appendix B / nanoGPT's estimate)."""
    n = 12 * cfg.n_layer * cfg.d_model ** 2 + cfg.num_tokens * cfg.d_model
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.max_len


def plain_loop_tokens_per_second(model, batches, cfg, steps: int, logits_of) -> float:
    """Tokens/s of a bare PyTorch loop (no Lightning): AdamW as decoderlab's, grad clip, lr schedule."""
    from decoderlab.training import lr_at

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n
             and not n.startswith(("we.", "pe."))]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / cfg.lr)
    bf16 = cfg.precision == "bf16-mixed"
    model.train()
    start, tokens = None, 0
    for step in range(steps):
        if step == 10:  # the first steps allocate; time the rest
            start, tokens = time.perf_counter(), 0
        x, y = batches[step]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        tokens += y.numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--compare-steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--position", default=None, help="override the preset's position encoding (e.g. rope)")
    ap.add_argument("--bf16", action="store_true", help="also train the comparisons with bf16 autocast")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from decoderlab.data import RandomWindowBatches, read_corpus, split_tokens, corpus_tokens
    from decoderlab.model import preset
    from decoderlab.tokenizers import CharTokenizer
    from decoderlab.training import TrainConfig, train_lm

    peak = {torch.float32: matmul_gflops(torch.float32, 2048, 2048, 2048),
            torch.bfloat16: matmul_gflops(torch.bfloat16, 1024, 1024, 1024)}
    baby = {dt: matmul_gflops(dt, 768, 128, 512) for dt in (torch.float32, torch.bfloat16)}

    cfg = TrainConfig(max_steps=args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    t0 = time.perf_counter()
    overrides = {"position": args.position} if args.position else None
    model, tok, s = train_lm(out=tmp / "run", preset="baby-shakespeare", train_config=cfg, progress_bar=False,
                             cache_dir=tmp / "cache",
                             model_overrides=overrides)
    wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mcfg = model.config
    fpt = flops_per_token(mcfg)

    # the same shape, optimizer and batches in bare loops: decoderlab's model, Hugging Face's GPT2LMHeadModel
    from transformers import GPT2Config, GPT2LMHeadModel

    text = read_corpus(None)
    tokc = CharTokenizer.from_text(text)
    train_tokens, _ = split_tokens(corpus_tokens(text, tokc, tmp / "cache"), 0.1)
    windows = RandomWindowBatches(train_tokens, mcfg.max_len, cfg.batch_size, seed=cfg.seed)
    batches = [windows[k] for k in range(args.compare_steps)]
    rows = []
    for precision in ("32", "bf16-mixed") if args.bf16 else ("32",):
        c = cfg.replace(precision=precision)
        torch.manual_seed(0)
        from decoderlab.model import DecoderOnlyTransformer

        ours = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tokc.vocab_size))
        ours_tps = plain_loop_tokens_per_second(ours, batches, c, args.compare_steps, lambda m, x: m(x))
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=tokc.vocab_size, bos_token_id=None, eos_token_id=None, n_positions=mcfg.max_len, n_embd=mcfg.d_model,
                                        n_layer=mcfg.n_layer, n_head=mcfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0, tie_word_embeddings=True))
        hf_tps = plain_loop_tokens_per_second(hf, batches, c, args.compare_steps, lambda m, x: m(input_ids=x).logits)
        lit_tps = None
        if precision == "bf16-mixed":  # decoderlab train --precision bf16-mixed, same number of steps
            _, _, sb = train_lm(out=tmp / "bf16", preset="baby-shakespeare", train_config=c.replace(max_steps=args.compare_steps,
                                                                           eval_every=args.compare_steps),
                                progress_bar=False, cache_dir=tmp / "cache")
            lit_tps = sb.tokens_per_second
        rows.append((precision, ours_tps, hf_tps, lit_tps))

    hf32 = rows[0][2]
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; matmul peak: fp32 (2048^3) "
          f"{peak[torch.float32]:.1f} GFLOP/s, bf16 (1024^3) {peak[torch.bfloat16]:.1f} GFLOP/s; at the baby shape "
          f"(768x128x512): fp32 {baby[torch.float32]:.1f}, bf16 {baby[torch.bfloat16]:.1f} GFLOP/s; "
          f"model: {s.num_parameters:,} parameters, {fpt / 1e6:.2f} MFLOP per training token\n")
    print("| step | " + " | ".join(str(st) for st, _ in s.val_history) + " |")
    print("|---|" + "---|" * len(s.val_history))
    print("| validation loss (nats, all windows) | " + " | ".join(f"{v:.4f}" for _, v in s.val_history) + " |")
    print()
    print("| run | steps | wall s | train tokens/s | vs HF fp32 | MFU vs fp32 peak | MFU vs bf16 peak | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| decoderlab train (defaults, fp32, Lightning) | {s.steps} | {wall:.1f} | {s.tokens_per_second:,.0f} | "
          f"{s.tokens_per_second / hf32:.2f}x | {s.tokens_per_second * fpt / 1e9 / peak[torch.float32]:.1%} | "
          f"{s.tokens_per_second * fpt / 1e9 / peak[torch.bfloat16]:.1%} | {rss_mb:.0f} |")
    for precision, ours_tps, hf_tps, lit_tps in rows:
        pk = peak[torch.float32 if precision == "32" else torch.bfloat16]
        if lit_tps is not None:
            print(f"| decoderlab train --precision {precision} | {args.compare_steps} | | {lit_tps:,.0f} | "
                  f"{lit_tps / hf32:.2f}x | {lit_tps * fpt / 1e9 / peak[torch.float32]:.1%} | "
                  f"{lit_tps * fpt / 1e9 / peak[torch.bfloat16]:.1%} | |")
        for name, tps in ((f"decoderlab model, bare loop, {precision}", ours_tps),
                          (f"HF GPT2LMHeadModel, bare loop, {precision}", hf_tps)):
            print(f"| {name} | {args.compare_steps} | | {tps:,.0f} | {tps / hf32:.2f}x | "
                  f"{tps * fpt / 1e9 / peak[torch.float32]:.1%} | {tps * fpt / 1e9 / peak[torch.bfloat16]:.1%} | |")
    final = s.val_history[-1][1]
    print(f"\nfinal validation loss {final:.4f} nats (target <= 1.88: {'met' if final <= 1.88 else 'missed'}); "
          f"tokens/s {s.tokens_per_second / hf32:.2f}x HF fp32 (target >= 3x); peak RSS {rss_mb:.0f} MB "
          f"(target < 1024); perplexity {math.exp(final):.2f}, {s.val_bpb:.3f} bits per byte")


if __name__ == "__main__":
    main()
