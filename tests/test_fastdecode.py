"""The fused decode step (decoderlab.fastdecode, kernels/csrc/decode.cpp) against the model's own blocks: the same
logits to float32 rounding and the same KV cache, step after step -- Llama's shape (grouped-query attention, q/k/v
biases, QK-norm gains, rotate-half rope, head_dim != d_model / n_head) and Gemma's (sliding windows past their ring,
sandwich norms, GeGLU, a scaled embedding, multi-query heads) -- in float32 and over GGUF's blocks; the same greedy
tokens through ``generate`` and ``generate_batch`` (left padding); and the steps it leaves to the blocks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import decoderlab as dl
from decoderlab import fastdecode, kernels
from decoderlab.attention import KVCache
from decoderlab.generation import generate, generate_batch
from decoderlab.quant import quantize_model

from tiny_models import FAMILIES

pytestmark = pytest.mark.skipif(kernels.load() == "portable", reason="the fused step needs the C++ kernels")


def _model(family: str, kind: str | None = None, d_model: int = 64, seed: int = 0) -> dl.DecoderOnlyTransformer:
    """A random float32 model of the family's shape, widened so that its widths are whole blocks (32; 256 for a
    K-quant), sharpened (greedy paths that vary), its products on ``kind``'s blocks when given."""
    torch.manual_seed(seed)
    shape = {**FAMILIES[family], "d_model": d_model, "head_dim": 16 if family == "llama-gqa" else 32,
             "d_ff": 2 * d_model, "max_len": 40, "num_tokens": 67}
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return quantize_model(model, kind) if kind else model


def _lockstep(model, prompt: list[int], steps: int, rings: bool = True):
    """Prefill two caches alike, then decode the same tokens through the fused step and through the blocks; yields
    each step's (fused logits, blocks logits, fused cache, blocks cache). ``rings=False``: caches that keep every
    column (as the scheduler's batch cache), a sliding layer's window then a mask over them."""
    caches = []
    with torch.no_grad():
        for _ in range(2):
            cfg = model.config
            cache = KVCache.for_model(model) if rings else KVCache(cfg.n_layer, cfg.max_len)
            model(torch.tensor([prompt]), cache=cache, last_only=True, check_ids=False)
            caches.append(cache)
        token = torch.tensor([[prompt[-1]]])
        for _ in range(steps):
            a = fastdecode.step(model, token, caches[0].length, None, caches[0])
            assert a is not None, fastdecode.program(model, caches[0])
            b = model._logits(token, None, torch.tensor([caches[1].length]), caches[1])[:, -1]
            yield a, b, caches[0], caches[1]
            for c in caches:
                c.advance(1)
            token = b.argmax(-1, keepdim=True)


def _written(cache) -> list[torch.Tensor]:
    """Each layer's keys and values held after the last step (a ring's W slots, else the columns written)."""
    n = cache.length + 1
    return [t[:, :, : (min(n, c.ring) if c.ring else n)] for c in cache.layers for t in (c.k, c.v)]


@pytest.mark.parametrize("family,rings", [("llama-gqa", True), ("gemma-sliding", True), ("gemma-sliding", False)])
def test_the_fused_step_is_the_blocks_step_in_float32(family, rings):
    """Float32 weights: every step's logits and the KV cache equal the blocks' to float32 rounding, past Gemma's
    window of 3 (its ring wraps: the step writes over the key W columns back and reads the W it holds; without
    rings, the keys W or more columns back are left out)."""
    model = _model(family)
    for a, b, ca, cb in _lockstep(model, [3, 9, 14, 2, 8], steps=12, rings=rings):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()
        for x, y in zip(_written(ca), _written(cb)):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,kind,d_model", [("llama-gqa", "q8_0", 64), ("llama-gqa", "q4_1", 64),
                                                 ("gemma-sliding", "q5_0", 64)])
def test_the_fused_step_runs_the_same_block_products(family, kind, d_model):
    """GGUF's blocks: the products are the kernels' ops on the same bytes, and the norms round as the blocks' do
    (sums of squares in double): the first step's logits are the blocks' bit for bit. Later steps' attention sums
    in another order (float32 rounding), which an 8-bit activation block can magnify by one quant: the logits stay
    within a few hundredths of their range, and the greedy tokens equal. (K-quants: the real files, bench/.)"""
    model = _model(family, kind, d_model)
    for i, (a, b, _, _) in enumerate(_lockstep(model, [3, 9, 14, 2, 8], steps=8)):
        if i == 0:
            assert torch.equal(a, b)
        assert (a - b).abs().max() <= 0.02 * (b.max() - b.min()), (a - b).abs().max()
        assert a.argmax() == b.argmax()


def _without_fused(monkeypatch):
    monkeypatch.setattr(fastdecode, "step", lambda *args, **kw: None)


@pytest.mark.parametrize("family,kind", [("llama-gqa", None), ("gemma-sliding", None), ("llama-gqa", "q8_0")])
def test_generation_decodes_the_same_tokens_fused_or_not(family, kind, monkeypatch):
    """Through the engine: greedy and seeded sampled tokens, one row and a left-padded batch (the padding mask read
    by the fused attention; Gemma's ring with padding takes the blocks), equal with the fused step and without."""
    model = _model(family, kind)
    sampled = dict(temperature=0.9, top_k=8, seed=4)

    def run():
        return [generate(model, [5, 1, 7], 25, temperature=0), generate(model, [2, 2], 25, **sampled),
                generate_batch(model, [[1], [4, 9, 2, 6], [3, 3]], 20, temperature=0)]

    taken, step = [], fastdecode.step
    monkeypatch.setattr(fastdecode, "step", lambda *a, **kw: taken.append(step(*a, **kw)) or taken[-1])
    fused = run()
    assert sum(t is not None for t in taken) >= 45  # the one-row calls' steps at least were fused
    _without_fused(monkeypatch)
    assert run() == fused


def test_the_steps_it_leaves_to_the_blocks_say_why():
    """Hook points, grad, a static cache, float64 and GPT-2's shape take the blocks; program() says why (why_not()
    of the model alone, for the command line)."""
    model = _model("llama-gqa")
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache, last_only=True, check_ids=False)
        assert isinstance(fastdecode.program(model, cache), tuple)
        from decoderlab.hooks import use_hooks

        token = torch.tensor([[4]])
        assert fastdecode.step(model, token, 3, None, cache) is not None  # (its program now kept on the cache)
        with use_hooks(model, [("blocks.1.hook_resid_pre", lambda x: x)]):
            assert "hook points" in fastdecode.program(model, cache)
            assert fastdecode.step(model, token, 3, None, cache) is None  # hooks installed since: the blocks
        assert "static" in fastdecode.program(model, KVCache.for_model(model, static=True))
    assert "grad" in fastdecode.program(model, cache)
    assert fastdecode.why_not(model) is None and "positions" in fastdecode.why_not(dl.DecoderOnlyTransformer(
        dl.preset("gpt2", num_tokens=50, d_model=32, n_layer=1, n_head=2, max_len=8)))
    gpt2 = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=50, d_model=32, n_layer=1, n_head=2,
                                               max_len=8)).eval()
    cache = KVCache.for_model(gpt2)
    with torch.no_grad():
        gpt2(torch.tensor([[1, 2]]), cache=cache, last_only=True, check_ids=False)
        assert "positions" in fastdecode.program(gpt2, cache)
        assert fastdecode.step(gpt2, torch.tensor([[3]]), 2, None, cache) is None
        double = _model("llama-gqa").double()
        cache = KVCache.for_model(double)
        double(torch.tensor([[1, 2]]), cache=cache, last_only=True, check_ids=False)
        assert "float32" in fastdecode.program(double, cache)


def test_a_malformed_program_is_refused_by_name():
    """The op checks what it reads: a program that runs out, or caches of another shape, is a ValueError naming
    the op and what it found -- never a read past a buffer."""
    model = _model("llama-gqa")
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache, last_only=True, check_ids=False)
        tensors, ints, floats = fastdecode.program(model, cache)
        x, pos = torch.zeros(1, 64), torch.tensor([3])
        ks, vs = [c.k for c in cache.layers], [c.v for c in cache.layers]
        op = torch.ops.decoderlab.decode_step.default
        with pytest.raises(ValueError, match="decode_step: the program ran out of tensors"):
            op(x, pos, 3, None, tensors[:-3], ints, floats, ks, vs)
        with pytest.raises(ValueError, match="decode_step: .* left over"):
            op(x, pos, 3, None, tensors + tensors[:1], ints, floats, ks, vs)
        with pytest.raises(ValueError, match="a layer's cache must be"):
            op(x, pos, 3, None, tensors, ints, floats, [k[:, :1] for k in ks], vs)
        with pytest.raises(ValueError, match="position 99 is outside the rotary table"):
            op(x, torch.tensor([99]), 3, None, tensors, ints, floats, ks, vs)


def test_the_portable_path_decodes_the_fused_steps_tokens():
    """Where the C++ kernels are not loaded (DECODERLAB_KERNELS=portable: Apple silicon, no compiler) no step is
    fused -- program() says so -- and the blocks decode the same greedy tokens as the fused step here (float32
    weights: the products are float32 sums either way)."""
    code = (
        "import json, sys, torch; sys.path.insert(0, {tests!r}); torch.set_num_threads(1)\n"
        "from test_fastdecode import _model\n"
        "from decoderlab import fastdecode\n"
        "from decoderlab.generation import generate\n"
        "m = _model('llama-gqa')\n"
        "print(json.dumps([generate(m, [5, 1, 7], 25, temperature=0), fastdecode.why_not(m)]))\n"
    ).format(tests=str(Path(__file__).resolve().parent))
    env = {**os.environ, "DECODERLAB_KERNELS": "portable",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, why = json.loads(r.stdout.strip().splitlines()[-1])
    assert why == "the portable kernel path"
    assert tokens == generate(_model("llama-gqa"), [5, 1, 7], 25, temperature=0)
