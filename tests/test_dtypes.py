"""Inference dtypes: float32 as trained, bfloat16, float16 and int8 weight-only (torchao), in the library and on
the command line."""

import sys

import pytest
import torch
from conftest import type_lines
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.checkpoint import save_checkpoint
from decoderlab.cli import main as cli_main
from decoderlab.generation import generate
from decoderlab.tokenizers import CharTokenizer


DTYPE_TEXT = "to be, or not to be, that is the question:\nwhether 'tis nobler in the mind to suffer\n"


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A tiny shakespeare-char-family model trained (150 AdamW steps, ~1 s) until it recites DTYPE_TEXT: its
    logits have real margins, unlike random weights', so greedy agreement between dtypes means something."""
    tok = CharTokenizer.from_text(DTYPE_TEXT)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("shakespeare-char", num_tokens=tok.vocab_size, d_model=32,
                                                n_layer=2, n_head=2, max_len=32, dropout=0.0))
    ids = torch.tensor(tok.encode(DTYPE_TEXT))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        starts = torch.randint(0, len(ids) - 33, (8,))
        x = torch.stack([ids[s:s + 32] for s in starts])
        y = torch.stack([ids[s + 1:s + 33] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, tok.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5
    out = tmp_path_factory.mktemp("dtypes") / "ckpt"
    save_checkpoint(out, model, tok, meta={"task": "lm"})
    return out


# the largest |logit - float32 logit| allowed, as a share of max |float32 logit|, on trained_checkpoint's model
# (measured: bfloat16 1.1%, float16 0.13%, int8 0.9%; bfloat16 keeps 8 significant bits, float16 11)
DTYPE_TOLERANCE = {"bfloat16": 0.03, "float16": 0.005, "int8": 0.03}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_each_dtype_loads_and_generates_close_to_float32(trained_checkpoint, dtype):
    ref, tok = dl.load_checkpoint(trained_checkpoint)
    model, _ = dl.load_checkpoint(trained_checkpoint, dtype=dtype)
    fc = model.blocks[0].mlp.fc.weight
    if dtype == "int8":
        from torchao.quantization import Int8Tensor

        assert isinstance(fc, Int8Tensor) and fc.qdata.dtype == torch.int8
        assert model.fc_layer.weight.dtype == torch.float32  # the output layer (tied to the embedding) stays
    else:
        assert fc.dtype == getattr(torch, dtype) and model.fc_layer.weight is model.we.weight  # still tied
    x = torch.tensor(tok.encode(DTYPE_TEXT)[:32])
    with torch.no_grad():
        want, got = ref(x), model(x).float()
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= DTYPE_TOLERANCE[dtype] * want.abs().max()
    prompt = tok.encode("to be")
    greedy = generate(model, prompt, 60, temperature=0)
    assert greedy == generate(ref, prompt, 60, temperature=0)  # a model that recites agrees in every dtype
    assert greedy == generate(model, prompt, 60, temperature=0, use_cache=False)
    sampled = generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)
    assert len(sampled) == 20 and sampled == generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)


def test_dtype_names_and_errors(trained_checkpoint, monkeypatch):
    from decoderlab.config import DTYPES as DTYPE_NAMES  # what --dtype's help lists
    from decoderlab.dtypes import DTYPES, dtype_name

    assert DTYPE_NAMES is DTYPES == ("float32", "bfloat16", "float16", "int8")
    assert [dtype_name(d) for d in (None, torch.float32, torch.bfloat16, torch.float16, torch.int8)] == \
        ["float32", "float32", "bfloat16", "float16", "int8"]
    for bad in ("fp16", torch.float64, 16):
        with pytest.raises(ValueError, match=r"unknown dtype .*; allowed: float32, bfloat16, float16, int8"):
            dl.load_checkpoint(trained_checkpoint, dtype=bad)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r'dtype int8 needs torchao .*pip install "decoderlab\[quant\]"'):
        dl.load_checkpoint(trained_checkpoint, dtype="int8")


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_cli_dtype_on_generate_sample_and_chat(trained_checkpoint, dtype, capsys, monkeypatch):
    model, tok = dl.load_checkpoint(trained_checkpoint, dtype=dtype)
    want = tok.decode(generate(model, tok.encode("to be"), 40, temperature=0))
    common = ["--checkpoint", str(trained_checkpoint), "--dtype", dtype, "--max-new-tokens", "40",
              "--temperature", "0"]
    assert cli_main(["generate", *common, "to be"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert cli_main(["sample", *common, "to be"]) == 0
    assert capsys.readouterr().out == "to be" + want + "\n"
    type_lines(monkeypatch, ["to be"])
    assert cli_main(["chat", *common]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_bad_dtype_prints_one_error_line(trained_checkpoint):
    """The real console script: one ``decoderlab: error:`` line listing the choices, exit status 2."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    exe = shutil.which("decoderlab", path=str(Path(sys.executable).parent)) or shutil.which("decoderlab")
    for command in ("generate", "sample", "chat"):
        r = subprocess.run([exe, command, "--checkpoint", str(trained_checkpoint), "--dtype", "float8"],
                           capture_output=True, text=True, timeout=300, env=os.environ, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.splitlines() == ["decoderlab: error: unknown dtype 'float8'; allowed: float32, bfloat16, "
                                         "float16, int8"], command
