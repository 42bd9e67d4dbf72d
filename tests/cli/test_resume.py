"""A resume takes its run's options (decoderlab.cli.resume, one implementation for train, finetune and rl): an
option run.json did not hold (`finetune --eval-prompts`, `train --watch-heads`) was forgotten by `--resume`; now
every option is recorded and restored, a different one is refused naming both values, and the resume's first
line says the step it resumes from."""

from __future__ import annotations

import json

from support.interaction import InterruptAt
from tiny_runs import conv, one_thread, text  # noqa: F401  (one_thread: an autouse fixture; text: a fixture)

import decoderlab.finetuning.run as finetuning_run
import decoderlab.training.lm as training_lm
from decoderlab import cli


def interrupted_at(monkeypatch, module, step: int) -> None:
    """Ctrl-C at ``step`` in every run ``module`` makes (its ``make_trainer`` gets an :class:`InterruptAt`)."""
    make = module.make_trainer

    def with_interrupt(*args, callbacks=(), **kw):
        return make(*args, callbacks=[*callbacks, InterruptAt(step)], **kw)

    monkeypatch.setattr(module, "make_trainer", with_interrupt)


def conversations(tmp_path, n=4):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", f"a{i}")}) + "\n" for i in range(n)))
    return data


FINETUNE = ("--preset", "statquest", "--max-steps", "4", "--eval-every", "2", "--val-fraction", "0",
            "--no-progress-bar")


def test_an_interrupted_finetune_resumes_with_its_eval_prompts_and_says_the_step(tmp_path, capsys, monkeypatch):
    """`finetune --eval-prompts 1`, interrupted at step 2 and resumed with `--resume DIR` alone, answered the
    default 100 prompts at its end (the option was in no run.json) and said nothing of where it resumed."""
    out, data = tmp_path / "run", conversations(tmp_path)
    with monkeypatch.context() as m:
        interrupted_at(m, finetuning_run, 2)
        assert cli.main(["finetune", "--data", str(data), "--out", str(out), "--eval-prompts", "1", *FINETUNE]) == 130
    capsys.readouterr()
    assert cli.main(["finetune", "--resume", str(out), "--no-progress-bar"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["evaluation"]["prompts"] == 1  # (4 conversations to answer)
    err = capsys.readouterr().err
    assert err.startswith(f"decoderlab: resuming from step 2 of 4 ({out / 'lightning' / 'last.ckpt'})\n"), err
    assert json.loads((out / "run.json").read_text())["options"]["eval_prompts"] == 1


def test_a_resume_with_another_option_is_refused_naming_both_values(tmp_path, capsys):
    out, data = tmp_path / "run", conversations(tmp_path)
    assert cli.main(["finetune", "--data", str(data), "--out", str(out), "--eval-prompts", "1", *FINETUNE]) == 0
    capsys.readouterr()
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    for more, given, stored in ((["--eval-prompts", "3"], "--eval-prompts 3", "--eval-prompts 1"),
                                (["--lora-rank", "2"], "--lora-rank 2", "no --lora-rank")):
        assert cli.main(["finetune", "--resume", str(out), "--max-steps", "6", *more]) == 2
        assert capsys.readouterr().err == (
            f"decoderlab: error: cannot resume {out} with {given}: the run has {stored}, and a resume takes the "
            f"run's options; resume without {more[0]}, or start a new run\n")
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_train_resume_keeps_watch_heads(tmp_path, text, capsys, monkeypatch):  # noqa: F811
    """`train --watch-heads 1`, interrupted and resumed, recorded no head scores after the resume."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    argv = ["--preset", "baby-shakespeare", "--data", str(corpus), "--n-layer", "1", "--n-head", "2", "--d-model",
            "16", "--max-len", "16", "--batch-size", "2", "--val-batches", "1", "--max-steps", "4", "--eval-every",
            "2", "--no-progress-bar"]
    with monkeypatch.context() as m:
        interrupted_at(m, training_lm, 3)
        assert cli.main(["train", *argv, "--out", str(out), "--watch-heads", "1"]) == 130
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(out), "--no-progress-bar"]) == 0
    assert capsys.readouterr().err.startswith("decoderlab: resuming from step 2 of 4 (")  # (the last checkpoint's)
    steps = [json.loads(line)["step"] for line in (out / "head_scores.jsonl").read_text().splitlines()]
    assert steps[-2:] == [3, 4], steps
