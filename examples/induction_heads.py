"""Watch an induction head form: a 2-layer attention-only model trained on random tokens that repeat.

    python examples/induction_heads.py                  # 1-2 minutes on a laptop CPU
    python examples/induction_heads.py --out runs/induction --png docs/img/induction_heads.png

Each training sequence is L random tokens followed by the same L tokens again (Olsson et al. 2022, "In-context
Learning and Induction Heads"). The first half cannot be predicted (ln V nats per token); the second half can,
by a two-head circuit: a previous-token head in layer 0 writes "the token before me" into each position, and an
induction head in layer 1 finds the earlier copy of the current token and attends to the token after it.
``decoderlab.headwatch.HeadWatch`` records every head's scores and the loss every few steps into the run
directory; the plot shows the loss falling from ln V towards half of it in the same steps in which a layer-1
head's induction score rises.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

import decoderlab as dl
from decoderlab.glassbox import head_scores, repeated_tokens
from decoderlab.glassbox.plotting import save_head_scores_png
from decoderlab.glassbox.watching import formation_steps, read_records, watch_table
from decoderlab.training import LitModel
from decoderlab.headwatch import HeadWatch


class RepeatedTokens(torch.utils.data.IterableDataset):
    """Endless (inputs, labels) batches: ``length`` random tokens, then the same tokens again."""

    def __init__(self, num_tokens: int, length: int, batch: int, seed: int):
        self.num_tokens, self.length, self.batch, self.seed = num_tokens, length, batch, seed

    def __iter__(self):
        step = 0
        while True:
            seq = repeated_tokens(self.num_tokens, self.length, batch=self.batch, seed=self.seed * 1_000_003 + step)
            step += 1
            yield seq[:, :-1], seq[:, 1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=10, help="record head scores every this many steps")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--length", type=int, default=16, help="random tokens before they repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory (default: a temporary one)")
    p.add_argument("--png", default="induction_heads.png")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    cfg = dl.ModelConfig(num_tokens=args.vocab, d_model=64, n_layer=2, n_head=4, max_len=2 * args.length,
                         norm="layernorm", position="learned", mlp="none", attn_out_proj=True, attention="sdpa")
    model = dl.DecoderOnlyTransformer(cfg, lr=3e-3)  # the lesson's Adam (LitModel without a TrainConfig)
    run_dir = Path(args.out or tempfile.mkdtemp(prefix="induction-"))
    data = torch.utils.data.DataLoader(RepeatedTokens(args.vocab, args.length, 32, args.seed), batch_size=None)
    trainer = L.Trainer(max_steps=args.steps, callbacks=[HeadWatch(run_dir, every=args.every)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    start = time.perf_counter()
    trainer.fit(LitModel(model), data)
    seconds = time.perf_counter() - start

    records = read_records(run_dir)
    print(watch_table(records))
    formed = {k: s for k, s in formation_steps(records).items() if s is not None}
    probe = repeated_tokens(args.vocab, args.length, batch=8, seed=12345)
    prev = head_scores(model, probe, "previous_token")
    print(f"trained {args.steps} steps in {seconds:.0f} s; ln V = {math.log(args.vocab):.3f} nats")
    print(f"heads that became induction heads (step): {formed or 'none'}; "
          f"strongest previous-token head: L{int(prev.argmax()) // cfg.n_head}H{int(prev.argmax()) % cfg.n_head} "
          f"({float(prev.max()):.2f})")
    print(f"wrote {save_head_scores_png(records, args.png, title='induction heads forming (2-layer attention-only)')}"
          f" from {run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
