"""``decoderlab train`` (decoderlab.cli.train): the help shows the config's defaults, a closed output costs no
training state, an --out where no directory can be made is one line before any work; errors name the flags, the
plain log, Ctrl-C, resume refusals, DDP from the command line, training seeds, and bad data paths."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.caches import own_cache
from tiny_runs import TINY, cache, ddp_env, one_thread, run, run_group, text, tiny_config  # noqa: F401

from decoderlab import cli
from decoderlab.checkpoint import load_checkpoint
from decoderlab.cli.errors import FIELD_FLAGS
from decoderlab.cli.options import SHAPE_FIELDS, TRAIN_CHOICE_OPTIONS, TRAIN_OPTIONS
from decoderlab.config.presets import FIELD_DEFAULTS
from decoderlab.config import (DEFAULT_BPE_VOCAB_SIZE, DEFAULT_RECIPE, DEFAULT_TOKENIZER, MLPS, NORMS, OPTIMIZERS,
                               PAIR_TRAIN, POSITIONS, PRECISIONS, PRESETS, RECIPES, SCHEDULES, TOKENIZERS,
                               TRAIN_CHOICES, TRAIN_DEFAULTS)
from decoderlab.training import TrainConfig, train_lm


def _train_parser():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _shown(value) -> str:
    return "all" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def test_train_help_shows_the_config_defaults():
    """Each TrainConfig flag's help shows the default recipe's value, and TrainConfig's where the recipe keeps
    it; the lesson's flags show PAIR_TRAIN's; the choices are the config's names."""
    p = _train_parser()
    actions = {a.dest: a for a in p._actions}
    recipe = RECIPES[DEFAULT_RECIPE].train
    for _, field, _, _ in (*TRAIN_OPTIONS, *TRAIN_CHOICE_OPTIONS):
        text = actions[field].help
        base = "never" if field == "full_val_below" else _shown(TRAIN_DEFAULTS[field])
        if field in recipe and recipe[field] != TRAIN_DEFAULTS[field]:
            assert f"(default {_shown(recipe[field])}; {base} with a plain model preset" in text, field
        else:
            assert f"(default {base}" in text, field
        if field in PAIR_TRAIN:
            assert text.endswith(f"; statquest {PAIR_TRAIN[field]:g})"), field
    assert actions["epochs"].help.endswith(f"(default {PAIR_TRAIN['max_epochs']})")
    assert actions["seed"].help.endswith(f"(default {TRAIN_DEFAULTS['seed']})")
    assert actions["preset"].choices == TRAIN_CHOICES and set(TRAIN_CHOICES) == set(PRESETS) | set(RECIPES)
    assert actions["preset"].help.endswith(f"(default {DEFAULT_RECIPE})")
    assert (actions["tokenizer"].choices, actions["optimizer"].choices, actions["schedule"].choices,
            actions["precision"].choices) == (TOKENIZERS, OPTIMIZERS, SCHEDULES, PRECISIONS)
    assert actions["tokenizer"].help.endswith(f"(default {DEFAULT_TOKENIZER})")
    assert f"(default {DEFAULT_BPE_VOCAB_SIZE};" in actions["vocab_size"].help
    assert (actions["position"].choices, actions["norm"].choices, actions["mlp"].choices) == (POSITIONS, NORMS, MLPS)
    for field in SHAPE_FIELDS:
        for name, shape in PRESETS.items():
            shown = shape.get(field, FIELD_DEFAULTS.get(field))
            assert (f"{name} {shown}" in actions[field].help) == (name != "statquest"), (field, name)
    assert f"for {recipe['max_steps']} steps" in p.description


def test_the_library_reads_the_same_config():
    """What the help shows is what runs: the library's TrainConfig, presets, recipes and names are the config's
    own objects, not copies."""
    from decoderlab import config, model, positions, tokenizers, training
    from decoderlab.training import optim

    assert training.TrainConfig is config.TrainConfig and model.PRESETS is config.PRESETS
    assert not hasattr(training, "RECIPES")  # one home, decoderlab.config: no copy kept under another name
    assert (optim.OPTIMIZERS, optim.SCHEDULES, training.PRECISIONS) == (OPTIMIZERS, SCHEDULES, PRECISIONS)
    assert positions.POSITIONS is POSITIONS and (model.NORMS, model.MLPS) == (NORMS, MLPS)
    assert tuple(tokenizers.TOKENIZERS) == TOKENIZERS and tokenizers.DEFAULT_BPE_VOCAB_SIZE == DEFAULT_BPE_VOCAB_SIZE
    # every TrainConfig field with a flag is named by the flag in error messages
    assert {f for _, f, _, _ in TRAIN_OPTIONS} <= set(FIELD_FLAGS)


@pytest.mark.slow
def test_a_closed_output_costs_no_training_state(closed_stdout_cli, small_corpus, tiny_lm_flags, tmp_path):
    """`decoderlab train | head` stopped with "decoderlab: error: [Errno 32] Broken pipe" at the first progress
    line; when that was the first evaluation's, the run had no lightning/last.ckpt and could not be resumed.
    Now the run goes on to its last step, unprinted, and can be resumed."""
    out = tmp_path / "run"
    # --log-every above --max-steps: the first line written is the first evaluation's
    status, err = closed_stdout_cli("train", "--data", small_corpus, "--out", out, "--max-steps", "4",
                                    "--eval-every", "2", "--log-every", "100", *tiny_lm_flags)
    assert (status, err) == (0, "")
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    assert (out / "lightning" / "last.ckpt").is_file()
    status, err = closed_stdout_cli("train", "--resume", out, "--max-steps", "6")
    assert status == 0 and "error" not in err and "Traceback" not in err, err
    assert json.loads((out / "meta.json").read_text())["step"] == 6


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no directory can be made")
def test_an_out_where_no_directory_can_be_made_is_one_line(decoderlab_cli, tmp_path, capsys):
    """`train --out /proc/x` said "[Errno 2] No such file or directory: '/proc/x'" after reading the corpus and
    building the model; now one line naming --out, before any work."""
    r = decoderlab_cli("train", "--out", "/proc/x/run")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("decoderlab: error: --out /proc/x/run: cannot make this directory (No such file or "
                        "directory)\n")
    # a later refusal (in this process)
    assert cli.main(["train", "--out", str(tmp_path / "new" / "run"), "--epochs", "3"]) == 2
    assert "--epochs applies to --preset statquest only" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the check made nothing that stays


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),  # the flag, not the field
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
    assert cli.main(["sample", "--checkpoint", str(out), "ROMEO:", "--max-new-tokens", "20",
                     "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first) == len("ROMEO:") + 20 + 1  # 20 characters and a newline
    assert cli.main(["sample", "--checkpoint", str(out), "ROMEO:", "--max-new-tokens", "20",
                     "--seed", "1"]) == 0
    assert capsys.readouterr().out == first  # same seed, same sample


@pytest.mark.slow
def test_cli_train_ctrl_c_exits_130_with_one_line(tmp_path, text):
    """`decoderlab train`, Ctrl-C: exit 130 (was 1) and decoderlab's one line (no "Detected KeyboardInterrupt,
    attempting graceful shutdown ..."); the checkpoint stays loadable."""
    import signal

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DECODERLAB_CACHE": str(own_cache(tmp_path / "cache")),
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


TRAIN_LINE = re.compile(r"step (\d)/4  train loss \d+\.\d{4}  lr \d\.\d\de-\d\d  [\d,]+ tokens/s  elapsed \d+:\d\d  "
                        r"ETA \d+:\d\d")


VAL_LINE = re.compile(r"step (\d)/4  val loss \d+\.\d{4}  perplexity \d+\.\d\d  \d+\.\d{3} bits per byte")


@pytest.mark.slow
def test_cli_train_plain_log_shape_flags_and_warnings(tmp_path, text, decoderlab_cli, monkeypatch, capsys):
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
                       "--max-len", "16", "--position", "rope", "--norm", "rmsnorm", "--n-kv-head", "1",
                       "--rope-theta", "50000", "--no-progress-bar",
                       env={"DECODERLAB_CACHE": str(own_cache(tmp_path / "cache"))})
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr
    vocab = json.loads((out / "config.json").read_text())["num_tokens"]
    assert r.stderr.splitlines() == [
        f"decoderlab: warning: the BPE vocabulary has {vocab} tokens, fewer than the --vocab-size 20000 asked for: the "
        "text offers no more merges (a larger corpus would)",
        "decoderlab: warning: --warmup (4 steps) is at least --max-steps (4): the learning rate rises for the whole "
        "run and never reaches its peak or decays",
    ]
    lines = r.stdout.splitlines()
    kinds = [("train", int(m[1])) if (m := TRAIN_LINE.fullmatch(ln)) else ("val", int(m[1]))
             if (m := VAL_LINE.fullmatch(ln)) else ln for ln in lines]
    assert kinds[:4] == [("val", 2), ("train", 3), ("train", 4), ("val", 4)]
    summary = json.loads((out / "summary.json").read_text())
    assert lines[4] == (f"trained baby-shakespeare ({summary['num_parameters']:,} parameters) for 4 steps: train loss "
                        f"{summary['train_loss']:.4f} (mean of the last 4 steps), "
                        f"{summary['tokens_per_second']:,.0f} tokens per second")
    assert lines[5].startswith(f"final evaluation at step 4 on cpu: val loss {summary['val_loss']:.4f} nats/token (perplexity ")
    assert lines[5].endswith(f"; checkpoint written to {out}") and len(lines) == 6
    config = json.loads((out / "config.json").read_text())
    shape = ("n_layer", "n_head", "n_kv_head", "d_model", "max_len", "position", "rope_theta", "norm")
    assert {k: config[k] for k in shape} == dict(n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_len=16,
                                                 position="rope", rope_theta=50000.0, norm="rmsnorm")
    rows = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert any(row.split(",")[header.index("train_loss")] for row in rows[1:])  # the train loss is in the CSV
    # the final evaluation (made after fit, at step 4) is logged too
    assert sum(1 for row in rows[1:] if row.split(",")[header.index("val_loss")]) == 2

    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    assert cli.main(["train", "--resume", str(out)]) == 2  # (in this process: a process saved)
    assert capsys.readouterr() == ("", f"decoderlab: error: {out} is already finished: it trained 4 steps of "
                                       f"--max-steps 4; to continue it, give a larger --max-steps: decoderlab train "
                                       f"--resume {out} --max-steps 8\n")


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
    (["--n-head", "4", "--n-kv-head", "3", "--d-model", "16"],
     "--n-head (4) must be a multiple of --n-kv-head (3); allowed --n-kv-head: 0 (= --n-head), 1, 2, 4"),
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
def test_cli_train_errors_name_the_flags(argv, line, tmp_path, monkeypatch, capsys):
    """Each bad flag: exit 2, nothing on standard output, one line naming it (in this process: the console
    script's own path is the test below -- a process each took ~10 s of the suite's time)."""
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x00\x14\x00 binary")
    (tmp_path / "model.pt").write_bytes(b"\x80\x02\x00\x8a\nlz")  # a pickle's first bytes
    (tmp_path / "short.txt").write_text("To be, or not to be, that is")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    try:
        code = cli.main(["train", *argv])
    except SystemExit as e:  # argparse's own refusals exit, as they do from the console script
        code = e.code
    out = capsys.readouterr()
    assert (code, out.out, out.err) == (2, "", f"decoderlab: error: {line}\n")


def test_a_train_error_from_the_console_script_is_one_line(tmp_path, decoderlab_cli):
    r = decoderlab_cli("train", "--n-head", "3", "--d-model", "16", cwd=tmp_path,
                       env={"DECODERLAB_CACHE": str(tmp_path / "cache")})
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "decoderlab: error: --d-model (16) must be divisible by "
                                                  "--n-head (3); allowed --n-head for --d-model 16: 1, 2, 4, 8, 16\n")


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


@pytest.mark.slow
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
    """2 processes, 1 validation batch (64 windows shared out): the validation loss of
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


@pytest.mark.slow
def test_cli_bf16_with_clipping(tmp_path, text, capsys, monkeypatch):
    """bf16-mixed (on a small corpus) with the default grad clip and the fused AdamW
    this build offers."""
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    assert cli.main(["train", "--precision", "bf16-mixed", "--max-steps", "3", "--data", str(corpus),
                     "--batch-size", "2", "--val-batches", "1", "--out", str(tmp_path / "run"),
                     "--no-progress-bar"]) == 0
    assert "for 3 steps" in capsys.readouterr().out


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


def test_cli_train_bad_data_path_is_one_line(decoderlab_cli, tmp_path, capsys):
    """`train --data nonexistent.txt --max-steps 5` printed the warm-up warning before the error (the console
    script's whole standard error, in a process); /dev/null said "does not exist" (in this process)."""
    tail = "(give a text file, a folder of .txt files, or nothing for the embedded tinyshakespeare)"
    r = decoderlab_cli("train", "--data", "nonexistent.txt", "--max-steps", "5", "--out", tmp_path / "run", cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", f"decoderlab: error: corpus path nonexistent.txt does not exist {tail}\n")
    assert cli.main(["train", "--data", "/dev/null", "--max-steps", "5", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr() == ("", f"decoderlab: error: corpus path /dev/null is not a regular file {tail}\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_watch_heads_records_the_scores_and_the_loss_into_the_run(small_corpus, tiny_lm_flags, tmp_path, capsys,
                                                                   monkeypatch):
    from decoderlab.glassbox import all_head_scores
    from decoderlab.glassbox.watching import WATCH_FILE, probe_tokens, read_records

    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(small_corpus), "--out", str(out), "--max-steps", "4", "--watch-heads", "2",
                     "--eval-every", "4", "--no-progress-bar", *tiny_lm_flags]) == 0
    printed = capsys.readouterr().out
    assert f"head scores recorded every 2 steps in {out}/{WATCH_FILE}" in printed
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[0]["loss"] is None and all(0 < r["loss"] < 10 for r in records[1:])
    model, _ = load_checkpoint(out)  # the last record is the final model's scores on the probe
    want = all_head_scores(model, probe_tokens(model))
    for kind, table in records[-1]["scores"].items():
        assert np.allclose(table, want[kind].numpy(), atol=1e-5), kind


@pytest.mark.parametrize("argv, message", [
    (["--watch-heads", "0"], "--watch-heads must be >= 1, got 0"),
    (["--preset", "statquest", "--watch-heads", "5"], "--watch-heads applies to language-model presets only"),
])
def test_watch_heads_bad_input(argv, message, capsys, tmp_path):
    try:
        status = cli.main(["train", "--out", str(tmp_path / "run"), *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.count("\n") == 1, err


def test_the_lesson_s_run_keeps_a_checkpoint_that_resumes_with_more_epochs(tmp_path, capsys, closed_stdout_cli):
    """`train --preset statquest --out D` then `train --resume D --epochs 40`: the lesson's run keeps
    lightning/last.ckpt (also when the pipe closes early) and its resume to 40 epochs is the 40-epoch run."""
    from decoderlab.checkpoint import load_checkpoint

    out = tmp_path / "sq"
    status, err = closed_stdout_cli("train", "--preset", "statquest", "--out", out)
    assert status == 0 and "Traceback" not in err, err
    assert (out / "lightning" / "last.ckpt").is_file()
    assert cli.main(["train", "--resume", str(out)]) == 2  # nothing left to train: say how to go on
    assert "has trained 30 epochs already; to continue it, give more epochs (--epochs 60)" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(out), "--epochs", "40"]) == 0
    assert "for 40 epochs" in capsys.readouterr().out
    assert cli.main(["train", "--preset", "statquest", "--out", str(tmp_path / "forty"), "--epochs", "40"]) == 0
    a, _ = load_checkpoint(out)
    b, _ = load_checkpoint(tmp_path / "forty")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(out), "--epochs", "50", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err == f"decoderlab: error: cannot resume {out} with --lr=0.5: the run was trained with --lr=0.1; resume " \
                  f"with the run's own, or start a new run\n", err
