"""Inference dtypes: float32 as trained, bfloat16, float16 and GGUF's blocks q8_0 / q4_0 / q4_1, in the library and
on the command line."""

import sys

import pytest
import torch
from support.interaction import type_lines
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
# (measured: bfloat16 1.1%, float16 0.13%, q8_0 1.2%, q4_0 10%, q4_1 17%; bfloat16 keeps 8 significant bits,
# float16 11, q8_0 8 per block of 32 weights, q4 4)
DTYPE_TOLERANCE = {"bfloat16": 0.03, "float16": 0.005, "q8_0": 0.03, "q4_0": 0.3, "q4_1": 0.3}
BLOCK = ("q8_0", "q4_0", "q4_1")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", *BLOCK])
def test_each_dtype_loads_and_generates_close_to_float32(trained_checkpoint, dtype):
    from decoderlab.quant import BlockLinear

    ref, tok = dl.load_checkpoint(trained_checkpoint)
    model, _ = dl.load_checkpoint(trained_checkpoint, dtype=dtype)
    if dtype in BLOCK:  # every linear layer and the output layer, the tied embedding reading the same blocks
        assert isinstance(model.blocks[0].mlp.fc, BlockLinear) and model.blocks[0].mlp.fc.kind == dtype
        assert isinstance(model.fc_layer, BlockLinear) and model.we.packed_0 is model.fc_layer.packed_0
    else:
        fc = model.blocks[0].mlp.fc.weight
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
    if dtype not in ("q4_0", "q4_1"):  # (4 bits a weight is a real change: a model that recites may recite otherwise)
        assert greedy == generate(ref, prompt, 60, temperature=0)  # a model that recites agrees
    assert greedy == generate(model, prompt, 60, temperature=0, use_cache=False)
    sampled = generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)
    assert len(sampled) == 20 and sampled == generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)


def test_dtype_names_and_errors(trained_checkpoint, monkeypatch):
    from decoderlab.config import DTYPES as DTYPE_NAMES  # what --dtype's help lists
    from decoderlab.dtypes import DTYPES, dtype_name

    assert DTYPE_NAMES is DTYPES == ("float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
                                     "q4_k", "q5_k", "q6_k")
    assert [dtype_name(d) for d in (None, torch.float32, torch.bfloat16, torch.float16, "q4_1")] == \
        ["float32", "float32", "bfloat16", "float16", "q4_1"]
    for bad in ("fp16", torch.float64, 16, "int8", torch.int8):
        with pytest.raises(ValueError, match=r"unknown dtype .*; allowed: auto, float32, bfloat16, float16, q8_0, "
                                             r"q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k"):
            dl.load_checkpoint(trained_checkpoint, dtype=bad)


def test_a_block_dtype_on_apple_mps_is_refused_before_anything_is_read(trained_checkpoint, capsys, monkeypatch):
    """The block types run on the CPU and CUDA GPUs: --device mps with one is one error line (the check that the
    machine has MPS is mocked: this one has none)."""
    import decoderlab.checkpoint
    import decoderlab.devices
    from decoderlab.dtypes import check_dtype

    with pytest.raises(ValueError, match=r"dtype q4_1 runs on the CPU and CUDA GPUs, not Apple MPS"):
        check_dtype("q4_1", "mps")
    assert check_dtype("float16", "mps") == "float16" and check_dtype("q8_0", "cpu") == "q8_0"
    for module in (decoderlab.devices, decoderlab.checkpoint):
        monkeypatch.setattr(module, "resolve_device", lambda name=None: torch.device("mps"))
    assert cli_main(["generate", "--checkpoint", str(trained_checkpoint), "--device", "mps", "--dtype", "q8_0",
                     "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "decoderlab: error: dtype q8_0 runs on the CPU and CUDA GPUs, not Apple MPS (its block products are not "
        "supported there): use float16 or float32 on mps, or --device cpu"]


def test_a_block_dtype_on_a_width_that_is_not_whole_blocks_is_one_error_line(tmp_path, capsys):
    """The lesson's model (d_model 2) has no whole blocks of 32: --dtype q8_0 names the first layer that cannot."""
    tok = CharTokenizer.from_text("ab")
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=24, n_layer=1,
                                                n_head=2, max_len=8))
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm"})
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "c"), "--dtype", "q8_0", "a"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "decoderlab: error: --dtype q8_0: layer blocks.0.attention.qkv has 24 inputs, not a multiple of 32 (the "
        "block size); block types need every linear layer's width to be one (use float32, bfloat16 or float16 for "
        "this model)"]


@pytest.mark.parametrize("dtype", ["bfloat16", "q4_1"])
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


def test_cli_bad_dtype_prints_one_error_line(trained_checkpoint, capsys):
    """The real console script: one ``decoderlab: error:`` line naming the flag and listing the choices, exit
    status 2 (generate's process; sample and chat in this process)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    exe = shutil.which("decoderlab", path=str(Path(sys.executable).parent)) or shutil.which("decoderlab")
    from decoderlab.cli import main as cli_main

    line = ("decoderlab: error: unknown --dtype 'float8'; allowed: auto, float32, bfloat16, float16, q8_0, q4_0, q4_1, "
            "q5_0, q5_1, q4_k, q5_k, q6_k")
    r = subprocess.run([exe, "generate", "--checkpoint", str(trained_checkpoint), "--dtype", "float8"],
                       capture_output=True, text=True, timeout=300, env=os.environ, stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stderr.splitlines()) == (2, [line])
    for command in ("sample", "chat"):
        assert cli_main([command, "--checkpoint", str(trained_checkpoint), "--dtype", "float8"]) == 2, command
        assert capsys.readouterr().err.splitlines() == [line], command


def test_a_model_of_several_block_types_is_said_by_all_of_them_most_held_first():
    """verify and generate's lines named a K-quant file's model by its most-held type alone ("q8_0 model" for
    Gemma 3's Q4_K_M file, whose embedding is q8_0): now every type, the one holding most weights first."""
    import decoderlab as dl
    from decoderlab.dtypes import model_dtype, weights_said
    from decoderlab.quant import BlockWeight, quantize_model, use_block_weights

    torch.manual_seed(0)
    model = quantize_model(dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", d_model=32, n_layer=1, n_head=2,
                                                                 max_len=8)), "q4_1")
    assert weights_said(model) == model_dtype(model) == "q4_1"
    fc = model.blocks[0].mlp.fc
    use_block_weights(model, {"blocks.0.mlp.fc": BlockWeight.quantize(fc.weight, "q8_0")})
    assert weights_said(model) == "q4_1 + q8_0" and model_dtype(model) == "q4_1"
