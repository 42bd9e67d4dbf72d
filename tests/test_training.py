"""Language-model training (issue 4): optimizer groups, schedule, batches, resume, DDP, checkpoints, bad input.

Tiny models, tiny corpora and a few steps each; the runs are shared through module-scoped fixtures.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import InterruptAt

from decoderlab import cli
from decoderlab.checkpoint import load_checkpoint, save_checkpoint
from decoderlab.data import RandomWindowBatches, SequentialWindows, read_corpus, window_offsets
from decoderlab.training import TokenDataModule
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import (NonFiniteLossError, TrainConfig, configure_optimizers, lr_at,
                                 parameter_groups, train_lm)

TINY = dict(d_model=16, n_layer=1, n_head=2, max_len=16)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text(shared_dir):
    return (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


def tiny_config(**kw):
    base = dict(max_steps=8, batch_size=4, warmup=2, eval_every=4, val_batches=2, val_batch_size=8, log_every=1)
    return TrainConfig(**{**base, **kw})


def run(text, out, cache, cfg=None, **kw):
    return train_lm(text=text, out=out, train_config=cfg or tiny_config(), model_overrides=TINY,
                    cache_dir=cache, progress_bar=False, accelerator="cpu", **kw)


# ---------------------------------------------------------------------------------------------------------
# optimizer and schedule
# ---------------------------------------------------------------------------------------------------------


def test_weight_decay_on_matrices_only():
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, bias=True, **TINY))
    decay, no_decay = parameter_groups(model)
    assert sorted(decay) == sorted(
        n for n in dict(model.named_parameters())
        if n.endswith((".qkv.weight", "attention.proj.weight", "mlp.fc.weight", "mlp.proj.weight"))
    )
    assert "we.weight" in no_decay and "pe.weight" in no_decay  # embeddings
    assert "fc_layer.weight" not in decay + no_decay  # tied to we.weight: counted once
    assert any(n.endswith("norm_1.weight") for n in no_decay) and any(n.endswith(".bias") for n in no_decay)
    opt = configure_optimizers(model, TrainConfig(weight_decay=0.1))["optimizer"]
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(p) for n, p in model.named_parameters() if n in decay}
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_parameters()
    # an untied output layer is a weight matrix like the others
    untied = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, tie_weights=False, **TINY))
    assert "fc_layer.weight" in parameter_groups(untied)[0]


def test_schedule_warmup_peak_cosine_end():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(4, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # peak at the end of warm-up
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)  # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4) and lr_at(500, cfg) == pytest.approx(1e-4)
    # the LambdaLR applies it after each optimizer step
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, **TINY))
    conf = configure_optimizers(model, cfg)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(111):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, cfg) for s in range(111)])


def test_bad_train_config_values():
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1, got 0"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match=r"lr \(learning rate\) must be a finite number > 0, got -0.001"):
        TrainConfig(lr=-1e-3)
    with pytest.raises(ValueError, match="precision must be one of auto, 32, bf16-mixed, 16-mixed, got '16'"):
        TrainConfig(precision="16")
    with pytest.raises(ValueError, match="min_lr must be between 0 and lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


# ---------------------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------------------


def test_windows_are_shifted_deterministic_and_split_over_ranks(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)
    path = tmp_path / "tokens.u16"
    tokens.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")[100:4000]  # a view into the file, as split_tokens gives
    whole = RandomWindowBatches(mm, max_len=8, batch_size=6, seed=7)
    for k in (0, 1, 57):
        x, y = whole[k]
        assert x.dtype == torch.int64 and x.shape == (6, 8)
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)  # consecutive ids: targets shifted
        starts = window_offsets(7, k, 6, len(mm) - 8) + 100
        assert torch.equal(x[:, 0], torch.from_numpy(starts))
        # 2 ranks with batch 3 take the two halves of the same global batch
        halves = [RandomWindowBatches(mm, 8, 3, 7, rank=r, world_size=2)[k][0] for r in (0, 1)]
        assert torch.equal(torch.cat(halves), x)
    assert not torch.equal(whole[0][0], whole[1][0])
    assert torch.equal(RandomWindowBatches(mm, 8, 6, seed=8)[0][0], RandomWindowBatches(mm, 8, 6, seed=8)[0][0])
    # a pickled dataset (a DataLoader worker) re-opens the file instead of carrying the data
    import pickle

    blob = pickle.dumps(whole)
    assert len(blob) < 2000
    assert torch.equal(pickle.loads(blob)[57][0], whole[57][0])


def test_validation_windows_cover_the_split_once():
    val = torch.arange(1, 102)  # 101 tokens, max_len 10 -> 10 windows predicting tokens 2..101
    ds = SequentialWindows(val.numpy(), max_len=10, batch_size=4)
    xs, ys = zip(*(ds[j] for j in range(len(ds))))
    assert len(ds) == 3 and [len(x) for x in xs] == [4, 4, 2]
    assert torch.equal(torch.cat(xs).flatten(), val[:100]) and torch.equal(torch.cat(ys).flatten(), val[1:101])
    assert len(SequentialWindows(val.numpy(), 10, 4, max_batches=2)) == 2


def test_datamodule_resumes_where_it_stopped():
    tokens = np.arange(3000, dtype=np.int64)
    dm = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=3)
    it = iter(dm.train_dataloader())
    first = [next(it)[0] for _ in range(5)]
    dm2 = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=0)
    dm2.load_state_dict({"seed": 3, "batches_served": 3, "batch_size": 4, "max_len": 8})
    it2 = iter(dm2.train_dataloader())
    assert torch.equal(next(it2)[0], first[3]) and torch.equal(next(it2)[0], first[4])


@pytest.mark.parametrize("n_train, n_val", [(5, 100), (100, 5)])
def test_split_shorter_than_a_window(n_train, n_val):
    with pytest.raises(ValueError, match=rf"train {n_train}, validation {n_val} tokens"):
        TokenDataModule(np.zeros(n_train, np.int64), np.zeros(n_val, np.int64), max_len=8, batch_size=2)


def test_corpus_too_short_or_empty(tmp_path, cache):
    with pytest.raises(ValueError, match=r"validation split has 10 tokens.*max_len\+1 = 17"):
        run("abcdefghij" * 10, tmp_path / "short", cache)  # 100 chars: train 90, validation 10
    with pytest.raises(ValueError, match="empty"):
        run("  \n ", tmp_path / "empty", cache)


# ---------------------------------------------------------------------------------------------------------
# runs: resume, NaN, compile
# ---------------------------------------------------------------------------------------------------------


class StopAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, text, cache):
    out = tmp_path_factory.mktemp("full") / "run"
    model, tok, summary = run(text, out, cache)
    return out, model, tok, summary


def test_run_directory_and_summary(full_run):
    out, model, tok, s = full_run
    assert s.steps == 8 and len(s.train_losses) == 8 and [h[0] for h in s.val_history] == [4, 8]
    assert s.train_losses[-1] < s.train_losses[0]
    assert s.val_bpb == pytest.approx(s.val_loss / math.log(2))  # char level, ASCII text: 1 byte per token
    assert (out / "lightning" / "last.ckpt").is_file() and list((out / "lightning").glob("best-step*.ckpt"))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["task"] == "lm" and meta["step"] == 8
    loaded, tok2 = load_checkpoint(out)
    assert tok2.vocab_size == tok.vocab_size
    x = torch.tensor(tok.encode("First Citizen:"))
    torch.testing.assert_close(loaded(x), model(x))
    assert (out / "logs" / "csv" / "version_0" / "metrics.csv").is_file()


def test_resume_reproduces_the_uninterrupted_run(full_run, tmp_path, text, cache):
    *_, uninterrupted = full_run
    out = tmp_path / "run"
    _, _, first = run(text, out, cache, callbacks=[StopAt(4)])
    assert first.steps == 4
    _, _, resumed = train_lm(text=text, resume=out, model_overrides=TINY, cache_dir=cache, progress_bar=False,
                             accelerator="cpu")
    assert resumed.steps == 8
    np.testing.assert_allclose(resumed.train_losses, uninterrupted.train_losses, rtol=0, atol=1e-6)
    assert resumed.val_loss == pytest.approx(uninterrupted.val_loss, abs=1e-6)
    # the resumed run logs to a new version; the first run's metrics are kept
    first_log = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text()
    assert "val_loss" in first_log and (out / "logs" / "csv" / "version_1" / "metrics.csv").is_file()


def test_resume_without_checkpoint(tmp_path, text, cache):
    with pytest.raises(FileNotFoundError, match=r"no training checkpoint .*nowhere.*last\.ckpt"):
        train_lm(text=text, resume=tmp_path / "nowhere", cache_dir=cache)


class PoisonAt(L.Callback):
    """Turns a weight into NaN before step ``step`` (1-based), as a diverging run would."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            with torch.no_grad():
                pl_module.model.blocks[0].mlp.fc.weight.fill_(float("nan"))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, text, cache):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 6.*last good checkpoint.*last\.ckpt"):
        run(text, out, cache, callbacks=[PoisonAt(6)])
    model, _ = load_checkpoint(out)
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ckpt = torch.load(out / "lightning" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_compiled_model_checkpoint_has_plain_keys(tmp_path, text, cache):
    from safetensors.torch import load_file

    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, **TINY))
    tok = CharTokenizer.from_text("abcdefghi")
    compiled = torch.compile(model)  # the wrapper, never run
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    save_checkpoint(tmp_path / "c", compiled, tok)
    assert not [k for k in load_file(str(tmp_path / "c" / "model.safetensors")) if "_orig_mod" in k]
    loaded, _ = load_checkpoint(tmp_path / "c")
    x = torch.tensor([1, 2, 3])
    torch.testing.assert_close(loaded(x), model.eval()(x))
    # a run with compile (the eager backend: dynamo's tracing without code generation)
    out = tmp_path / "run"
    m, _, s = run(text, out, cache, tiny_config(max_steps=2, eval_every=2, compile="eager"))
    assert not [k for k in load_file(str(out / "model.safetensors")) if "_orig_mod" in k]
    torch.testing.assert_close(load_checkpoint(out)[0](x), m(x))


# ---------------------------------------------------------------------------------------------------------
# checkpoints: atomic writes, mismatched tokenizer
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),  # the flag, not the field (issue 14)
    (["--lr", "-0.01"], "lr (learning rate) must be a finite number > 0, got -0.01"),
    (["--data", "/nonexistent/corpus.txt"], "corpus path /nonexistent/corpus.txt does not exist"),
    (["--resume", "/nonexistent/run"], "no training checkpoint /nonexistent/run/lightning/last.ckpt"),
])
def test_cli_train_bad_input(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_train_non_utf8_file(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Once upon a time\n".encode() * 3 + "caf\xe9".encode("latin-1"))
    assert cli.main(["train", "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "byte offset 54" in err


@pytest.mark.slow
def test_cli_train_and_sample(tmp_path, text, capsys, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "2", "--eval-every", "1",
                     "--batch-size", "2", "--warmup", "1", "--no-progress-bar"]) == 0
    printed = capsys.readouterr().out
    assert "for 2 steps: train loss" in printed and "val loss" in printed and "tokens per second" in printed
    assert json.loads((out / "run.json").read_text())["train_config"]["max_steps"] == 2
    assert cli.main(["sample", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "20",
                     "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first) == len("ROMEO:") + 20 + 1  # 20 characters and a newline
    assert cli.main(["sample", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "20",
                     "--seed", "1"]) == 0
    assert capsys.readouterr().out == first  # same seed, same sample


# ---------------------------------------------------------------------------------------------------------
# DDP: 2 processes (gloo on CPU) with batch B/2 each = 1 process with batch B
# ---------------------------------------------------------------------------------------------------------

DDP_SCRIPT = """
import sys
from decoderlab.training import TrainConfig, train_lm
text = open(sys.argv[1], encoding="utf-8").read()
cfg = TrainConfig(max_steps=4, batch_size={batch}, warmup=1, eval_every=2, val_batches=2, val_batch_size=8)
train_lm(text=text, out=sys.argv[2], train_config=cfg, model_overrides={tiny}, cache_dir=sys.argv[3],
         devices=2, strategy="ddp", accelerator="cpu", progress_bar=False)
"""


def test_ddp_two_processes_match_one(tmp_path, text, cache):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT).format(batch=2, tiny=TINY))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("DECODERLAB_RUN_DIR", None)
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "ddp"), str(cache)],
                          env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    cfg = TrainConfig(max_steps=4, batch_size=4, warmup=1, eval_every=2, val_batches=2, val_batch_size=8)
    single_model, _, single = run(text, tmp_path / "single", cache, cfg)
    assert len(ddp["train_losses"]) == 4
    np.testing.assert_allclose(ddp["train_losses"], single.train_losses, rtol=0, atol=1e-4)
    assert ddp["val_loss"] == pytest.approx(single.val_loss, abs=1e-4)
    ddp_model, _ = load_checkpoint(tmp_path / "ddp")  # written by rank 0 from the unwrapped module
    for (name, a), b in zip(ddp_model.state_dict().items(), single_model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=name)


def test_ctrl_c_says_what_was_kept(tmp_path, text, cache, capsys):
    out = tmp_path / "run"
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        run(text, out, cache, callbacks=[InterruptAt(6)])
    err = capsys.readouterr().err
    assert f"interrupted at step 6; the checkpoint in {out} (step 4) is loadable" in err
    assert f"decoderlab train --resume {out}" in err
    model, _ = load_checkpoint(out)
    assert json.loads((out / "meta.json").read_text())["step"] == 4


def test_ctrl_c_is_a_keyboard_interrupt_not_an_exit(tmp_path, text, cache):
    """Lightning answers Ctrl-C with sys.exit(1) and leaves SIGINT ignored: train_lm raises TrainingInterrupted
    (a KeyboardInterrupt) and restores the handler."""
    import signal

    from decoderlab.training import TrainingInterrupted

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match="training interrupted at step 2"):
        run(text, tmp_path / "run", cache, callbacks=[InterruptAt(2)])
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_cli_train_ctrl_c_exits_130_with_one_line(tmp_path, text):
    """`decoderlab train`, Ctrl-C: exit 130 (was 1) and decoderlab's one line (no "Detected KeyboardInterrupt,
    attempting graceful shutdown ..."); the checkpoint stays loadable."""
    import signal

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DECODERLAB_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DECODERLAB_RUN_DIR", None)
    p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "train", "--preset", "baby-shakespeare", "--data",
                          str(corpus), "--out", str(out), "--max-steps", "100000", "--eval-every", "2",
                          "--log-every", "1", "--batch-size", "2", "--val-batches", "1", "--n-layer", "1",
                          "--n-head", "2", "--d-model", "16", "--max-len", "16"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in p.stdout:  # wait for the first evaluation (a checkpoint is written after it)
            if " val loss " in line:
                break
        p.send_signal(signal.SIGINT)
        p.stdout.read()
        assert p.wait(timeout=120) == 130
        err = p.stderr.read()
    finally:
        p.kill()
    step = json.loads((out / "meta.json").read_text())["step"]
    assert re.fullmatch(rf"decoderlab: interrupted at step \d+; the checkpoint in {re.escape(str(out))} \(step "
                        rf"{step}\) is loadable\. Continue with: decoderlab train --resume {re.escape(str(out))}\n",
                        err), err
    load_checkpoint(out)


# ---------------------------------------------------------------------------------------------------------
# the command line tells what happens (issue 14): shape flags, plain progress lines, warnings, errors
# ---------------------------------------------------------------------------------------------------------

TRAIN_LINE = re.compile(r"step (\d)/4  train loss \d+\.\d{4}  lr \d\.\d\de-\d\d  [\d,]+ tokens/s  elapsed \d+:\d\d  "
                        r"ETA \d+:\d\d")
VAL_LINE = re.compile(r"step (\d)/4  val loss \d+\.\d{4}  perplexity \d+\.\d\d  \d+\.\d{3} bits per byte")


@pytest.mark.slow
def test_cli_train_plain_log_shape_flags_and_warnings(tmp_path, text, decoderlab_cli):
    """`decoderlab train --no-progress-bar ... > log.txt`: plain lines (no carriage returns), the model shape from
    the flags, decoderlab's own warnings only, a labelled summary; resuming the finished run says so."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    # (a plain model preset: the default recipe's full evaluation at the end is test_speedrun's)
    r = decoderlab_cli("train", "--preset", "baby-shakespeare", "--data", corpus, "--out", out, "--tokenizer", "bpe",
                       "--vocab-size", "20000",
                       "--max-steps", "4", "--eval-every", "2", "--log-every", "3", "--warmup", "4",
                       "--batch-size", "2", "--val-batches", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
                       "--max-len", "16", "--position", "rope", "--norm", "rmsnorm", "--no-progress-bar",
                       env={"DECODERLAB_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr
    vocab = json.loads((out / "config.json").read_text())["num_tokens"]
    assert r.stderr.splitlines() == [
        "decoderlab: warning: --warmup (4 steps) is at least --max-steps (4): the learning rate rises for the whole "
        "run and never reaches its peak or decays",
        f"decoderlab: warning: the BPE vocabulary has {vocab} tokens, fewer than the --vocab-size 20000 asked for: the "
        "text offers no more merges (a larger corpus would)",
    ]
    lines = r.stdout.splitlines()
    kinds = [("train", int(m[1])) if (m := TRAIN_LINE.fullmatch(ln)) else ("val", int(m[1]))
             if (m := VAL_LINE.fullmatch(ln)) else ln for ln in lines]
    assert kinds[:4] == [("val", 2), ("train", 3), ("train", 4), ("val", 4)]
    summary = json.loads((out / "summary.json").read_text())
    assert lines[4] == (f"trained baby-shakespeare ({summary['num_parameters']:,} parameters) for 4 steps: train loss "
                        f"{summary['train_loss']:.4f} (mean of the last 4 steps), "
                        f"{summary['tokens_per_second']:,.0f} tokens per second")
    assert lines[5].startswith(f"final evaluation at step 4: val loss {summary['val_loss']:.4f} nats/token (perplexity ")
    assert lines[5].endswith(f"; checkpoint written to {out}") and len(lines) == 6
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("n_layer", "n_head", "d_model", "max_len", "position", "norm")} == dict(
        n_layer=1, n_head=2, d_model=16, max_len=16, position="rope", norm="rmsnorm")
    rows = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert any(row.split(",")[header.index("train_loss")] for row in rows[1:])  # the train loss is in the CSV
    # the final evaluation (made after fit, at step 4) is logged too
    assert sum(1 for row in rows[1:] if row.split(",")[header.index("val_loss")]) == 2

    r = decoderlab_cli("train", "--resume", out, env={"DECODERLAB_CACHE": str(tmp_path / "cache")})
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"decoderlab: error: {out} is already finished: it trained 4 steps of --max-steps 4; to continue "
                        f"it, give a larger --max-steps: decoderlab train --resume {out} --max-steps 8\n")


def test_short_runs_log_their_train_loss():
    from decoderlab.training import make_trainer

    trainer = make_trainer(TrainConfig(max_steps=4, warmup=1), progress_bar="plain", logger=False)
    assert trainer.log_every_n_steps == 4  # log_every 50 would log nothing in a 4-step run


@pytest.mark.parametrize("argv, line", [
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),
    (["--devices", "0"], "--devices must be a number of devices >= 1, -1 (all), 'auto', or device indices such as "
                         "0,1; got '0' (see decoderlab train --help)"),
    (["--devices", "abc"], "--devices must be a number of devices >= 1, -1 (all), 'auto', or device indices such as "
                           "0,1; got 'abc' (see decoderlab train --help)"),
    (["--strategy", "dpp"], "--strategy 'dpp' is not a Lightning strategy; known: auto, ddp, ddp_spawn, ddp_fork, "
                            "ddp_notebook, deepspeed, fsdp, single_device, single_xla, xla, single_tpu (and variants "
                            "such as fsdp_cpu_offload, deepspeed_stage_2)"),
    (["--n-head", "3", "--d-model", "16"], "--d-model (16) must be divisible by --n-head (3); allowed --n-head for "
                                           "--d-model 16: 1, 2, 4, 8, 16"),
    (["--out", "notes.txt"], "--out notes.txt is a file, not a directory"),
    (["--out", "notes.txt/run"], "--out notes.txt/run: notes.txt is a file, not a directory"),
    (["--data", "weights.bin"], "weights.bin is a binary file, not text: it holds a NUL byte at byte offset 3; give a "
                                "UTF-8 text file"),
    (["--data", "model.pt"], "model.pt is not UTF-8 text: byte 0x80 at byte offset 0 is invalid (invalid start byte); "
                             "it is a binary file, not text (it holds a NUL byte at byte offset 2): give a UTF-8 text "
                             "file"),
    (["--data", "short.txt"], "the corpus is too short for --max-len=64: train split has 25 tokens and validation split "
                              "has 3 tokens, but each split needs at least --max-len+1 = 65 tokens (train 25, validation "
                              "3 tokens); use a longer corpus or a smaller --max-len"),
])
def test_cli_train_errors_name_the_flags(argv, line, tmp_path, decoderlab_cli):
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x00\x14\x00 binary")
    (tmp_path / "model.pt").write_bytes(b"\x80\x02\x00\x8a\nlz")  # a pickle's first bytes
    (tmp_path / "short.txt").write_text("To be, or not to be, that is")
    r = decoderlab_cli("train", *argv, cwd=tmp_path, env={"DECODERLAB_CACHE": str(tmp_path / "cache")})
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: {line}\n")


def test_progress_bar_counts_steps_also_after_a_resume(tmp_path, text, cache, capsys):
    out = tmp_path / "run"
    kw = dict(text=text, out=out, model_overrides=TINY, cache_dir=cache, accelerator="cpu", progress_bar=True)
    train_lm(train_config=tiny_config(max_steps=2, eval_every=2), **kw)
    first = capsys.readouterr().out
    kw["out"] = None
    train_lm(resume=out, config_overrides={"max_steps": 4}, **kw)
    second = capsys.readouterr().out
    for frames, start, total in ((first, 0, 2), (second, 2, 4)):
        train = [f for f in re.split(r"[\r\n]", frames) if f.strip()]
        assert "Epoch" not in frames and "v_num" not in frames
        assert re.match(rf"train:\s+\d+%\|[^|]*\| {start}/{total} \[", train[0]), train[0]
        last = [f for f in train if f.startswith("train")][-1]
        assert re.match(rf"train: 100%\|[^|]*\| {total}/{total} \[\d\d:\d\d<00:00,\s+[\d.]+step/s", last), last  # (tqdm pads a rate < 10)


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


def test_resuming_a_moved_run_is_quiet(tmp_path, text, cache, capsys):
    """Lightning's "dirpath has changed" warning (the run directory was moved: handled, run_dir is where it is now),
    its sync_dist hint for metrics LMMetrics has already summed over processes, and its banners stay away."""
    import shutil
    import warnings

    run(text, tmp_path / "a", cache, tiny_config(max_steps=2, eval_every=2))
    shutil.move(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, s = train_lm(text=text, resume=tmp_path / "b", config_overrides={"max_steps": 4}, model_overrides=TINY,
                           cache_dir=cache, progress_bar=False, accelerator="cpu")
    assert s.steps == 4
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "dirpath has changed" in m or "sync_dist" in m], said
    err = capsys.readouterr().err
    assert "Restoring states" not in err and "GPU available" not in err and "Trainer.fit" not in err, err


# ---------------------------------------------------------------------------------------------------------
# issue 13: metrics from exactly their data, resume with changed settings, validation over processes,
# option combinations, checkpoints in step
# ---------------------------------------------------------------------------------------------------------

ASCII_THEN_CYRILLIC = ("The quick brown fox jumps over the lazy dog.\n" * 41)[:1800] + (
    "Съешь же ещё этих мягких французских булок да выпей чаю " * 4)[:200]


@torch.no_grad()
def validation_nats_and_bytes(model, tok, val_tokens, max_len):
    """Independent of the trainer: nats summed over every validation target (the non-overlapping windows)
    and the UTF-8 bytes of those same targets, decoded."""
    n = (len(val_tokens) - 1) // max_len
    targets = torch.as_tensor(np.asarray(val_tokens[1:n * max_len + 1], dtype=np.int64)).view(n, max_len)
    inputs = torch.as_tensor(np.asarray(val_tokens[:n * max_len], dtype=np.int64)).view(n, max_len)
    logits = model.eval()(inputs)
    nats = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                                   reduction="sum"))
    return nats, targets.numel(), len(tok.decode(targets.reshape(-1).tolist()).encode("utf-8"))


def test_bits_per_byte_counts_the_bytes_of_the_validation_targets(tmp_path, cache):
    text = ASCII_THEN_CYRILLIC
    assert len(text) == 2000 and text[:1800].isascii() and not any(c.isascii() and c != " " for c in text[1800:])
    cfg = tiny_config(max_steps=4, eval_every=2, val_batches=None)
    model, tok, s = run(text, tmp_path / "run", cache, cfg)
    val = tok.encode_array(text)[1800:]  # the validation split: the Cyrillic tail (and its spaces)
    nats, targets, nbytes = validation_nats_and_bytes(model, tok, val, TINY["max_len"])
    assert s.val_loss == pytest.approx(nats / targets, rel=1e-5)
    assert s.val_ppl == pytest.approx(math.exp(nats / targets), rel=1e-5)
    assert s.val_bpb == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-5)
    whole_corpus = s.val_loss / (math.log(2) * len(text.encode("utf-8")) / len(text))  # the old, wrong value
    assert nbytes / targets > 1.8 and s.val_bpb < 0.65 * whole_corpus
    # the logged value is the same one
    rows = (tmp_path / "run" / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header, last_val = rows[0].split(","), [r for r in rows if r.split(",")[rows[0].split(",").index("val_bpb")]][-1]
    assert float(last_val.split(",")[header.index("val_bpb")]) == pytest.approx(s.val_bpb, rel=1e-6)


def test_resume_counts_wall_seconds_and_tokens_of_the_whole_run(tmp_path, text, cache):
    import time

    out = tmp_path / "run"
    _, _, first = run(text, out, cache, callbacks=[StopAt(4)])
    saved = torch.load(out / "lightning" / "last.ckpt", weights_only=False)["callbacks"]["LossHistory"]
    assert 0 < saved["wall_seconds"] <= first.wall_seconds
    t0 = time.perf_counter()
    _, _, resumed = train_lm(text=text, resume=out, model_overrides=TINY, cache_dir=cache, progress_bar=False,
                             accelerator="cpu")
    resume_seconds = time.perf_counter() - t0
    assert saved["wall_seconds"] < resumed.wall_seconds < saved["wall_seconds"] + resume_seconds
    assert resumed.train_seconds > first.train_seconds
    assert resumed.tokens_per_second * resumed.train_seconds == pytest.approx(8 * 4 * TINY["max_len"])


class LrRecorder(L.Callback):
    """The learning rate each optimizer step runs at: {0-based step: lr}."""

    def __init__(self):
        self.lrs = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def resume(out, cache, **kw):
    return train_lm(resume=out, model_overrides=TINY, cache_dir=cache, progress_bar=False, accelerator="cpu", **kw)


def test_resume_with_a_new_learning_rate_uses_it(tmp_path, text, cache, capsys):
    out = tmp_path / "run"
    run(text, out, cache, tiny_config(max_steps=4, lr=1e-3, eval_every=4))
    rec = LrRecorder()
    _, _, s = resume(out, cache, text=text, config_overrides={"lr": 2e-3, "max_steps": 8}, callbacks=[rec])
    assert "changed settings: max_steps 4 -> 8, lr 0.001 -> 0.002" in capsys.readouterr().err
    new = tiny_config(max_steps=8, lr=2e-3, eval_every=4)
    assert sorted(rec.lrs) == [4, 5, 6, 7] and s.steps == 8
    assert [rec.lrs[k] for k in range(4, 8)] == pytest.approx([lr_at(k, new) for k in range(4, 8)])
    info = json.loads((out / "run.json").read_text())
    assert info["train_config"]["lr"] == 2e-3 and info["train_config"]["max_steps"] == 8
    assert info["resumes"][-1]["changed"]["lr"] == [1e-3, 2e-3]
    # a later resume keeps the new rate (and changes nothing)
    rec = LrRecorder()
    resume(out, cache, text=text, config_overrides={"max_steps": 9}, callbacks=[rec])
    assert rec.lrs[8] == pytest.approx(lr_at(8, new.replace(max_steps=9)))


def test_resume_with_more_steps_recomputes_the_schedule(tmp_path, text, cache):
    out = tmp_path / "run"
    cfg = tiny_config(max_steps=10, warmup=5, lr=1e-2, min_lr=1e-3, eval_every=5)
    run(text, out, cache, cfg)
    rec = LrRecorder()
    resume(out, cache, text=text, config_overrides={"max_steps": 20}, callbacks=[rec])
    assert rec.lrs[10] == pytest.approx(0.00775)  # step 11: the new schedule's value at step 10, not 0.001
    longer = cfg.replace(max_steps=20)
    assert [rec.lrs[k] for k in range(10, 20)] == pytest.approx([lr_at(k, longer) for k in range(10, 20)])


def test_resume_refuses_settings_it_cannot_change(tmp_path, text, cache, capsys, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(cache))
    out = tmp_path / "run"
    run(text, out, cache, tiny_config(max_steps=2, eval_every=2))
    capsys.readouterr()  # (the first run's own warnings)
    for argv, message in [
        (["--tokenizer", "bpe"], "with tokenizer 'bpe': the run was trained with the 'char' tokenizer"),
        (["--seed", "7"], "with --seed=7: the run was trained with --seed=42"),
        (["--accumulate", "2"], "with --accumulate=2: the run was trained with --accumulate=1"),
        (["--preset", "shakespeare-char"], "with preset 'shakespeare-char': the run was trained with preset "
                                           "'baby-shakespeare'"),
    ]:
        assert cli.main(["train", "--resume", str(out), "--max-steps", "3", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decoderlab: error: cannot resume") and message in err, err
    with pytest.raises(ValueError, match=r"model setting d_model=32: the run's model has d_model=16"):
        train_lm(text=text, resume=out, model_overrides={**TINY, "d_model": 32}, cache_dir=cache)
    assert json.loads((out / "meta.json").read_text())["step"] == 2  # nothing trained


def test_validation_windows_split_over_processes_like_one_process():
    tokens = np.arange(1000, dtype=np.int64)

    def targets(ds):
        return [int(t) for j in range(len(ds)) for t in ds[j][1].flatten()]

    for batch_size, max_batches in [(4, None), (4, 3), (1, None), (64, 1), (5, 2)]:
        whole = SequentialWindows(tokens, 10, batch_size, max_batches)
        for world in (2, 3, 5):
            parts = [SequentialWindows(tokens, 10, batch_size, max_batches, rank, world) for rank in range(world)]
            assert all(len(p) >= 1 for p in parts)
            assert all(len(x) <= batch_size for p in parts for j in range(len(p)) for x in [p[j][0]])
            assert sorted(t for p in parts for t in targets(p)) == targets(whole)
    with pytest.raises(ValueError, match="the validation set has 2 windows of max_len\\+1 = 11 tokens for 3 processes"):
        SequentialWindows(tokens, 10, batch_size=1, max_batches=2, rank=2, world_size=3)


def run_group(cmd, timeout=300, **kw):
    """Run ``cmd`` in its own process group; on a timeout kill the whole group (launched ranks included), so a
    hanging multi-process run never outlives the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ddp_env(cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DECODERLAB_CACHE": str(cache)}
    env.pop("DECODERLAB_RUN_DIR", None)
    return env


def test_validation_has_fewer_windows_than_processes(tmp_path, text, cache):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text[:700], encoding="utf-8")  # validation: 70 tokens, 1 window of 65
    proc = run_group([str(Path(sys.executable).with_name("decoderlab")), "train", "--preset", "baby-shakespeare",
                      "--data", str(corpus), "--devices", "2", "--strategy", "ddp", "--max-steps", "1", "--out",
                      str(tmp_path / "run")],
                     timeout=120, env=ddp_env(cache), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "decoderlab: error: the validation set has 1 window of --max-len+1 = 65 tokens for 2 processes, and each "
        "process needs at least one: use fewer processes, more validation data (--val-fraction), more --val-batches "
        "or a larger val_batch_size"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "lightning").exists()


@pytest.mark.slow
def test_cli_ddp_with_one_validation_batch(tmp_path, text, cache):
    """The issue's command: 2 processes, 1 validation batch (64 windows shared out); the validation loss of
    one process with the same global batch."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    exe = Path(sys.executable).with_name("decoderlab")
    common = ["train", "--preset", "baby-shakespeare", "--data", str(corpus), "--max-steps", "2", "--eval-every", "1",
              "--val-batches", "1", "--no-progress-bar"]  # (a plain preset: no full evaluation at the end)
    proc = run_group([str(exe), *common, "--devices", "2", "--strategy", "ddp", "--batch-size", "2", "--out",
                      str(tmp_path / "ddp")], env=ddp_env(cache), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert cli.main([*common, "--batch-size", "4", "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert [h[0] for h in ddp["val_history"]] == [1, 2]
    np.testing.assert_allclose([h[1] for h in ddp["val_history"]], [h[1] for h in one["val_history"]], atol=1e-4)
    assert ddp["val_bpb"] == pytest.approx(one["val_bpb"], abs=1e-4)


MULTINODE_SCRIPT = """
import sys
from decoderlab.training import TrainConfig, train_lm
text = open(sys.argv[1], encoding="utf-8").read()
cfg = TrainConfig(max_steps=4, batch_size=2, warmup=1, eval_every=2, val_batches=3, val_batch_size=5)
train_lm(text=text, out=sys.argv[2], train_config=cfg, model_overrides={tiny}, cache_dir=sys.argv[3],
         devices=1, num_nodes=2, strategy="ddp", accelerator="cpu", progress_bar=False)
"""


def test_two_nodes_match_one_process(tmp_path, text, cache):
    """Two torchrun "nodes" on localhost (one process each, gloo): the losses of one process with the global
    batch; the 15 validation windows split 7 + 8."""
    import socket

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    script = tmp_path / "multinode.py"
    script.write_text(textwrap.dedent(MULTINODE_SCRIPT).format(tiny=TINY))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), str(script), str(corpus), str(tmp_path / "nodes"), str(cache)],
                              env=ddp_env(cache), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    nodes = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    cfg = TrainConfig(max_steps=4, batch_size=4, warmup=1, eval_every=2, val_batches=3, val_batch_size=5)
    _, _, single = run(text, tmp_path / "single", cache, cfg)
    np.testing.assert_allclose(nodes["train_losses"], single.train_losses, rtol=0, atol=1e-4)
    np.testing.assert_allclose([h[1] for h in nodes["val_history"]], [h[1] for h in single.val_history], atol=1e-4)
    assert [h[0] for h in nodes["val_history"]] == [2, 4]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_every_combination_of_precision_clipping_compile_accumulation_trains(precision, tmp_path, text, cache):
    import itertools

    for grad_clip, compile, accumulate in itertools.product([0.0, 1.0], [False, "eager"], [1, 2]):
        cfg = tiny_config(max_steps=1, eval_every=1, val_batches=1, precision=precision, grad_clip=grad_clip,
                          compile=compile, accumulate=accumulate)
        _, _, s = run(text, tmp_path / f"{grad_clip}-{compile}-{accumulate}", cache, cfg, logger=False)
        assert s.steps == 1 and math.isfinite(s.train_loss) and math.isfinite(s.val_loss), cfg


@pytest.mark.slow
def test_cli_bf16_with_clipping(tmp_path, text, capsys, monkeypatch):
    """The issue's command (on a small corpus): bf16-mixed with the default grad clip and the fused AdamW
    this build offers."""
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    assert cli.main(["train", "--precision", "bf16-mixed", "--max-steps", "3", "--data", str(corpus),
                     "--batch-size", "2", "--val-batches", "1", "--out", str(tmp_path / "run"),
                     "--no-progress-bar"]) == 0
    assert "for 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize("kw, message", [
    (dict(fused=True, precision="bf16-mixed"), "fused=True cannot be combined with precision='bf16-mixed' and "
                                               "grad_clip=1.0"),
    (dict(compile=""), "compile must be True, False or a torch.compile backend name"),
])
def test_combinations_refused_before_training(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**kw)


def test_unknown_compile_backend_is_refused_before_training(tmp_path, text, cache):
    with pytest.raises(ValueError, match="compile backend 'nosuch' is not one of this PyTorch's: .*eager"):
        run(text, tmp_path / "run", cache, tiny_config(compile="nosuch"))
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def run_25(tmp_path_factory, text, cache):
    out = tmp_path_factory.mktemp("r25") / "run"
    model, tok, s = run(text, out, cache, tiny_config(max_steps=25, eval_every=10))
    return out, model, s


def test_checkpoints_logs_and_model_describe_the_last_step(run_25):
    from safetensors.torch import load_file

    out, model, s = run_25
    assert [h[0] for h in s.val_history] == [10, 20, 25] and s.val_loss == s.val_history[-1][1]
    last = torch.load(out / "lightning" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 25 and json.loads((out / "meta.json").read_text())["step"] == 25
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(last["state_dict"][f"model.{name}"], tensor, rtol=0, atol=0)
    rows = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    cells = [dict(zip(header, r.split(","))) for r in rows[1:]]
    val_rows = [(int(c["step"]), float(c["val_loss"])) for c in cells if c["val_loss"]]
    assert [r[0] for r in val_rows] == [10, 20, 25]
    assert [r[1] for r in val_rows] == pytest.approx([h[1] for h in s.val_history])
    train_steps = [int(c["step"]) for c in cells if c["train_loss"]]
    assert train_steps == list(range(1, 26))  # step N: the N-th optimizer step's loss
    np.testing.assert_allclose([float(c["train_loss"]) for c in cells if c["train_loss"]], s.train_losses, atol=1e-6)
    lrs = [float(c[k]) for c in cells for k in header if k.startswith("lr-") and k.endswith("pg1") and c[k]]
    cfg = tiny_config(max_steps=25, eval_every=10)
    assert lrs == pytest.approx([lr_at(k, cfg) for k in range(25)])  # step N ran at lr_at(N - 1)
    bests = list((out / "lightning").glob("best-step*.ckpt"))
    assert len(bests) == 1
    best_step = int(bests[0].stem.removeprefix("best-step"))
    best = torch.load(bests[0], weights_only=False)
    assert best["global_step"] == best_step and best_step in dict(s.val_history)
    assert dict(s.val_history)[best_step] == min(v for _, v in s.val_history)


def test_damaged_last_checkpoint_falls_back_to_the_newest_intact_one(run_25, tmp_path, text, cache, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_25[0], out)
    best = next((out / "lightning").glob("best-step*.ckpt"))
    best_step = int(best.stem.removeprefix("best-step"))
    last = out / "lightning" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # truncated, as by a full disk
    # a damaged file named explicitly: refused, naming it
    with pytest.raises(ValueError, match=rf"cannot resume from {re.escape(str(last))}: the file is damaged"):
        resume(last, cache, text=text)
    _, _, s = resume(out, cache, text=text, config_overrides={"max_steps": best_step + 2})
    err = capsys.readouterr().err
    assert f"{last} is damaged" in err and f"resuming from {best} (step {best_step})" in err
    assert s.steps == best_step + 2 and s.val_history[-1][0] == best_step + 2
    assert torch.load(last, weights_only=False)["global_step"] == best_step + 2  # rewritten, intact
    # every checkpoint damaged: an error naming them
    for f in (out / "lightning").glob("*.ckpt"):
        f.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"no intact training checkpoint; damaged: .*last\.ckpt .*best-step"):
        resume(out, cache, text=text)


def test_out_of_range_training_seeds_are_refused(decoderlab_cli):
    """Training seeds go to Lightning's seed_everything, which seeds NumPy: 0 .. 2**32-1 (-1 was accepted)."""
    from decoderlab.training import train_pairs

    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"^seed must be an integer in 0 \.\. 2\*\*32-1, got {bad}$"):
            TrainConfig(seed=bad).validate()
        with pytest.raises(ValueError, match=r"seed must be an integer in 0 \.\. 2\*\*32-1"):
            train_pairs(seed=bad)
    TrainConfig(seed=2**32 - 1).validate()
    for command, extra in (("train", ()), ("finetune", ("--preset", "statquest", "--data", "x", "--out", "y"))):
        r = decoderlab_cli(command, *extra, "--seed", "99999999999999999999999")
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: --seed must be an integer in 0 .. "
                                                            f"2**32-1, got '99999999999999999999999' (see decoderlab "
                                                            f"{command} --help)\n")


def test_cli_train_bad_data_path_is_one_line(decoderlab_cli, tmp_path):
    """`train --data nonexistent.txt --max-steps 5` printed the warm-up warning before the error; /dev/null said
    "does not exist"."""
    tail = "(give a text file, a folder of .txt files, or nothing for the embedded tinyshakespeare)"
    for data, what in (("nonexistent.txt", "does not exist"), ("/dev/null", "is not a regular file")):
        r = decoderlab_cli("train", "--data", data, "--max-steps", "5", "--out", tmp_path / "run", cwd=tmp_path)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: corpus path {data} {what} {tail}\n")
    assert not (tmp_path / "run").exists()
