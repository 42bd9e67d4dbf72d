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


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, text, cache):
    out = tmp_path_factory.mktemp("full") / "run"
    model, tok, summary = run(text, out, cache)
    return out, model, tok, summary


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
