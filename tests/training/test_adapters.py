"""A LoRA run keeps its adapter, the adapters' optimizer state and a pointer to its base (path + sha256) -- no copy of
the base: a LoRA fine-tune of a 98 MB model left 1.6 GB (two identical 565 MB Lightning checkpoints and a 514 MB merged
float32 model beside an 8.4 MB adapter). The run directory loads as the base with the adapter (the merged model's
logits), resumes exactly, refuses a changed base by name, and writes the merged model in the base's dtype when asked."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from support.interaction import InterruptAt
from tiny_runs import CONVS, chat_pair, one_thread, tiny_cfg  # noqa: F401  (one_thread: an autouse fixture)

import decoderlab
from decoderlab import cli
from decoderlab.chat import load_model
from decoderlab.checkpoint import checkpoint_digest, save_checkpoint
from decoderlab.export import export
from decoderlab.finetuning import finetune
from decoderlab.lora import lora_parameter_count
from decoderlab.training import TrainingInterrupted

LORA = {"rank": 2, "targets": "attn"}


def base_checkpoint(directory, seed=0, dtype=torch.float32):
    """A chat model larger than its adapter by far (d_model 64, two blocks), saved as a decoderlab checkpoint."""
    model, tok = chat_pair(seed=seed, d_model=64, n_layer=2, n_head=4)
    save_checkpoint(directory, model.to(dtype), tok)
    return directory


def lora_run(out, steps=4, callbacks=(), **kw):
    kw = {"train_config": tiny_cfg(max_steps=steps, batch_size=4, eval_every=2, lr=1e-2), **kw}
    return finetune(CONVS, out=out, lora=LORA, val_fraction=0, eval_prompts=1, eval_max_new_tokens=2,
                    progress_bar=False, logger=False, accelerator="cpu", callbacks=list(callbacks), **kw)


def disk_bytes(directory) -> int:
    """The bytes the files under ``directory`` take, a file with several names (a hard link) once."""
    inodes = {}
    for p in directory.rglob("*"):
        if p.is_file():
            inodes[os.stat(p).st_ino] = p.stat().st_size
    return sum(inodes.values())


@pytest.fixture
def base(tmp_path):
    return base_checkpoint(tmp_path / "base")


def test_a_lora_run_keeps_the_adapter_and_a_pointer_to_its_base_and_no_copy_of_it(tmp_path, base):
    out = tmp_path / "run"
    lora_run(out, checkpoint=base)
    assert not (out / "model.safetensors").exists() and (out / "adapter" / "adapter_model.safetensors").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["base"] == str(base.resolve()) and meta["base_sha256"] == checkpoint_digest(base)
    info = json.loads((out / "run.json").read_text())
    assert (info["base"], info["base_sha256"]) == (meta["base"], meta["base_sha256"])
    for ckpt in (out / "lightning").glob("*.ckpt"):  # the adapters (and their optimizer state) alone
        state = torch.load(ckpt, weights_only=False)["state_dict"]
        assert state and all("lora_" in k for k in state), sorted(state)[:3]
    adapter = lora_parameter_count(load_model(base).model, 2, "attn") * 4  # float32 bytes
    weights = (base / "model.safetensors").stat().st_size
    # the adapter, Adam's two moments, the checkpoint's bookkeeping: far below one copy of the base (8x the adapter)
    assert disk_bytes(out) < weights / 2, (disk_bytes(out), weights, adapter)
    assert os.path.samefile(out / "lightning" / "last.ckpt", out / "lightning" / "best-step4.ckpt")


def test_a_lora_run_loads_as_its_base_with_the_adapter(tmp_path, base, capsys):
    out = tmp_path / "run"
    merged, tok, _ = lora_run(out, checkpoint=base)
    x = torch.randint(0, tok.vocab_size, (2, 12))
    loaded = load_model(out)
    assert loaded.template.name == "decoderlab" and loaded.tokenizer.vocab_size == tok.vocab_size
    torch.testing.assert_close(loaded.model(x), merged(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(decoderlab.load(out).model(x), merged(x), atol=1e-6, rtol=0)
    assert (loaded.model(x) - load_model(base).model(x)).abs().max() > 1e-3  # (the adapter trained)
    export(out, tmp_path / "hf", format="hf")  # the merged model, written by export
    torch.testing.assert_close(load_model(tmp_path / "hf").model(x), merged(x), atol=1e-6, rtol=0)
    capsys.readouterr()
    assert cli.main(["generate", "--chat", "--checkpoint", str(out), "--max-new-tokens", "3", "hi"]) == 0


def test_an_interrupted_lora_run_resumes_to_the_adapter_of_an_uninterrupted_one(tmp_path, base):
    lora_run(tmp_path / "whole", checkpoint=base)
    with pytest.raises(TrainingInterrupted):
        lora_run(tmp_path / "cut", checkpoint=base, callbacks=[InterruptAt(3)])
    assert json.loads((tmp_path / "cut" / "meta.json").read_text())["step"] == 2
    lora_run(tmp_path / "cut", resume=True, train_config=None)
    adapters = [safe_open(str(tmp_path / run / "adapter" / "adapter_model.safetensors"), "pt") for run in ("whole", "cut")]
    assert sorted(adapters[0].keys()) == sorted(adapters[1].keys())
    for key in adapters[0].keys():
        assert torch.equal(adapters[0].get_tensor(key), adapters[1].get_tensor(key)), key


def test_a_changed_base_is_refused_by_name(tmp_path, base, capsys):
    out = tmp_path / "run"
    lora_run(out, checkpoint=base, steps=2)
    base_checkpoint(base, seed=1)  # another model under the same name
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    says = rf"the base {base.resolve()} of the LoRA run {out} has changed since the run \(sha256 "
    with pytest.raises(ValueError, match=says):
        load_model(out)
    with pytest.raises(ValueError, match=says):
        lora_run(out, resume=True, train_config=tiny_cfg(max_steps=4, batch_size=4, eval_every=2, lr=1e-2))
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(out), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decoderlab: error: the base {base.resolve()} of the LoRA run {out} has changed") and \
        err.count("\n") == 1, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing written
    base.rename(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match=rf"the base {base.resolve()} of the LoRA run {out} does not exist"):
        load_model(out)


def test_a_base_in_memory_is_kept_once_and_merge_writes_the_base_s_dtype(tmp_path):
    """A base with no file (a model given in memory) is kept in RUN_DIR/base; `merge` writes the merged model at the
    end in the base's dtype (a bfloat16 checkpoint's: bfloat16), an ordinary checkpoint."""
    model, tok = chat_pair(seed=0, d_model=64, n_layer=2, n_head=4)
    merged, _, _ = lora_run(tmp_path / "run", base_model=(model, tok), steps=2)
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["base"] == "base"
    x = torch.randint(0, tok.vocab_size, (2, 12))
    torch.testing.assert_close(load_model(tmp_path / "run").model(x), merged(x), atol=1e-6, rtol=0)

    base = base_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    merged, _, _ = lora_run(tmp_path / "merge", checkpoint=base, steps=2, merge=True)
    with safe_open(str(tmp_path / "merge" / "merged" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    ordinary = load_model(tmp_path / "merge" / "merged").model
    torch.testing.assert_close(ordinary(x), merged(x), atol=0.1, rtol=0)  # (bfloat16's rounding of the weights)
    with pytest.raises(ValueError, match=r"merge=True applies to a LoRA run"):
        finetune(CONVS, out=tmp_path / "full", checkpoint=base, merge=True, train_config=tiny_cfg(), val_fraction=0,
                 progress_bar=False, logger=False, accelerator="cpu")
    assert not (tmp_path / "full").exists()
