"""train_lm: a run's directory and summary, resume equal to the uninterrupted run, the NaN guard, compile,
Ctrl-C, the progress bar, exact metrics, changed settings on resume, DDP and two nodes equal one process."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import lightning as L
import numpy as np
import pytest
import torch
from support.interaction import InterruptAt
from tiny_runs import TINY, StopAt, cache, ddp_env, one_thread, resume, run, text, tiny_config  # noqa: F401

from decoderlab.checkpoint import load_checkpoint, save_checkpoint
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import NonFiniteLossError, TrainConfig, lr_at, train_lm


def test_corpus_too_short_or_empty(tmp_path, cache):
    with pytest.raises(ValueError, match=r"validation split has 10 tokens.*max_len\+1 = 17"):
        run("abcdefghij" * 10, tmp_path / "short", cache)  # 100 chars: train 90, validation 10
    with pytest.raises(ValueError, match="empty"):
        run("  \n ", tmp_path / "empty", cache)


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


@pytest.mark.slow
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


DDP_SCRIPT = """
import sys
from decoderlab.training import TrainConfig, train_lm
text = open(sys.argv[1], encoding="utf-8").read()
cfg = TrainConfig(max_steps=4, batch_size={batch}, warmup=1, eval_every=2, val_batches=2, val_batch_size=8)
train_lm(text=text, out=sys.argv[2], train_config=cfg, model_overrides={tiny}, cache_dir=sys.argv[3],
         devices=2, strategy="ddp", accelerator="cpu", progress_bar=False)
"""


@pytest.mark.slow
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


MULTINODE_SCRIPT = """
import sys
from decoderlab.training import TrainConfig, train_lm
text = open(sys.argv[1], encoding="utf-8").read()
cfg = TrainConfig(max_steps=4, batch_size=2, warmup=1, eval_every=2, val_batches=3, val_batch_size=5)
train_lm(text=text, out=sys.argv[2], train_config=cfg, model_overrides={tiny}, cache_dir=sys.argv[3],
         devices=1, num_nodes=2, strategy="ddp", accelerator="cpu", progress_bar=False)
"""


@pytest.mark.slow
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


def test_unknown_compile_backend_is_refused_before_training(tmp_path, text, cache):
    with pytest.raises(ValueError, match="compile backend 'nosuch' is not one of this PyTorch's: .*eager"):
        run(text, tmp_path / "run", cache, tiny_config(compile="nosuch"))
    assert not (tmp_path / "run").exists()




# ---------------------------------------------------------------------------------------------------------
# the Python API's own messages
# ---------------------------------------------------------------------------------------------------------


def test_text_given_where_a_path_belongs_is_named_by_its_size(text, tmp_path):
    """`train_lm(corpus)` with the text itself (200 KB) raised "OSError: [Errno 36] File name too long" and
    repeated the whole text; now one sentence with its size, and how to pass text."""
    big = (text * 17)[:200_000]
    with pytest.raises(ValueError) as e:
        train_lm(big, out=tmp_path / "run")
    said = str(e.value)
    assert said == (f"the corpus path is a str of 200,000 characters ({big.count(chr(10)) + 1:,} lines), which is text, "
                    f"not the name of a file: give a text file or a folder of .txt files, or pass the text itself as "
                    f"text= (train_lm(text=...))")
    with pytest.raises(ValueError, match=r"^the corpus path \(300 characters\) is too long for a file name") as e:
        train_lm("x" * 300, out=tmp_path / "run")  # one line, but longer than a file name may be
    assert "xxxxxxxxxx" not in str(e.value) and not (tmp_path / "run").exists()


def test_a_subset_and_a_full_evaluation_are_labelled(tmp_path, text, cache, capsys):
    """The last two plain lines of a run that evaluates a subset while training and all windows at the end both
    read "step N/N val loss ..."; they say which windows they covered."""
    cfg = tiny_config(max_steps=2, eval_every=2, val_batches=1, val_batch_size=4, full_val_at_end=True)
    _, _, s = run(text, tmp_path / "run", cache, cfg, progress_bar="plain")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " val loss " in ln]
    windows = (1200 - 1) // TINY["max_len"]  # the validation split: the last 10% of 12,000 characters
    assert len(lines) == 2 and lines[0].startswith("step 2/2  val loss ") and lines[1].startswith("step 2/2  val loss ")
    assert lines[0].endswith("  (first 4 windows)") and lines[1].endswith(f"  (all {windows} windows)"), lines
    assert f"val loss {s.val_loss:.4f}" in lines[1]
