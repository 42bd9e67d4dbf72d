"""Checkpoints: a crash while saving keeps the previous one, one file mode for all files, and a tokenizer that
does not match the config is named."""

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_runs import TINY, cache, one_thread, run, text  # noqa: F401

from decoderlab import cli
from decoderlab.checkpoint import load_checkpoint, save_checkpoint
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import train_lm


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, text, cache):
    out = tmp_path_factory.mktemp("full") / "run"
    model, tok, summary = run(text, out, cache)
    return out, model, tok, summary, text


@pytest.mark.parametrize("inplace", [False, True])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch, inplace):
    import safetensors.torch

    tok = CharTokenizer.from_text("abcdefghi")
    torch.manual_seed(0)
    old = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **TINY))
    new = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **TINY))
    save_checkpoint(tmp_path / "ck", old, tok, inplace=inplace)

    def crash(model, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_model", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path / "ck", new, tok, inplace=inplace)
    loaded, _ = load_checkpoint(tmp_path / "ck")
    x = torch.tensor([1, 2, 3])
    torch.testing.assert_close(loaded(x), old.eval()(x))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "meta.json",
                                                                   "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary left behind


def test_checkpoint_tokenizer_mismatch(full_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(full_run[0], out, ignore=shutil.ignore_patterns("lightning", "logs"))
    config = json.loads((out / "config.json").read_text())
    config["num_tokens"] += 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer vocabulary size (\d+) does not match config num_tokens"):
        load_checkpoint(out)
    assert cli.main(["sample", "--checkpoint", str(out)]) == 2
    assert "does not match config num_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("inplace", [False, True])
def test_checkpoint_files_share_one_mode(tmp_path, inplace):
    """model.safetensors was 0600 (safetensors' own file) among 0644 files; now all get the umask's mode."""
    tok = CharTokenizer.from_text("abc")
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **TINY))
    old = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "ck", model, tok, inplace=inplace)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ck").iterdir()}
    assert modes == dict.fromkeys(["config.json", "meta.json", "model.safetensors", "tokenizer.json"], 0o644)


@pytest.mark.parametrize("field, value, says", [
    ("tie_weights", "no", "tie_weights must be True or False, got 'no'"),
    ("n_layer", "4", "n_layer must be a positive integer, got '4'"),
])
def test_a_hand_edited_config_is_refused_naming_the_field_and_the_file(full_run, tmp_path, capsys, field, value,
                                                                       says):
    """config.json with a wrong type: every reader (loading, the command line, a resumed run) names the field and
    the file (a resumed run named the field only)."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(full_run[0], out)
    config = json.loads((out / "config.json").read_text())
    config[field] = value
    (out / "config.json").write_text(json.dumps(config))
    want = f"{out / 'config.json'} is not a valid ModelConfig JSON file: {says}"
    with pytest.raises(ValueError) as e:
        load_checkpoint(out)
    assert str(e.value) == want
    assert cli.main(["generate", "--checkpoint", str(out), "hi"]) == 2
    assert capsys.readouterr().err == f"decoderlab: error: {want}\n"
    with pytest.raises(ValueError) as e:
        train_lm(text=full_run[4], resume=out, config_overrides={"max_steps": 9}, cache_dir=tmp_path / "cache",
                 progress_bar=False, accelerator="cpu")
    assert str(e.value) == want


@pytest.mark.parametrize("family", ["baby-shakespeare", "gpt2", "rope-rmsnorm", "llama-gqa"])
def test_loading_onto_a_device_builds_on_meta_and_gives_the_same_model(tmp_path, family):
    """``load_checkpoint(device=...)`` builds on the meta device and puts the file's tensors in place: the same
    weights and logits as the saved model, tied weights one tensor again, nothing left on meta as soon as it is
    loaded (rope's cos/sin, not in the file, are computed: before, they stayed on meta until a forward pass, so
    fine-tuning a rope base crashed when Lightning moved the model with ``.cpu()``), the model on the device
    asked for."""
    from tiny_models import make_model

    model = make_model(family, "sdpa", seed=4).float().eval()  # (float32, as training writes it)
    tok = CharTokenizer.from_text("".join(chr(0x100 + i) for i in range(model.config.num_tokens - 2)))
    assert tok.vocab_size == model.config.num_tokens  # (+ <PAD> and <EOS>)
    save_checkpoint(tmp_path / "ck", model, tok)
    loaded, _ = load_checkpoint(tmp_path / "ck", device="cpu")
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert not [n for n, t in [*loaded.named_parameters(), *loaded.named_buffers()] if t.is_meta]
    loaded.cpu()  # what Lightning's teardown does
    if model.config.tie_weights:
        assert loaded.fc_layer.weight is loaded.we.weight
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert not [n for n, t in [*loaded.named_parameters(), *loaded.named_buffers()] if t.is_meta]


def test_a_checkpoint_from_before_the_llama_fields_loads_unchanged(tmp_path):
    """A checkpoint whose config.json predates n_kv_head, head_dim, rope_theta, rope_layout, qkv_bias and
    qk_norm_gain loads as the model it was: the same tensors and logits (the defaults are the old model)."""
    from tiny_models import make_model

    model = make_model("rope-rmsnorm", "sdpa", seed=4).float().eval()
    tok = CharTokenizer.from_text("".join(chr(0x100 + i) for i in range(model.config.num_tokens - 2)))
    save_checkpoint(tmp_path / "ck", model, tok)
    path = tmp_path / "ck" / "config.json"
    new = ("n_kv_head", "head_dim", "rope_theta", "rope_layout", "qkv_bias", "qk_norm_gain")
    old = {k: v for k, v in json.loads(path.read_text()).items() if k not in new}
    path.write_text(json.dumps(old, indent=2, sort_keys=True))
    loaded, _ = load_checkpoint(tmp_path / "ck")
    assert loaded.config == model.config
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_device_this_machine_lacks_is_refused_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"device tpu: not a device decoderlab knows; allowed: auto, cpu, cuda, "
                                         r"cuda:N, mps \(this machine has: cpu"):
        load_checkpoint(tmp_path / "no such directory", device="tpu")
