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


# the new process: the same model (same seed), the packages this test wrote, the same calls
CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
from tiny_models import make_model
from test_aot import _decode_all
torch.set_num_threads(1)
model = make_model("gpt2", "sdpa", seed=5)
step = model.compile_decode(mode="aot", cache_dir={cache!r})
out = _decode_all(model)
print(json.dumps({{"out": out, "compile_seconds": sorted(step.compile_seconds.values()),
                   "packages": sorted(p.name for p in step.packages.values())}}))
"""


@pytest.mark.slow
def test_the_aot_package_decodes_eagers_tokens_and_reloads_in_a_new_process(tmp_path):
    """Two packages are compiled here (batch 1; the padded batch of 3), each a tiny graph of a 2-layer model
    (d_model 16): ~20 s each on a loaded 2-core machine; the new process loads both without compiling."""
    model = make_model("gpt2", "sdpa", seed=5)
    want = _decode_all(model)
    try:
        step = model.compile_decode(mode="aot", cache_dir=tmp_path)
        assert model.compiled_decode is step
        assert _decode_all(model) == want
    finally:
        model.compiled_decode = None
    assert sorted(step.packages) == [(1, False), (3, True)] and all(s > 0 for s in step.compile_seconds.values())
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == sorted(p.name for p in step.packages.values())
    here = str(Path(__file__).resolve().parent)
    code = CHILD.format(tests=str(Path(here).parent), here=here, cache=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["compile_seconds"] == [0.0, 0.0], "the new process compiled instead of loading"
    assert child["packages"] == sorted(p.name for p in step.packages.values())
    assert child["out"] == want


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


def test_the_package_name_follows_the_weights_and_the_kind():
    """The same model built again hashes to the same package; one changed weight, another dtype or another kind
    of call to another."""
    from decoderlab.aot import _fingerprint

    a, b = make_model("gpt2", "sdpa", seed=5), make_model("gpt2", "sdpa", seed=5)
    key = _fingerprint(a, (1, False))
    assert _fingerprint(b, (1, False)) == key
    assert len({key, _fingerprint(a, (3, True)), _fingerprint(a, (1, True))}) == 3
    with torch.no_grad():
        b.blocks[0].mlp.fc.weight[0, 0] += 1e-6
    assert _fingerprint(b, (1, False)) != key
    assert _fingerprint(a.float(), (1, False)) != key
