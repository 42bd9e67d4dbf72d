"""``train_sae`` and ``decoderlab sae`` / ``decoderlab features`` (decoderlab.dictionary): a tiny language
model's activations streamed into an SAE on the Lightning loop, saved in SAELens's format; a resumed run equals
an uninterrupted one; every bad input is one error line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_runs import StopAt, cache, one_thread, text  # noqa: F401 -- fixtures

from decoderlab.dictionary import SAETrainConfig, load_sae_run, train_sae
from decoderlab.dictionary.run import EVAL_BATCH
from decoderlab.glassbox.features import evaluate_sae, held_out_windows
from decoderlab.glassbox.sae import SAE_CFG_FILE, SAE_WEIGHTS_FILE, SPARSITY_FILE
from decoderlab.training import TrainConfig, train_lm

from cli.glass_runs import check_html, check_png, one_error_line, run

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def lm(tmp_path_factory, text, cache):
    """A 2-layer character model trained 20 steps on a corpus file (its run.json records the file)."""
    root = tmp_path_factory.mktemp("sae-lm")
    corpus = root / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    cfg = TrainConfig(max_steps=20, batch_size=8, warmup=2, eval_every=20, val_batches=1, val_batch_size=8,
                      log_every=10)
    train_lm(corpus=corpus, out=root / "lm", train_config=cfg, cache_dir=cache, progress_bar=False,
             accelerator="cpu", model_overrides=dict(d_model=16, n_layer=2, n_head=2, max_len=16))
    return root / "lm"


def _cfg(**kw):
    base = dict(hook=HOOK, width=4, k=4, tokens=8 * 256, batch_tokens=256, checkpoint_every=4, log_every=4,
                eval_tokens=512, dead_steps=3, resample_every=4)
    return SAETrainConfig(**{**base, **kw})


def test_train_sae_writes_saelens_files_and_its_evaluation(lm, tmp_path):
    out = tmp_path / "sae"
    r = train_sae(lm, _cfg(), out=out, progress_bar=False)
    for name in (SAE_CFG_FILE, SAE_WEIGHTS_FILE, SPARSITY_FILE, "sae_run.json", "lightning/last.ckpt"):
        assert (out / name).is_file(), name
    assert torch.allclose(r.sae.W_dec.norm(dim=1), torch.ones(64), atol=1e-5)
    sae, settings = load_sae_run(out)
    assert torch.equal(sae.W_enc, r.sae.W_enc) and sae.k == 4 and sae.metadata["hook_name"] == HOOK
    summary = settings["summary"]
    assert summary["steps"] == 8 and summary["l0"] == pytest.approx(4.0)
    assert 0 <= summary["dead_share"] <= 1 and summary["ce_zero"] > summary["ce_clean"]
    # the summary is the library's evaluation of the saved SAE on the held-out split
    from decoderlab.chat import load_model
    from decoderlab.data import corpus_tokens, split_tokens

    loaded = load_model(lm)
    corpus = json.loads((lm / "run.json").read_text())["corpus"]
    _, val = split_tokens(corpus_tokens(open(corpus, encoding="utf-8").read(), loaded.tokenizer), 0.1)
    ev = evaluate_sae(loaded.model, sae, HOOK, held_out_windows(val, 16, 32), batch_size=EVAL_BATCH)
    assert ev.explained_variance == pytest.approx(summary["explained_variance"], abs=1e-9)
    assert ev.ce_loss_recovered == pytest.approx(summary["ce_loss_recovered"], abs=1e-9)


@pytest.mark.parametrize("l1", [False, True])
def test_a_resumed_run_equals_an_uninterrupted_one(lm, tmp_path, l1):
    extra = dict(k=None, l1_coefficient=0.5) if l1 else {}
    whole = train_sae(lm, _cfg(**extra), out=tmp_path / "whole", progress_bar=False)
    part = tmp_path / "part"
    train_sae(lm, _cfg(**extra), out=part, progress_bar=False, callbacks=[StopAt(4)])
    assert json.loads((part / "sae_run.json").read_text())["summary"]["steps"] == 4
    resumed = train_sae(lm, None, out=part, resume=True, progress_bar=False)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(resumed.sae, name), getattr(whole.sae, name)), name
    assert resumed.resampled == whole.resampled


def test_sae_and_features_commands(lm, tmp_path, capsys):
    out = tmp_path / "cli-sae"
    status, printed, err = run(capsys, "sae", "--checkpoint", lm, "--hook", HOOK, "--width", "2", "--k", "3",
                               "--tokens", "1024", "--batch-tokens", "256", "--out", out)
    assert status == 0, err
    assert "CE loss recovered" in printed and "step 4/4" in printed and f"wrote {out}" in printed
    png, page = tmp_path / "f.png", tmp_path / "f.html"
    status, printed, err = run(capsys, "features", "--sae", out, "--feature", "3", "--png", png, "--html", page,
                               "--tokens", "512")
    assert status == 0, err
    assert printed.startswith(f"feature 3 at {HOOK}: fires on") and "logit effects, promotes:" in printed
    check_png(png)
    check_html(page, f"feature 3 at {HOOK}")
    assert "Top activating contexts" in page.read_text()


def test_progress_and_evaluation_count_dead_features_by_one_measure(lm, tmp_path, capsys):
    """`sae` ended its progress with "dead 0/1152" and its table with "dead features 84%": the lines counted the
    features that had not fired for dead_steps steps (which each resampling resets), the table those that fired on
    none of the held-out tokens. Now both count the features that fired on none of the last N tokens, named, the
    lines over as many training tokens as the evaluation reads (512 here: 2 steps of 256)."""
    import re

    r = train_sae(lm, _cfg(eval_tokens=512), out=tmp_path / "sae", progress_bar="plain")
    printed = capsys.readouterr().out
    steps = re.findall(r"^step +(\d)/8 .* dead (\d+)/64 \(fired on none of the last ([\d,]+) tokens\) ", printed, re.M)
    assert [s[0] for s in steps] == ["4", "8"] and steps[-1][2] == "512"
    table = re.search(r"^dead \(fired on none of the 512 tokens\) +(\d+)/64 \(", r.evaluation.table(), re.M)
    assert table and int(table.group(1)) == r.evaluation.dead_features
    summary = json.loads((tmp_path / "sae" / "sae_run.json").read_text())["summary"]
    assert (summary["dead_in_training"], summary["dead_in_training_tokens"]) == (int(steps[-1][1]), 512)


def test_a_resampled_feature_that_has_not_fired_since_stays_dead_in_the_count():
    """The count of the progress lines is the last step each feature fired, which a resampling does not move (the
    resampling's own counter restarts: dead() is for AuxK and the next resampling)."""
    from decoderlab.dictionary.module import SAEModule
    from decoderlab.glassbox.sae import SparseAutoencoder

    module = SAEModule(SparseAutoencoder(4, 4, 2, seed=0), torch.nn.Linear(1, 1), HOOK, lr=1e-3, steps=10,
                       dead_steps=3)
    module.steps_done.fill_(10)
    module.last_fired.copy_(torch.tensor([0, 3, 7, 10]))  # never, at step 3, 7 and 10
    module.steps_since_fired.zero_()  # as right after a resampling
    assert int(module.dead().sum()) == 0
    assert module.fired_on_none(4) == (2, 4)  # none of steps 7..10: the first two
    assert module.fired_on_none(50) == (1, 10)  # a window longer than the run: all its steps


def test_the_evaluation_says_where_it_is(lm, tmp_path, capsys):
    """`sae` evaluated for 3.5 minutes after its last progress line: now a line as the evaluation starts, one at
    most every 5 s with the time left measured (likely none in a run this short: any there must read so), and
    one when it ends."""
    import re

    status, printed, err = run(capsys, "sae", "--checkpoint", lm, "--hook", HOOK, "--width", "2", "--k", "3",
                               "--tokens", "512", "--batch-tokens", "256", "--out", tmp_path / "sae")
    assert status == 0, err
    lines = printed.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("evaluation: "))
    end = next(i for i, ln in enumerate(lines) if re.match(r"evaluation [\d,]+/[\d,]+ held-out tokens in ", ln))
    n = re.fullmatch(r"evaluation: ([\d,]+) held-out tokens \.\.\.", lines[start]).group(1)
    assert lines[start - 1].startswith("step 2/2 ") and lines[end + 1].startswith("tokens ") and start < end
    assert re.search(r"tokens/s  elapsed \d+:\d\d  ETA 0:00$", lines[start - 1])  # training's lines, measured too
    assert re.fullmatch(rf"evaluation {n}/{n} held-out tokens in \d+:\d\d", lines[end])
    for line in lines[start + 1:end]:
        assert re.fullmatch(rf"evaluation [\d,]+/{n} held-out tokens  elapsed \d+:\d\d  ETA \d+:\d\d", line)


def test_bad_inputs_are_one_error_line(lm, tmp_path, capsys, statquest_checkpoint):
    base = ("sae", "--checkpoint", lm, "--tokens", "1024", "--batch-tokens", "256")
    msg = one_error_line(capsys, *base, "--hook", "blocks.5.hook_resid_post", "--out", tmp_path / "a")
    assert msg.startswith("--hook 'blocks.5.hook_resid_post' is not a hook point of this model; valid hooks: "
                          "hook_embed, ") and "blocks.1.hook_resid_post" in msg
    for flag, value, want in (("--width", "0", "--width must be >= 1, got 0 (see decoderlab sae --help)"),
                              ("--width", "-3", "--width must be >= 1, got -3"),
                              ("--k", "0", "--k must be >= 1, got 0"),
                              ("--k", "-2", "--k must be >= 1, got -2"),
                              ("--k", "200", "--k must be at most the number of features width x d_in = 8 x 16 "
                                             "= 128, got 200")):
        assert one_error_line(capsys, *base, flag, value, "--out", tmp_path / "b").startswith(want)
    assert one_error_line(capsys, "sae", "--checkpoint", lm, "--tokens", "100", "--out", tmp_path / "c") == (
        "--tokens 100 is fewer than one batch of 4096 tokens; give at least 4096")
    msg = one_error_line(capsys, "sae", "--checkpoint", statquest_checkpoint, "--hook", "blocks.0.hook_resid_post",
                         "--out", tmp_path / "d")
    assert msg.startswith(f"checkpoint {statquest_checkpoint} records no training corpus") and "--data PATH" in msg
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_features_out_of_range_is_one_error_line(lm, tmp_path, capsys):
    out = tmp_path / "s"
    train_sae(lm, _cfg(tokens=256), out=out, progress_bar=False)
    assert one_error_line(capsys, "features", "--sae", out, "--feature", "64") == (
        "--feature 64 is out of range; valid features are 0 .. 63 (d_sae=64)")
    assert one_error_line(capsys, "features", "--sae", out, "--feature", "-1").startswith(
        "--feature -1 is out of range")
    assert "is not an SAE directory" in one_error_line(capsys, "features", "--sae", tmp_path, "--feature", "0")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama written as a GGUF file (2 layers, max_len 64; tests/support/gguf_files.py) and a text
    of a few thousand of its tokens."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    import random

    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    root = tmp_path_factory.mktemp("sae-gguf")
    bpe = byte_level_bpe(300)
    write_gguf(root / "tiny.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe)
    rng = random.Random(0)
    words = "the king and queen of the realm spoke to the people about bread and peace".split()
    (root / "words.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(120)))
    return root / "tiny.gguf", root / "words.txt"


def test_sae_on_a_gguf_file_without_hook_reads_its_middle_layer(tiny_gguf, tmp_path, capsys):
    """`sae --checkpoint x.gguf` without --hook said "x.gguf/config.json does not exist": the default hook was read
    from a directory's config.json only."""
    path, words = tiny_gguf
    status, printed, err = run(capsys, "sae", "--checkpoint", path, "--data", words, "--tokens", "256",
                               "--batch-tokens", "128", "--width", "1", "--k", "4", "--out", tmp_path / "sae")
    assert status == 0, err
    sae, settings = load_sae_run(tmp_path / "sae")
    assert settings["config"]["hook"] == sae.metadata["hook_name"] == "blocks.1.hook_resid_post"  # 2 layers // 2
    assert settings["checkpoint"] == str(path.resolve()) and "CE loss recovered" in printed


def test_sae_names_a_bad_value_before_the_checkpoint_hides_it(tiny_gguf, tmp_path, capsys):
    """The GGUF file's config.json message hid `--tokens 0` and a 12-byte --data; now --tokens is named as the line
    is parsed, and a corpus too short for a training and a held-out window before training, not after it."""
    path, _ = tiny_gguf
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("twelve bytes")
    assert one_error_line(capsys, "sae", "--checkpoint", path, "--data", tiny, "--tokens", "0", "--out",
                          tmp_path / "a") == "--tokens must be >= 1, got 0 (see decoderlab sae --help)"
    msg = one_error_line(capsys, "sae", "--checkpoint", path, "--data", tiny, "--out", tmp_path / "b")
    assert msg.startswith(f"--data {tiny} is too short: its ") and "needs one window of 65 tokens" in msg, msg
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
