"""``decoderlab finetune`` (decoderlab.cli.finetune): the help shows fine-tuning's defaults from the config, a
closed output costs the run nothing, the lesson's template reproduces "awesome", a resume with a changed seed or
template is refused naming it, and the errors are one line."""

from __future__ import annotations

import json

import pytest
from tiny_runs import GOOD, one_thread, write  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab import cli
from decoderlab.config import (DEFAULT_TEMPLATE, DEFAULT_TOKENIZER, FINETUNE_EVAL_PROMPTS, FINETUNE_TRAIN,
                               FINETUNE_VAL_FRACTION, PRESETS, TEMPLATES, TOKENIZERS, TRAIN_DEFAULTS)

from .helps import actions, helps


def test_finetune_help_shows_the_fine_tuning_defaults():
    h = helps("finetune")
    assert h["--max-steps"] == "optimizer steps (default 500)"
    assert h["--lr"] == "peak learning rate (default 0.0003)"
    assert h["--n-layer"] == ("decoder blocks (default: baby-shakespeare 4, baby-shakespeare-speedrun 4, "
                              "shakespeare-char 6, gpt2 12, smollm2-135m 30)")
    assert "--val-batches" not in h
    a = actions("finetune")
    for field, value in {**TRAIN_DEFAULTS, **FINETUNE_TRAIN}.items():
        if field in a and a[field].help and field not in ("seed",):
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert a[field].help.endswith(f"(default {shown})"), field
    assert h["--val-fraction"].endswith(f"(default {FINETUNE_VAL_FRACTION:g})")
    assert h["--eval-prompts"].endswith(f"(default {FINETUNE_EVAL_PROMPTS})")
    assert h["--template"] == (f"chat template: {', '.join(TEMPLATES)}, or a *.jinja file (a Hugging Face chat "
                               f"template); a --checkpoint's own is kept (default {DEFAULT_TEMPLATE})")
    assert a["tokenizer"].choices == TOKENIZERS and h["--tokenizer"].endswith(f"(default {DEFAULT_TOKENIZER})")
    assert a["preset"].choices == tuple(PRESETS)


def test_the_templates_the_help_names_are_the_library_s():
    from decoderlab.chat import TEMPLATES as CHAT_TEMPLATES

    assert tuple(CHAT_TEMPLATES) == TEMPLATES


@pytest.mark.slow
def test_a_closed_output_costs_no_fine_tuning_state(closed_stdout_cli, tmp_path):
    data = tmp_path / "lesson.jsonl"
    data.write_text('{"prompt": "what is statquest", "completion": "awesome"}\n'
                    '{"prompt": "statquest is what", "completion": "awesome"}\n')
    out = tmp_path / "lesson"
    status, err = closed_stdout_cli("finetune", "--preset", "statquest", "--tokenizer", "word", "--template",
                                    "lesson", "--data", data, "--val-fraction", "0", "--out", out, "--max-steps",
                                    "4", "--eval-every", "2", "--warmup", "1", "--log-every", "100")
    assert status == 0 and "error" not in err and "Traceback" not in err, err
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    assert (out / "lightning" / "last.ckpt").is_file()


@pytest.mark.parametrize("grouped", [[], ["--group-by-length"]])
def test_cli_finetune_lesson_template_reproduces_awesome(tmp_path, capsys, grouped):
    data = tmp_path / "lesson.jsonl"
    data.write_text('{"prompt": "what is statquest", "completion": "awesome"}\n'
                    '{"prompt": "statquest is what", "completion": "awesome"}\n')
    out = tmp_path / "lesson"
    assert cli.main(["finetune", "--preset", "statquest", "--tokenizer", "word", "--template", "lesson", "--data",
                     str(data), "--val-fraction", "0", "--out", str(out), "--max-steps", "60", "--lr", "0.1",
                     "--min-lr", "0.1", "--warmup", "1", "--eval-every", "60", "--grad-clip", "0",
                     "--no-progress-bar", *grouped]) == 0
    capsys.readouterr()
    assert json.loads((out / "run.json").read_text())["train_config"]["group_by_length"] is bool(grouped)
    for prompt in ("what is statquest", "statquest is what"):
        assert cli.main(["generate", "--chat", "--checkpoint", str(out), prompt]) == 0
        assert capsys.readouterr().out == "awesome <EOS>\n"


def test_cli_errors(tmp_path, capsys):
    data = write(tmp_path, GOOD)
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(tmp_path / "o"),
                     "--template", "chatml9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: unknown chat template 'chatml9'; known templates: decoderlab, lesson")
    bad = write(tmp_path, GOOD, "{oops")
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "line 2: malformed JSON" in capsys.readouterr().err


def test_console_script_finetune_errors_in_one_line(decoderlab_cli, tmp_path, capsys):
    data = write(tmp_path, GOOD, "{oops")
    r = decoderlab_cli("finetune", "--preset", "statquest", "--data", data, "--out", tmp_path / "o")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"decoderlab: error: {data}, line 2: malformed JSON: Expecting property name enclosed in " \
                       f"double quotes (column 2)\n"
    with pytest.raises(SystemExit) as e:  # (in this process, as argparse refuses it: a process saved)
        cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(tmp_path / "o"), "--lr", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "decoderlab: error: --lr must be a number, got 'x' (see decoderlab finetune " \
                                      "--help)\n"


def test_finetune_data_that_is_not_a_regular_file(tmp_path, capsys):
    """/dev/null said "no conversation file /dev/null" (it exists: it is not a regular file)."""
    assert cli.main(["finetune", "--preset", "statquest", "--data", "/dev/null", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr() == ("", "decoderlab: error: conversation file /dev/null is not a regular file (give a "
                                       "JSONL file)\n")


def test_resume_with_a_changed_seed_or_template_is_refused_naming_it(tmp_path, capsys):
    """`finetune --resume` rebuilt the run from the fine-tuning defaults and refused nothing: a changed --seed or
    --template is now refused in one line naming it, and the run is left as it was."""
    data = write(tmp_path, GOOD, GOOD)
    out = tmp_path / "run"
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(out), "--max-steps", "2",
                     "--eval-every", "2", "--val-fraction", "0", "--eval-prompts", "1", "--no-progress-bar"]) == 0
    capsys.readouterr()
    step = (out / "meta.json").read_text()
    for flag, value, says in (("--seed", "7", "with --seed=7: the run was trained with --seed=42, and --seed cannot "
                                              "change on resume"),
                              ("--template", "lesson", "with template='lesson': the run was trained with "
                                                       "template='decoderlab'")):
        assert cli.main(["finetune", "--resume", "--out", str(out), "--data", str(data), "--max-steps", "4",
                         flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"decoderlab: error: cannot resume {out} {says}") and err.count("\n") == 1, err
    assert (out / "meta.json").read_text() == step  # nothing trained
    assert cli.main(["finetune", "--resume", "--out", str(out), "--data", str(data), "--max-steps", "3",
                     "--no-progress-bar"]) == 0  # the run's own settings: it goes on
    assert '"step": 3' in (out / "meta.json").read_text()


@pytest.mark.parametrize("row, says", [
    ({"prompt": "a", "rejected": "c"}, "line 2: "),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, "line 2: "),
])
def test_dpo_rows_missing_chosen_or_with_an_empty_rejected_are_one_line(tmp_path, capsys, row, says):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, row]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["finetune", "--method", "dpo", "--preset", "statquest", "--data", str(data), "--out",
                     str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decoderlab: error: {data}, {says}") and err.count("\n") == 1, err
    assert ("chosen" if "chosen" not in row else "rejected") in err


@pytest.mark.parametrize("more, says", [
    (("--lora-rank", "0"), "LoRA rank must be an integer >= 1, got 0"),
    (("--lora-rank", "2", "--lora-targets", "nothing"), "'nothing'"),
    (("--merge",), "--merge needs --lora-rank R"),
    (("--beta", "0.2"), "--beta=0.2 applies to method='dpo' (--method dpo) only"),
])
def test_bad_lora_and_dpo_settings_are_one_line(tmp_path, capsys, more, says):
    data = write(tmp_path, GOOD, GOOD)
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(tmp_path / "o"),
                     "--max-steps", "1", *more]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: ") and says in err and err.count("\n") == 1, err


def test_a_run_directory_alone_resumes_and_a_changed_data_file_is_refused(tmp_path, capsys):
    """`finetune --resume DIR` needs nothing else: the run directory records its data and is its output; the
    data file changed since is refused by its digest."""
    data = write(tmp_path, GOOD, GOOD)
    out = tmp_path / "run"
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(out), "--max-steps", "2",
                     "--eval-every", "2", "--val-fraction", "0", "--eval-prompts", "1", "--no-progress-bar"]) == 0
    assert cli.main(["finetune", "--resume", str(out), "--max-steps", "3", "--no-progress-bar"]) == 0
    assert json.loads((out / "meta.json").read_text())["step"] == 3
    assert cli.main(["finetune", "--resume", str(out / "lightning" / "last.ckpt"), "--max-steps", "4",
                     "--no-progress-bar"]) == 0
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    capsys.readouterr()
    data.write_text(GOOD + "\n", encoding="utf-8")
    assert cli.main(["finetune", "--resume", str(out), "--max-steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decoderlab: error: cannot resume {out}: the conversations differ") and \
        err.count("\n") == 1, err


@pytest.mark.parametrize("argv, says", [
    (["--preset", "statquest", "--out", "o"], "give --data PATH"),
    (["--preset", "statquest", "--data", "d.jsonl"], "give --out DIR"),
    (["--resume", "--data", "d.jsonl"], "--resume without a value continues --out"),
])
def test_a_new_run_still_needs_its_data_and_out(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["finetune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: ") and says in err and err.count("\n") == 1, err


def test_dtype_float32_keeps_a_lora_runs_gguf_base_in_float_and_the_line_says_which(tmp_path, capsys):
    """`finetune --checkpoint FILE.gguf --lora-rank R` trains over the file's blocks (the default, `--dtype auto`);
    `--dtype float32` over the dequantized float base, as run.json records and the LoRA line says; a dtype that is
    no base's is refused by argparse (exit 2)."""
    pytest.importorskip("gguf")
    pytest.importorskip("peft")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf
    from tiny_runs import CONVS

    bpe = byte_level_bpe(300, texts=[" ".join(m["content"] for c in CONVS for m in c) * 3])
    path = write_gguf(tmp_path / "base.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q8_0")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS), encoding="utf-8")
    argv = ["finetune", "--checkpoint", str(path), "--data", str(data), "--max-steps", "1", "--lora-rank", "2",
            "--eval-prompts", "0", "--no-progress-bar"]
    assert cli.main([*argv, "--out", str(tmp_path / "float"), "--dtype", "float32"]) == 0
    assert "over a float32 base" in capsys.readouterr().err
    assert json.loads((tmp_path / "float" / "run.json").read_text())["base_dtype"] == "float32"
    assert cli.main([*argv, "--out", str(tmp_path / "blocks")]) == 0
    assert "over the base's q8_0 blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(tmp_path / "q8"), "--dtype", "q8_0"])
    assert e.value.code == 2 and "invalid choice: 'q8_0'" in capsys.readouterr().err
