"""Loading a Hugging Face directory of a SmolLM2-135M-shaped model: time and peak memory.

The model is SmolLM2-135M's shape with random weights (LlamaForCausalLM: 30 layers, d_model 576, 9 heads, 3
key/value heads, SwiGLU 1536, vocabulary 49,152, tied embeddings; 134,515,008 parameters), written here as a
Hugging Face directory (config.json, model.safetensors, a byte-level BPE tokenizer of 49,152 tokens) in float32
and in bfloat16. Each load runs in a fresh process, alternating, and reports the median over the repeats of:

    (a) decoderlab.hf.load_hf_directory(dir) -> float32 model + tokenizer (what decoderlab.load and --checkpoint do),
    (b) transformers' AutoModelForCausalLM.from_pretrained(dir, dtype=float32) + AutoTokenizer (for reference),

with the wall time of the call, its CPU time (user + system, of every thread: what the call costs whatever else
runs on the machine) and its peak memory: the process's peak resident set (VmHWM, reset just before
the call through /proc/self/clear_refs) less its resident set before the call, as a multiple of the float32
weights' bytes (targets: <= 2 s, <= 1.2x). The file's pages count while mapped: a loader that keeps the whole
mapping resident while it copies holds the weights twice.

    python bench/hf_load.py [--repeats 5] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 100000.0})

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
which, path = sys.argv[1], sys.argv[2]
if which == "decoderlab":
    from decoderlab.hf import load_hf_directory
else:
    import transformers
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak resident set starts again from here
before = rss("VmRSS:")
t, cpu = time.perf_counter(), time.process_time()
if which == "decoderlab":
    model, tok = load_hf_directory(path)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps(dict(seconds=seconds, cpu=cpu, peak=rss("VmHWM:") - before, weights=weights,
                      dtype=str(next(model.parameters()).dtype))))
"""


def tokenizer_files(directory: Path) -> None:
    """A byte-level BPE of 49,152 tokens (the 256 bytes, then merges of byte pairs), as SmolLM2's is shaped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from decoderlab.tokenizers import byte_level_text

    alphabet = [byte_level_text(bytes([b])) for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= SHAPE["vocab_size"] - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))


def write_model(root: Path) -> dict[str, Path]:
    import torch
    import transformers

    dirs = {}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # (to_empty made the head a tensor of its own)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    for dtype in (torch.float32, torch.bfloat16):
        d = root / str(dtype).split(".")[1]
        model.to(dtype).save_pretrained(d)
        tokenizer_files(d)
        dirs[d.name] = d
    return dirs


def run(which: str, path: Path, threads: int) -> dict:
    env = {**os.environ, "BENCH_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(path)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{which} failed on {path}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_model(Path(tmp))
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):  # alternating: the same load on the machine for each
            for name, path in dirs.items():
                for which in ("decoderlab", "transformers"):
                    results.setdefault((name, which), []).append(run(which, path, args.threads))
    bar = "|" if args.markdown else " "
    print(f"{bar} file {bar} loader {bar} load s (median) {bar} CPU s {bar} peak / float32 weights {bar} weights MB {bar}")
    if args.markdown:
        print("|---|---|---:|---:|---:|---:|")
    for (name, which), rows in results.items():
        seconds, cpu = (statistics.median(r[k] for r in rows) for k in ("seconds", "cpu"))
        ratio = statistics.median(r["peak"] / r["weights"] for r in rows)
        print(f"{bar} {name} {bar} {which} {bar} {seconds:.2f} {bar} {cpu:.2f} {bar} {ratio:.2f}x {bar} "
              f"{rows[0]['weights'] / 1e6:.0f} {bar}")


if __name__ == "__main__":
    main()
