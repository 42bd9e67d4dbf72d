"""Cost of one training step (forward + backward, then the optimizer step) for the speedrun's model variants,
alternating in one process, 1 thread, batch 12 x 64 (docs/benchmarks.md, "bench/speedrun_stepcost.py").

    PYTHONPATH=src python bench/speedrun_stepcost.py [REPEATS]
"""
import torch, time, statistics, sys
torch.set_num_threads(1)
import decoderlab as dl
from decoderlab.training import TrainConfig, configure_optimizers
import torch.nn.functional as F
variants = {
 "baby": {},
 "rope": dict(position="rope"),
 "rope+qk": dict(position="rope", qk_norm=True),
 "rope+relu2": dict(position="rope", mlp="relu2"),
 "speedrun": dict(position="rope", mlp="relu2", qk_norm=True, zero_init=True),
}
x = torch.randint(0, 65, (12, 64)); y = torch.randint(0, 65, (12, 64))
ms = {k: dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=65, **v)) for k, v in variants.items()}
opts = {"adamw": configure_optimizers(ms["speedrun"], TrainConfig())["optimizer"],
        "muon": configure_optimizers(ms["speedrun"], TrainConfig(optimizer="muon"))["optimizer"]}
times = {k: [] for k in list(ms) + ["opt adamw", "opt muon"]}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
    for k, m in ms.items():
        t = time.perf_counter(); l = m(x); F.cross_entropy(l.reshape(-1, 65), y.reshape(-1)).backward(); times[k].append(time.perf_counter() - t)
    for k, o in opts.items():
        t = time.perf_counter(); o.step(); times["opt " + k].append(time.perf_counter() - t)
    for m in ms.values(): m.zero_grad()
for k, v in times.items(): print(f"{k:12s} {statistics.median(v)*1000:.1f} ms")
