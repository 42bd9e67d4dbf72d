"""The ahead-of-time decode step (``compile_decode(mode="aot")``: ``torch.export`` + AOTInductor, a ``.pt2``
package per kind of call): compiled in this process and reloaded in a new one, it decodes eager's tokens --
greedy and seeded-sampled, batch 1 and a left-padded batch, over a window that slides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_model, one_thread, run_env  # noqa: F401 -- one_thread: autouse

from decoderlab.generation import generate, generate_batch

SAMPLED = dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=1)
PROMPTS = [[1], [1, 2, 3], [2, 2]]


def _decode_all(model) -> list:
    """What is compared: batch 1 greedy and sampled, a padded batch of 3 greedy and sampled; 2 x max_len tokens
    each (the window slides)."""
    n = 2 * model.config.max_len
    return [generate(model, [1], n, temperature=0), generate(model, [1, 2], n, **SAMPLED),
            generate_batch(model, PROMPTS, n, temperature=0), generate_batch(model, PROMPTS, n, **SAMPLED)]


# the new process: the same model (seed 5) and one with other weights (seed 6), the packages this test wrote, the
# same calls -- one line of JSON per model
CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from tiny_models import make_model
from test_aot import _decode_all
torch.set_num_threads(1)
for seed in (5, 6):
    model = make_model("gpt2", "sdpa", seed=seed)
    eager = _decode_all(model)
    step = model.compile_decode(mode="aot", cache_dir={cache!r})
    out = _decode_all(model)
    print(json.dumps({{"seed": seed, "out": out, "eager": eager,
                       "compile_seconds": sorted(step.compile_seconds.values()),
                       "packages": sorted(p.name for p in step.packages.values())}}))
"""


@pytest.mark.slow
def test_the_aot_package_decodes_eagers_tokens_and_reloads_in_a_new_process(tmp_path):
    """Two packages are compiled here (batch 1; the padded batch of 3), each a tiny graph of a 2-layer model
    (d_model 16): ~20 s each on a loaded 2-core machine. The packages read the model's own tensors: a weight
    changed in place is decoded with at once, and a parameter replaced by another tensor at the next step, both
    without compiling again. A new process loads both packages without compiling, for a model with other
    weights as well (a package holds code, not weights), and decodes that model's eager tokens. A damaged file
    where a package belongs is compiled again in its place."""
    from decoderlab.aot import _fingerprint

    model = make_model("gpt2", "sdpa", seed=5)
    want = _decode_all(model)
    damaged = tmp_path / f"decode-b1-{_fingerprint(model, (1, False))[:24]}.pt2"
    damaged.write_bytes(b"not a zip archive")  # a package cut short (a partial copy, a full disk)
    try:
        step = model.compile_decode(mode="aot", cache_dir=tmp_path)
        assert model.compiled_decode is step
        assert _decode_all(model) == want
        compiled = dict(step.compile_seconds)
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.mul_(-1.0)  # in place: the runners read this very tensor
        model.compiled_decode = None
        want_changed = _decode_all(model)
        model.compiled_decode = step
        assert want_changed != want and _decode_all(model) == want_changed
        fc = model.blocks[1].mlp.fc
        fc.weight = torch.nn.Parameter(fc.weight.detach() * -1.0)  # replaced: noticed at the next step
        model.compiled_decode = None
        want_replaced = _decode_all(model)
        model.compiled_decode = step
        assert want_replaced != want_changed and _decode_all(model) == want_replaced
        assert step.compile_seconds == compiled == {k: v for k, v in compiled.items() if v > 0}
    finally:
        model.compiled_decode = None
    assert sorted(step.packages) == [(1, False), (3, True)] and step.packages[(1, False)] == damaged
    assert step.compile_seconds[(1, False)] > 0  # the damaged file was compiled again in its place
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == sorted(p.name for p in step.packages.values())
    # a package holds code, not weights: what the runners read are the model's own tensors (the size of a tiny
    # model's package says nothing: its 67 kB of weights beside 1.7 MB of compiled code)
    own = {id(t) for t in model.state_dict(keep_vars=True).values()}
    assert step._slots and all(id(t) in own for _, _, t in step._slots.values())
    here = str(Path(__file__).resolve().parent)
    code = CHILD.format(tests=str(Path(here).parent), here=here, cache=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    children = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith('{"seed"')]
    assert [c["seed"] for c in children] == [5, 6]
    for seed, child in zip((5, 6), children):
        assert child["compile_seconds"] == [0.0, 0.0], "the new process compiled instead of loading"
        assert child["packages"] == sorted(p.name for p in step.packages.values())
        assert child["out"] == child["eager"]
        assert (child["out"] == want) == (seed == 5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama-gqa", pytest.param("gemma-sliding", marks=pytest.mark.skipif(
    "not config.getoption('-m') or 'slow' not in config.getoption('-m')",
    reason="Gemma's AOT packages: 100 s of compiling on a loaded 2-core machine; run with -m slow"))])
def test_a_llama_shaped_package_decodes_eagers_tokens(tmp_path, family):
    """The Llama family's shape (grouped-query attention over a static cache of n_kv_head heads, SwiGLU,
    rotate-half rope, q/k/v biases, QK-norm with a gain, heads narrower than d_model / n_head), and Gemma 3's
    (sliding layers masked by column in the static cache, their own rope base, sandwich norms, GeGLU; only when
    the slow tests are asked for by name, ``-m slow``): both packages (batch 1; the padded batch of 3) decode
    eager's tokens. Two tiny graphs compiled: ~20 s each."""
    model = make_model(family, "sdpa", seed=5)
    want = _decode_all(model)
    try:
        step = model.compile_decode(mode="aot", cache_dir=tmp_path)
        assert _decode_all(model) == want
    finally:
        model.compiled_decode = None
    assert sorted(step.packages) == [(1, False), (3, True)]


def test_aot_takes_a_cache_dir_only():
    model = make_model("gpt2", "sdpa", seed=5)
    with pytest.raises(TypeError, match="takes cache_dir only, got backend"):
        model.compile_decode(mode="aot", backend="eager")
    assert model.compiled_decode is None


def test_a_cache_that_is_not_static_is_decoded_eagerly(tmp_path):
    """The server's batch cache grows: the AOT step hands such a call to ``model.decode`` (nothing compiled)."""
    from decoderlab.generation import KVCache

    model = make_model("gpt2", "sdpa", seed=5)
    step = model.compile_decode(mode="aot", cache_dir=tmp_path)
    model.compiled_decode = None
    cache = KVCache.for_model(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), cache=cache)
        got = step(torch.tensor([[3]]), 2, None, cache)
        cache.length = 2  # (decode does not advance the cache: the same step again, eagerly)
        want = model.decode(torch.tensor([[3]]), 2, None, cache)
    assert torch.equal(got, want) and not step.packages and not list(tmp_path.iterdir())


def test_a_compile_says_the_time_measured_here_or_none_a_heartbeat_and_its_time(tmp_path, monkeypatch):
    """It said "10-60 s on a CPU" (SmolLM2's first took 79-477 s): now its first line names the time an earlier
    compile took on this machine (kept in the cache directory), or says there is none yet; a line every
    waiting.EVERY seconds while it runs; its time and package when done. A stand-in compile as slow as the test
    wants: nothing is timed."""
    import re
    import threading

    from decoderlab import waiting
    from decoderlab.aot import AOTDecodeStep

    monkeypatch.setattr(waiting, "EVERY", 0.001)
    lines, beats = [], threading.Event()

    def notify(line):
        lines.append(line)
        if len(lines) >= 3:
            beats.set()

    step = AOTDecodeStep(make_model("gpt2", "sdpa", seed=5), tmp_path, notify=notify)
    monkeypatch.setattr(step, "_compile", lambda kind, args, path: beats.wait(60))
    path = step.package_path((1, False))
    step._compile_said((1, False), (), path)
    assert lines[0] == ("compiling the decode step ahead of time for 1 row(s), once for this model's shape and dtype "
                        "(nothing measured yet to estimate its time from: it is said when done) ...")
    assert re.fullmatch(r"compiling the decode step ahead of time for 1 row\(s\): \d+ s so far", lines[1]), lines
    assert re.fullmatch(rf"compiled the decode step ahead of time in \d+ s: {re.escape(str(path))} \(later runs load "
                        r"it\)", lines[-1]), lines
    waiting.MeasuredWaits(tmp_path / "waits.json").record("aot compile, cpu, float64", path.stem, 2, 200.0)
    lines.clear(), beats.clear()
    step._compile_said((1, False), (), path)  # (a package deleted since: compiled again)
    assert lines[0].endswith("(~200 s: the last one of this shape took 200 s here) ...")
    assert re.fullmatch(r"compiling the decode step ahead of time for 1 row\(s\): \d+ s so far, ~\d+ s left",
                        lines[1]), lines
    lines.clear(), beats.clear()
    step._compile_said((3, True), (), step.package_path((3, True)))  # another kind, as deep: scaled from it
    assert lines[0].startswith("compiling the decode step ahead of time for 3 row(s), padded, once for")
    assert re.search(r"\(~\d+ s: one of 2 layers took \d+ s here, scaled to 2\) \.\.\.$", lines[0]), lines


def test_the_package_name_follows_the_shape_and_the_kind_not_the_weights():
    """The package holds code, not weights: two models of one shape and dtype -- other weights included -- hash to
    the same package; another dtype, another shape or another kind of call to another."""
    from decoderlab.aot import _fingerprint

    a, b = make_model("gpt2", "sdpa", seed=5), make_model("gpt2", "sdpa", seed=6)
    key = _fingerprint(a, (1, False))
    assert _fingerprint(b, (1, False)) == key
    assert len({key, _fingerprint(a, (3, True)), _fingerprint(a, (1, True))}) == 3
    assert _fingerprint(make_model("rope-rmsnorm", "sdpa", seed=5), (1, False)) != key
    assert _fingerprint(a.to(torch.bfloat16), (1, False)) != key
    keys = {_fingerprint(_block_model(kind), (1, False)) for kind in ("float32", "q8_0", "q4_0", "q4_1")}
    assert len(keys) == 4 and _fingerprint(_block_model("q8_0").double(), (1, False)) not in keys
    # layers of different block types (a GGUF file's Q4_1 matrices beside a Q8_0 one): another package again
    from decoderlab.quant import BlockWeight, use_block_weights

    mixed = _block_model("q4_1")
    use_block_weights(mixed, {"blocks.0.mlp.fc": BlockWeight.quantize(mixed.blocks[0].mlp.fc.weight, "q8_0")})
    assert _fingerprint(mixed, (1, False)) not in keys


def test_tensor_subclass_weights_are_refused_before_anything_compiles(tmp_path):
    """Weights that are tensor subclasses (torchao's quantized tensors are; here torch's TwoTensor) cannot be bound
    to a package by name: refused at once, in a ValueError naming what the step takes, with nothing compiled or
    written."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = make_model("gpt2", "sdpa", seed=5).float()
    w = model.blocks[0].mlp.fc.weight.detach()
    model.blocks[0].mlp.fc.weight = torch.nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)
    with pytest.raises(ValueError, match=r"plain weights \(float32, bfloat16, float16, or q8_0 / q4_0 / q4_1 "
                                         r"blocks\), not tensor subclasses"):
        model.compile_decode(mode="aot", cache_dir=tmp_path)
    assert model.compiled_decode is None and not list(tmp_path.iterdir())


# the new process of the block-dtype test: the same quantized models, the packages written, greedy and sampled
BLOCK_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from test_aot import _block_model
from decoderlab.generation import generate
torch.set_num_threads(1)
out = {{}}
for kind in {kinds!r}:
    model = _block_model(kind)
    step = model.compile_decode(mode="aot", cache_dir={cache!r})
    out[kind] = [generate(model, [1], 40, temperature=0), generate(model, [1, 2], 40, **{sampled!r}),
                 sorted(step.compile_seconds.values())]
print(json.dumps(out))
"""


def _block_model(kind: str):
    """A tiny GPT-2-shaped model (d_model 32: whole blocks) quantized to ``kind``, float32 activations."""
    import decoderlab as dl
    from decoderlab.dtypes import to_inference_dtype

    torch.manual_seed(3)
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=61, d_model=32, n_layer=2, n_head=2, max_len=24))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # logits far from uniform: greedy paths that vary
    return to_inference_dtype(model.eval(), kind)


@pytest.mark.slow
def test_a_package_per_block_dtype_decodes_eagers_tokens_and_reloads_in_a_new_process(tmp_path):
    """q4_1 weights (decoderlab.quant's packed bytes: plain uint8 buffers, bound to the package by name like float
    weights) compile into a package whose greedy and sampled tokens are eager's, and a new process loads it
    without compiling and decodes the same tokens. One tiny graph is compiled: about a minute on a loaded 2-core
    machine. (Every block type is the one op ``block_linear`` to the package, and each dtype's package name is
    its own: test_the_package_name_follows_the_shape_and_the_kind_not_the_weights.)"""
    kinds = ("q4_1",)
    want = {}
    for kind in kinds:
        model = _block_model(kind)
        eager = [generate(model, [1], 40, temperature=0), generate(model, [1, 2], 40, **SAMPLED)]
        step = model.compile_decode(mode="aot", cache_dir=tmp_path)
        assert [generate(model, [1], 40, temperature=0), generate(model, [1, 2], 40, **SAMPLED)] == eager, kind
        assert step.compile_seconds[(1, False)] > 0
        want[kind] = eager
    here = str(Path(__file__).resolve().parent)
    code = BLOCK_CHILD.format(tests=str(Path(here).parent), here=here, cache=str(tmp_path), kinds=kinds,
                              sampled=SAMPLED)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    for kind in kinds:
        assert child[kind][2] == [0.0], f"the new process compiled {kind} instead of loading its package"
        assert child[kind][:2] == want[kind], kind
