"""Decode speed: decoderlab's KV-cache generation vs the no-cache loop vs Hugging Face ``generate``.

The ``shakespeare-char`` preset shape (6 layers, 6 heads, d_model 384, context 256, vocabulary 65) with random
weights, 255 new tokens from a 1-token prompt (filling the context exactly), greedy, batch 1 and batch 8:

    (a) ``decoderlab.generate`` / ``generate_batch`` with the KV cache,
    (b) the same with ``use_cache=False`` (the lesson's loop: the whole sequence through the model per token),
    (c) ``transformers.GPT2LMHeadModel.generate`` with the same weights (converted with ``decoderlab.hf.to_gpt2``),
        with its own KV cache.

All in one run; decode tokens/second = new tokens (batch x 255) / wall seconds of the whole call, median of
the repeats. Prints one table with the ratios, and whether the three produced the same tokens.

    python bench/generate.py [--threads N] [--repeats R] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import decoderlab as dl
from decoderlab.generation import generate, generate_batch
from decoderlab.hf import to_gpt2

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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer("shakespeare-char").eval()
    hf = to_gpt2(model).eval()
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
    small_hf = to_gpt2(small).eval()
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


if __name__ == "__main__":
    main()
