"""Screening for the speedrun ablation (docs/training.md, "Recipes and presets"): a bare training loop over
decoderlab's model for each candidate of a JSON file, full validation loss (all windows) at the listed steps.

Each candidate: "model" (ModelConfig overrides of baby-shakespeare), "opt" ("adamw" | "muon"), "lr" (AdamW),
"mlr" (Muon), "steps", "warmup", "sched" ("cos" | "wsd"), "bs", "evals" (steps with a full evaluation).
Prints one JSON line per candidate: [step, training seconds so far, full-val] at each evaluation.

    THREADS=1 PYTHONPATH=src python bench/speedrun_screen.py bench/speedrun_screen.json [NAME ...]
"""
import json, math, sys, time, os
import torch, torch.nn.functional as F
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from decoderlab.data import RandomWindowBatches, read_corpus, split_tokens, corpus_tokens, SequentialWindows
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer

text = read_corpus(None); tok = CharTokenizer.from_text(text)
tr, va = split_tokens(corpus_tokens(text, tok, "/tmp/speed-cache"), 0.1)
val = SequentialWindows(va, 64, 256); valb = [val[j] for j in range(len(val))]

@torch.no_grad()
def full_val(m):
    m.eval(); tot = n = 0
    for x, y in valb:
        l = m(x); tot += float(F.cross_entropy(l.reshape(-1, l.size(-1)), y.reshape(-1), reduction="sum")); n += y.numel()
    m.train(); return tot / n

def sched(step, c):
    w, S = c["warmup"], c["steps"]
    if step < w: return (step + 1) / w
    if c.get("sched", "cos") == "cos":
        r = min(1, (step - w) / max(1, S - w)); mn = c.get("min_ratio", 0.1)
        return mn + 0.5 * (1 + math.cos(math.pi * r)) * (1 - mn)
    cd = int(c.get("cooldown", 0.4) * S)   # WSD: flat, then linear to min_ratio over last cooldown
    if step < S - cd: return 1.0
    mn = c.get("min_ratio", 0.0)
    return mn + (1 - mn) * (S - step) / cd

def run(c):
    torch.manual_seed(c.get("seed", 42))
    mc = preset("baby-shakespeare", num_tokens=tok.vocab_size, **c.get("model", {}))
    m = DecoderOnlyTransformer(mc)
    params = dict(m.named_parameters())
    mat = [p for n, p in params.items() if p.dim() == 2 and n.startswith("blocks.")]
    matids = {id(p) for p in mat}
    emb = [p for n, p in params.items() if id(p) not in matids and p.dim() == 2]
    other = [p for n, p in params.items() if id(p) not in matids and p.dim() != 2]
    opts = []
    if c.get("opt", "adamw") == "muon":
        opts.append(torch.optim.Muon(mat, lr=c["mlr"], weight_decay=c.get("mwd", 0.0), momentum=c.get("mom", 0.95),
                                     adjust_lr_fn=c.get("adjust", None)))
        opts.append(torch.optim.AdamW([{"params": emb}, {"params": other}], lr=c["lr"], betas=(0.9, 0.99), weight_decay=0.0, fused=True))
    else:
        opts.append(torch.optim.AdamW([{"params": mat, "weight_decay": 0.1}, {"params": emb + other, "weight_decay": 0.0}],
                                      lr=c["lr"], betas=(0.9, 0.99), fused=True))
    bases = [[g["lr"] for g in o.param_groups] for o in opts]
    data = RandomWindowBatches(tr, 64, c.get("bs", 12), seed=42)
    hist = []; t_train = 0.0
    for step in range(c["steps"]):
        t = time.perf_counter()
        f = sched(step, c)
        for o, b in zip(opts, bases):
            for g, lr in zip(o.param_groups, b): g["lr"] = lr * f
        x, y = data[step]
        l = m(x); loss = F.cross_entropy(l.reshape(-1, l.size(-1)), y.reshape(-1))
        loss.backward()
        if c.get("clip", 1.0): torch.nn.utils.clip_grad_norm_(m.parameters(), c.get("clip", 1.0))
        for o in opts: o.step()
        for o in opts: o.zero_grad(set_to_none=True)
        t_train += time.perf_counter() - t
        if (step + 1) in c.get("evals", ()) or step + 1 == c["steps"]:
            hist.append((step + 1, round(t_train, 1), round(full_val(m), 4)))
    return hist

if __name__ == "__main__":
    if len(sys.argv) < 2:  # `make bench` runs every script bare: the screening takes ~30 min, so say how instead
        print(__doc__.strip().splitlines()[-1].strip())
        sys.exit(0)
    cands = json.load(open(sys.argv[1]))
    wanted = set(sys.argv[2:])
    for name, c in cands.items():
        if wanted and name not in wanted:
            continue
        t = time.perf_counter(); h = run(c)
        print(json.dumps({"name": name, "hist": h, "wall": round(time.perf_counter() - t, 1), "load": os.getloadavg()[0]}), flush=True)
