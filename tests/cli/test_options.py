"""The shared option groups (decoderlab.cli.options): a row is a flag of every command of the group, read back
with the others; the readers return only what was given."""

from __future__ import annotations

import argparse
import re

import pytest
from tiny_models import one_thread  # noqa: F401 -- autouse

from decoderlab.cli import main as cli_main
from decoderlab.cli.options import (SAMPLING_OPTIONS, add_options, dest, given, model_overrides, option,
                                    train_overrides)

from .helps import command_parser


def test_a_row_is_a_flag_of_the_group_and_its_reader():
    # a made-up flag, not one of the group's: a row with a callable help
    rows = (*SAMPLING_OPTIONS, option("--typical-p", type=float, metavar="P", help=lambda w: f"typical ({w['where']})"))
    p = argparse.ArgumentParser()
    add_options(p, rows, temperature_help="t", where="here")
    args = p.parse_args(["--typical-p", "0.1", "--top-k", "5"])
    assert given(args, rows) == {"top_k": 5, "typical_p": 0.1}
    assert [dest(r) for r in rows] == ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "min_p",
                                       "repetition_penalty", "frequency_penalty", "presence_penalty", "json_schema",
                                       "typical_p"]
    assert {a.dest: a.help for a in p._actions}["typical_p"] == "typical (here)"


def test_the_readers_return_what_was_given():
    args = command_parser("train").parse_args(["--lr", "0.01", "--n-layer", "2", "--seed", "3", "--compile"])
    assert train_overrides(args) == {"lr": 0.01, "seed": 3, "compile": True}
    assert model_overrides(args) == {"n_layer": 2}
    args = command_parser("finetune").parse_args(["--data", "d", "--out", "o", "--max-steps", "9"])
    assert train_overrides(args, ("val_batches", "full_val_below")) == {"max_steps": 9}


# ---------------------------------------------------------------------------------------------------------
# --device: one line naming what this machine has, before anything is loaded (or a port bound)
# ---------------------------------------------------------------------------------------------------------

def _one_gpu(monkeypatch):
    """torch's CUDA answers stand for a machine with one GPU (nothing is put on it)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


_DEVICE_LINES = {
    "cuda": "--device cuda: no CUDA GPU here (torch.cuda.is_available() is False); this machine has: cpu",
    "mps": "--device mps: Apple MPS is on Apple silicon Macs only (macOS 12.3 or later, a PyTorch built with MPS); "
           "this machine has: cpu",
    "cuda:7": "--device cuda:7: there is no CUDA GPU 7, only 1 (cuda:0); this machine has: cpu, cuda:0",
    "tpu": "--device tpu: not a device decoderlab knows; allowed: auto, cpu, cuda, cuda:N, mps (this machine has: "
           "cpu)",
}


@pytest.mark.parametrize("command, name", [*(("generate", n) for n in _DEVICE_LINES),
                                           *((c, "tpu") for c in ("sample", "chat", "explain", "serve"))])
def test_a_device_this_machine_lacks_is_one_line_naming_what_it_has(command, name, lm_checkpoint, capsys,
                                                                    monkeypatch):
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("the lines are this CPU machine's")
    if name == "cuda:7":
        _one_gpu(monkeypatch)
    argv = [command, "--checkpoint", str(lm_checkpoint), "--device", name]
    code = cli_main(argv + (["to be"] if command in ("generate", "sample", "explain") else []))
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"decoderlab: error: {_DEVICE_LINES[name]}\n")


def test_generate_on_the_device_given_and_compiled(lm_checkpoint, capsys, monkeypatch):
    """--device cpu loads there; --compile decodes with model.compile_decode's step (the same text)."""
    import torch

    import decoderlab.model

    made = {}
    real = decoderlab.model.DecoderOnlyTransformer.compile_decode

    def compile_decode(self, **options):  # the "eager" backend: the graph without the C++ compiler
        made["compiled"] = True
        return real(self, backend="eager")

    monkeypatch.setattr(decoderlab.model.DecoderOnlyTransformer, "compile_decode", compile_decode)
    argv = ["generate", "--checkpoint", str(lm_checkpoint), "--no-stream", "--temperature", "0",
            "--max-new-tokens", "12", "--device", "cpu", "to be"]
    assert cli_main(argv) == 0
    eager = capsys.readouterr().out
    try:
        assert cli_main(argv + ["--compile"]) == 0
    finally:
        torch._dynamo.reset()
    assert made == {"compiled": True} and capsys.readouterr().out == eager


@pytest.mark.slow
def test_generate_aot_compiles_once_then_loads_the_package(lm_checkpoint, capsys, monkeypatch, tmp_path):
    """--aot decodes with the ahead-of-time package (the same greedy text as eager): the first run compiles it
    into $DECODERLAB_CACHE/aot, saying so on standard error when it starts and when it is done; the next run loads
    it (said with --verbose), and so does a run without --aot (the default: a cached package, else eager), and
    --eager does not. One tiny graph (1 layer, d_model 16) is compiled: ~20 s on a loaded 2-core machine."""
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    argv = ["generate", "--checkpoint", str(lm_checkpoint), "--no-stream", "--temperature", "0",
            "--max-new-tokens", "30", "to be"]
    assert cli_main(argv) == 0
    eager = capsys.readouterr().out
    assert cli_main(argv + ["--aot"]) == 0
    out, err = capsys.readouterr()
    (package,) = (tmp_path / "aot").glob("*.pt2")
    assert out == eager
    starting, *beats, done = err.splitlines()
    # no time promised that was not measured here (it said "10-60 s", and SmolLM2's took 79-477 s)
    assert starting == ("decoderlab: compiling the decode step ahead of time for 1 row(s), once for this model's "
                        "shape and dtype (nothing measured yet to estimate its time from: it is said when done) ...")
    assert all(re.fullmatch(r"decoderlab: compiling the decode step ahead of time for 1 row\(s\): \d+ s so far", b)
               for b in beats), err
    assert done.startswith("decoderlab: compiled the decode step ahead of time in ") and str(package) in done, err
    for more in (["--aot", "--verbose"], ["--verbose"]):  # the package is loaded, with or without --aot
        assert cli_main(argv + more) == 0
        out, err = capsys.readouterr()
        assert out == eager
        assert "decode ahead of time (torch.export + AOTInductor" in err
        assert f"decoderlab: loaded the decode step compiled ahead of time from {package}" in err
        assert "compiling" not in err and "compiled the decode step" not in err
    assert cli_main(argv + ["--eager", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out == eager and "decode eager" in err and "ahead of time" not in err


def test_compile_and_aot_together_is_one_error_line(lm_checkpoint, capsys):
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--compile", "--aot", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["decoderlab: error: --compile and --aot are two ways to compile the decode step: give one"]
    for command, other in (("generate", "--compile"), ("sample", "--aot"), ("chat", "--aot")):
        assert cli_main([command, "--checkpoint", str(lm_checkpoint), "--eager", other]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"decoderlab: error: --eager decodes without a compiled step: give it without {other}"]


def test_without_a_cached_package_a_terminal_is_told_once_how_to_decode_faster(lm_checkpoint, capsys, monkeypatch,
                                                                              tmp_path):
    """The default of generate: a package compiled ahead of time when one is cached, else eager -- and then a
    terminal gets one line saying how to get the fast step (a pipe or a file gets none: scripts stay quiet);
    --eager never says it, nor is it said of a model too small for a compile to pay (the lesson's 37 parameters:
    COMPILE_PAYS_FROM)."""
    import sys

    from decoderlab.config import defaults

    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    argv = ["generate", "--checkpoint", str(lm_checkpoint), "--no-stream", "--max-new-tokens", "3", "to be"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli_main(argv) == 0  # a tiny model: the step takes microseconds, compiling would not pay
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(defaults, "COMPILE_PAYS_FROM", 100)  # as if this model were big enough
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli_main(argv) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli_main(argv) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("decoderlab: decoding eagerly: no compiled decode step is cached for this model's shape "
                           "and dtype; run once with --aot to compile one")
    assert cli_main(argv + ["--eager"]) == 0
    assert capsys.readouterr().err == ""
    from decoderlab import fastdecode

    monkeypatch.setattr(fastdecode, "why_not", lambda model: None)  # an eager step of one C++ call: nothing to gain
    assert cli_main(argv) == 0
    assert capsys.readouterr().err == ""
    assert not list(tmp_path.glob("**/*.pt2"))  # nothing was compiled


def test_a_compile_is_said_when_it_starts_and_ends_and_only_while_a_command_runs(capsys):
    """announce_compiles: dynamo's compile callbacks say on standard error when a compile starts and how long it
    took (a first token that waits for the compiler is never silent); stop_announcing, which main calls as a
    command ends, removes them."""
    import torch

    from decoderlab.cli.options import announce_compiles, stop_announcing

    torch._dynamo.reset()
    announce_compiles()
    announce_compiles()  # (once per command: no second pair of lines)
    try:
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(3))
    finally:
        stop_announcing()
    lines = capsys.readouterr().err.splitlines()
    # no time promised but one measured (it said "up to a minute on a CPU"): none before the first compile
    assert lines[0] == ("decoderlab: compiling the decode step with torch.compile, once per kind of step (nothing "
                        "measured yet to estimate its time from: it is said when done) ...")
    assert len(lines) == 2 and re.fullmatch(r"decoderlab: compiled the decode step in \d+ s", lines[1]), lines
    torch._dynamo.reset()
    torch.compile(lambda t: t * 3, backend="eager")(torch.ones(3))
    assert capsys.readouterr().err == ""
    torch._dynamo.reset()


def test_a_long_compile_says_its_progress_and_the_next_one_the_time_the_last_took(monkeypatch, capsys):
    """Between its first and last line, a compile says how long it has run every waiting.EVERY seconds; the next
    compile of the command says the time the last one took (measured: the only estimate said). Dynamo's callbacks
    are called here as a compile calls them, around a wait as long as the test wants."""
    import threading

    from decoderlab import waiting
    from decoderlab.cli import options

    monkeypatch.setattr(waiting, "EVERY", 0.001)
    beats = threading.Event()
    monkeypatch.setattr(options, "say", lambda line: (print(line), line.endswith(" s so far") and beats.set()))
    options.announce_compiles()
    try:
        start, end = options._COMPILING["callbacks"]
        start()
        assert beats.wait(60)
        end()
        start()
        end()
    finally:
        options.stop_announcing()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("compiling the decode step with torch.compile, once per kind of step (nothing measured")
    assert re.fullmatch(r"compiling the decode step: \d+ s so far", lines[1]), lines
    (second,) = [x for x in lines[1:] if x.startswith("compiling the decode step with")]
    assert re.search(r"\(~\d+ s: the last compile of this run took \d+ s\) \.\.\.$", second), lines


# ---------------------------------------------------------------------------------------------------------
# --checkpoint FILE.gguf: llama.cpp's file read as any checkpoint; a file it cannot read is one line
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    bpe = byte_level_bpe(300)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q4_1")


def test_generate_verify_and_chat_read_a_gguf_file(gguf_file, capsys):
    assert cli_main(["generate", "--checkpoint", str(gguf_file), "The quick", "--max-new-tokens", "4",
                     "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and f"decoderlab: read {gguf_file} (llama): weights as in the file: q4_1 (15 matrices)" in err
    assert cli_main(["generate", "--checkpoint", str(gguf_file), "The quick", "--max-new-tokens", "4",
                     "--temperature", "0", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert f"decoderlab: read {gguf_file} (llama): dequantized" in err and "Q4_1" in err and "MB of float32" in err
    assert cli_main(["verify", "--checkpoint", str(gguf_file), "The quick brown fox"]) == 0
    assert "all ok" in capsys.readouterr().out


@pytest.mark.parametrize("damage, line", [
    ("truncate", "is truncated or corrupt"),
    ("arch", "GGUF architecture 'phi3' is not one decoderlab's model carries; allowed: llama, qwen2, qwen3, gpt2, gemma3"),
    ("missing", "bad.gguf does not exist; a checkpoint is"),  # the one message of a path that is no checkpoint
])
def test_a_gguf_file_it_cannot_read_is_one_line(gguf_file, tmp_path, capsys, damage, line):
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    bad = tmp_path / "bad.gguf"
    if damage == "truncate":
        bad.write_bytes(gguf_file.read_bytes()[:-100])
    elif damage == "arch":
        bpe = byte_level_bpe(300)
        write_gguf(bad, "phi3", hf_model("llama", bpe.get_vocab_size()), bpe)
    code = cli_main(["generate", "--checkpoint", str(bad), "x"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("decoderlab: error: ")
    assert line in err


@pytest.mark.parametrize("argv, line", [
    (["generate", "--max-new-tokens", "-3", "hi"], "--max-new-tokens must be >= 0, got -3"),
    (["sample", "--temperature", "-1", "hi"], "--temperature must be >= 0, got -1"),
    (["generate", "--temperature", "nan", "hi"], "--temperature must be >= 0, got nan"),
    (["chat", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["generate", "--top-p", "0", "hi"], "--top-p must be in (0, 1], got 0"),
    (["generate", "--top-k", "-1", "hi"], "--top-k must be >= 0, got -1"),
    (["chat", "--min-p", "2"], "--min-p must be in [0, 1], got 2"),
    (["generate", "--repetition-penalty", "0", "hi"], "--repetition-penalty must be > 0, got 0"),
    (["generate", "--presence-penalty", "3", "hi"], "--presence-penalty must be in [-2, 2], got 3"),
    (["verify", "--tol", "-1", "hi"], "--tol must be > 0, got -1"),
    (["explain", "--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["serve", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["rl", "--temperature", "0"], "--temperature must be > 0, got 0"),
    (["rl", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["generate", "--threads", "0", "hi"], "--threads must be >= 1, got 0"),
])
def test_a_bad_sampling_value_is_named_as_its_flag_before_anything_loads(argv, line, capsys, tmp_path):
    """`generate --max-new-tokens -3` said "max_new_tokens must be an integer >= 0, got -3" (the Python name) after
    the model had loaded; now the parser refuses it: the checkpoint here does not exist and is never read."""
    command, *rest = argv
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--checkpoint", str(tmp_path / "none"), *rest])
    out, err = capsys.readouterr()
    assert (e.value.code, out) == (2, "")
    assert err == f"decoderlab: error: {line} (see decoderlab {command} --help)\n"


def test_checkpoint_help_names_every_family_and_a_file_that_is_no_checkpoint_says_what_one_is(capsys, tmp_path):
    """The help said "a Hugging Face GPT-2 directory" of a loader that reads every family of decoderlab.hf, and
    `--checkpoint README.md` said "a checkpoint is a directory", forgetting GGUF files."""
    import re

    from decoderlab.cli.options import CHECKPOINT_HELP
    from decoderlab.hf import ARCHITECTURES

    families = {re.sub(r"(LMHead|ForCausalLM).*", "", a).replace("GPT2", "GPT-2") for a in ARCHITECTURES}
    assert families == {"GPT-2", "Llama", "Mistral", "Qwen2", "Qwen3", "Apertus", "Arcee", "Gemma3"}
    assert all(f in CHECKPOINT_HELP for f in families), CHECKPOINT_HELP
    assert "GGUF file" in CHECKPOINT_HELP
    for command in ("generate", "verify", "serve"):
        action = next(a for a in command_parser(command)._actions if "--checkpoint" in a.option_strings)
        assert action.metavar == "PATH", command
    (tmp_path / "README.md").write_text("# not a model\n")
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "README.md"), "hi"]) == 2
    assert capsys.readouterr().err == (
        f"decoderlab: error: checkpoint {tmp_path / 'README.md'} is a file but not a GGUF file (.gguf); a checkpoint is a decoderlab "
        "run or checkpoint directory, a Hugging Face directory or a .gguf file\n")


# ---- --checkpoint: every kind the front door takes, one message for a path that is none ------------------

#: each command that takes --checkpoint, with the other arguments of a run that would go on (PATH: the checkpoint,
#: OUT: a place to write, DATA: a chat JSONL file)
CHECKPOINT_COMMANDS = {
    "generate": ["hi"], "sample": ["hi"], "chat": [], "verify": ["hi"], "explain": ["hi"], "lens": ["hi"],
    "heads": [], "patch": ["--clean", "ab", "--corrupt", "ac"], "export": ["--out", "OUT/m.gguf"],
    "sae": ["--out", "OUT/sae", "--data", "DATA"], "serve": ["--port", "0"],
    "finetune": ["--data", "DATA", "--out", "OUT/ft"], "rl": ["--prompts", "DATA", "--out", "OUT/rl"],
}
KINDS = "; a checkpoint is a decoderlab run or checkpoint directory, a Hugging Face directory or a .gguf file"


def test_every_command_with_a_checkpoint_is_in_the_table_with_one_help_text():
    """`finetune --help` said DIR and "the decoderlab checkpoint" of a loader that reads GGUF files too."""
    from decoderlab.cli.options import CHECKPOINT_HELP
    from decoderlab.cli.parser import COMMANDS

    having = {name for name in COMMANDS
              if "--checkpoint" in command_parser(name)._option_string_actions}
    assert having == set(CHECKPOINT_COMMANDS)
    for name in having:
        action = command_parser(name)._option_string_actions["--checkpoint"]
        assert action.metavar == "PATH" and CHECKPOINT_HELP in action.help, (name, action.metavar, action.help)


@pytest.mark.parametrize("kind", ["missing", "file", "directory"])
@pytest.mark.parametrize("command", sorted(CHECKPOINT_COMMANDS))
def test_a_checkpoint_path_that_is_none_of_the_kinds_is_one_line_the_same_in_every_command(command, kind, tmp_path,
                                                                                          capsys):
    """generate said "checkpoint directory X does not exist", export and sae "X/config.json does not exist" (of a
    .gguf file too), finetune and rl read their data first and named that; now every command says the front
    door's one line before any other work, and writes nothing."""
    from .glass_runs import run

    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    path, what = {"missing": (tmp_path / "nothing", "does not exist"),
                  "file": (data, "is a file but not a GGUF file (.gguf)"),
                  "directory": (tmp_path / "empty", "is a directory without config.json")}[kind]
    (tmp_path / "empty").mkdir()
    (tmp_path / "out").mkdir()
    rest = [str(a).replace("OUT", str(tmp_path / "out")).replace("DATA", str(data))
            for a in CHECKPOINT_COMMANDS[command]]
    status, out, err = run(capsys, command, "--checkpoint", path, *rest)
    assert (status, out, err) == (2, "", f"decoderlab: error: checkpoint {path} {what}{KINDS}\n")
    assert not any((tmp_path / "out").iterdir())


# ---- the files a command writes beside its output ---------------------------------------------------------

@pytest.fixture(scope="module")
def glass_files(tmp_path_factory):
    """What every command with --png / --html reads: a tiny checkpoint, a watched run, an SAE run on it."""
    from decoderlab.dictionary import SAETrainConfig, train_sae

    from .glass_runs import save_tiny
    from .test_explain import _watched_run

    root = tmp_path_factory.mktemp("glass-files")
    save_tiny(root / "ckpt")
    (root / "words.txt").write_text("the cat sat on the mat, and the dog ran. " * 40, encoding="utf-8")
    train_sae(root / "ckpt", SAETrainConfig(hook="blocks.0.hook_resid_post", width=1, k=2, tokens=64,
                                            batch_tokens=32), out=root / "sae", data=str(root / "words.txt"),
              progress_bar=False)
    return {"ckpt": root / "ckpt", "run": _watched_run(root / "run"), "sae": root / "sae"}


@pytest.mark.parametrize("command", ["explain", "explain --run", "lens", "heads", "patch", "features"])
def test_every_png_and_html_file_is_announced_in_one_line(command, glass_files, tmp_path, capsys):
    """Each command said where it wrote its --html in its own words ("wrote HTML report to", "wrote PATH", ...),
    or not where the reader looked; now one line each, after the printed output: wrote the PNG / HTML page to
    PATH."""
    from .glass_runs import run

    ckpt = ("--checkpoint", glass_files["ckpt"])
    argv = {"explain": ("explain", *ckpt, "the cat"), "explain --run": ("explain", "--run", glass_files["run"]),
            "lens": ("lens", *ckpt, "the cat"), "heads": ("heads", *ckpt),
            "patch": ("patch", *ckpt, "--clean", "the cat", "--corrupt", "the dog"),
            "features": ("features", "--sae", glass_files["sae"], "--feature", "0", "--tokens", "64")}[command]
    png, page = tmp_path / "f.png", tmp_path / "f.html"
    status, out, err = run(capsys, *argv, "--png", png, "--html", page)
    assert status == 0, err
    assert out.endswith(f"\nwrote the PNG to {png}\nwrote the HTML page to {page}\n"), out[-300:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and page.read_text(encoding="utf-8").startswith("<!")
