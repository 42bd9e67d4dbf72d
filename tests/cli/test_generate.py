"""``decoderlab generate`` and ``sample`` (decoderlab.cli.generate): no Lightning to answer, the help shows the
config's defaults, a closed output ends them quietly; streaming, stops typed with escapes, invalid Unicode,
Ctrl-C, the end of text, and one error line for every bad value."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support.interaction import type_lines
from tiny_models import biased_char_model, end_of_turn_model, one_thread, run_env  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.checkpoint import save_checkpoint
from decoderlab.cli import main as cli_main
from decoderlab.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DTYPES
from decoderlab.generation import Sampler, SamplingParams, generate, stream_text
from decoderlab.tokenizers import CharTokenizer

from .helps import actions, helps
from .test_parser import _loaded


def test_generate_on_a_checkpoint_does_not_import_lightning(statquest_checkpoint):
    body = "from decoderlab.cli import main\nmain()"
    assert _loaded(body, ["generate", "--checkpoint", str(statquest_checkpoint), "what is statquest"]) == {"torch"}


def test_generate_help_shows_the_config_defaults():
    for command in ("generate", "sample"):
        h = helps(command)
        assert h["--max-new-tokens"].startswith(f"longest continuation in tokens (default {DEFAULT_MAX_NEW_TOKENS};")
        assert h["--temperature"] == f"sampling temperature, 0 = greedy (default {DEFAULT_TEMPERATURE:g})"
        assert h["--dtype"].startswith(f"weights for inference: auto, {', '.join(DTYPES)} (default auto: a GGUF "
                                     f"file's own types")
    assert helps("generate").keys() == helps("sample").keys()


def test_a_closed_output_ends_generate_and_sample_quietly(closed_stdout_cli, statquest_checkpoint):
    """`decoderlab generate ... | head -c 10` said "decoderlab: error: [Errno 32] Broken pipe" (exit 2); now no
    word, exit 141 as a program stopped by SIGPIPE."""
    for argv in (("generate", "--echo", "--max-new-tokens", "100000"), ("sample", "--max-new-tokens", "20")):
        assert closed_stdout_cli(*argv, "--checkpoint", statquest_checkpoint, "what") == (141, ""), argv


def test_cli_generate_streams_an_lm_checkpoint(lm_checkpoint, capsys, monkeypatch):
    model, tok = dl.load_checkpoint(lm_checkpoint)
    args = ["--max-new-tokens", "30", "--temperature", "0.8", "--top-k", "8", "--top-p", "0.95", "--seed", "13"]
    # with its tokenizer, as the CLI: <PAD> never sampled, <EOS> ends the text (this seed runs all 30 tokens)
    ids = generate(model, tok.encode("to be"), 30, temperature=0.8, top_k=8, top_p=0.95, seed=13, tokenizer=tok)
    assert len(ids) == 30
    want = tok.decode(ids)
    writes = []
    real_write = sys.stdout.write

    def recording_write(s):
        writes.append(s)
        return real_write(s)

    monkeypatch.setattr(sys.stdout, "write", recording_write)
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "to be"]) == 0
    monkeypatch.undo()
    assert capsys.readouterr().out == want + "\n"
    assert len(writes) > 5  # piece by piece, not all at the end
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "--no-stream", "to be"]) == 0
    assert capsys.readouterr().out == want + "\n"
    j = next(i for i in range(3, len(ids) - 1) if min(ids[i:i + 2]) > 1)  # two characters, no specials
    first = next(i for i in range(len(ids) - 1) if ids[i:i + 2] == ids[j:j + 2])
    stop = tok.decode(ids[j:j + 2])
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "--stop", stop, "to be"]) == 0
    assert capsys.readouterr().out == tok.decode(ids[:first]) + "\n"
    with pytest.raises(SystemExit):  # refused by the parser, in the flag's name, before the model loads
        cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--top-p", "2", "to be"])
    assert "--top-p must be in (0, 1], got 2" in capsys.readouterr().err


def test_cli_penalties_min_p_and_json_schema_are_the_librarys(lm_checkpoint, capsys, tmp_path):
    """The sampling flags a row each: --min-p, --repetition-penalty, --frequency-penalty, --presence-penalty
    give generate's text with those settings; --json-schema FILE constrains the reply (this vocabulary can
    write "true" but not "false", so a boolean schema is "true")."""
    model, tok = dl.load_checkpoint(lm_checkpoint)
    controls = dict(min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.5)
    # a seed whose text runs a while and changes with the controls
    seed = next(s for s in range(100) if len(generate(model, tok.encode("to be"), 25, seed=s, tokenizer=tok,
                                                      **controls)) > 8 and
                generate(model, tok.encode("to be"), 25, seed=s, tokenizer=tok, **controls) !=
                generate(model, tok.encode("to be"), 25, seed=s, tokenizer=tok))
    ids = generate(model, tok.encode("to be"), 25, seed=seed, tokenizer=tok, **controls)
    flags = ["--max-new-tokens", "25", "--seed", str(seed), "--min-p", "0.05", "--repetition-penalty", "1.3",
             "--frequency-penalty", "0.4", "--presence-penalty", "-0.5"]
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *flags, "--no-stream", "to be"]) == 0
    assert capsys.readouterr().out == tok.decode(ids) + "\n"
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "boolean"}')
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--json-schema", str(schema), "--seed", "1",
                     "to be"]) == 0
    assert capsys.readouterr().out == "true\n"
    with pytest.raises(SystemExit):  # (as --top-p's)
        cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--presence-penalty", "3", "to be"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--presence-penalty must be in [-2, 2], got 3" in err
    with pytest.raises(SystemExit):
        cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--min-p", "1.5", "to be"])
    assert "--min-p must be in [0, 1], got 1.5" in capsys.readouterr().err
    schema.write_text('{"type": "nonsense"}')
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--json-schema", str(schema), "to be"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: json_schema:") and "nonsense" in err and err.count("\n") == 1
    schema.write_text("{not json")
    with pytest.raises(SystemExit):
        cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--json-schema", str(schema), "to be"])
    assert "is not valid JSON" in capsys.readouterr().err


def test_unescape_understands_the_usual_backslash_escapes():
    from decoderlab.cli import unescape

    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\c\x41\u00e9\r\0") == "a\tb\\cA\u00e9\r\0"
    assert unescape("no escapes: \u00e9") == "no escapes: \u00e9"
    with pytest.raises(ValueError) as e:
        unescape(r"end\q")
    assert str(e.value) == (r"--stop 'end\q' has an unknown escape \q; known escapes: \n \t \r \\ \0 \xHH \uHHHH "
                            r"(write \\ for a backslash)")
    with pytest.raises(ValueError, match=r"'end\\' ends with a lone backslash"):
        unescape("end\\")


def test_cli_stop_with_escapes_as_typed(lm_checkpoint, decoderlab_cli, capsys):
    model, tok = dl.load_checkpoint(lm_checkpoint)
    ids = generate(model, tok.encode("to be"), 80, seed=3, stop="\n", tokenizer=tok)
    want = tok.decode(ids)
    r = decoderlab_cli("generate", "--checkpoint", lm_checkpoint, "--no-stream", "--seed", "3", "--max-new-tokens", "80",
                       "--stop", r"\n", "to be")
    assert (r.returncode, r.stdout, r.stderr) == (0, want + "\n", "")
    assert "\n" not in want
    # (the refusals in this process: a console-script process each cost ~10 s of the suite)
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--stop", r"\q", "to be"]) == 2
    assert capsys.readouterr().err == (r"decoderlab: error: --stop '\q' has an unknown escape \q; known escapes: \n "
                                       r"\t \r \\ \0 \xHH \uHHHH (write \\ for a backslash)" + "\n")
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--stop", r"\n\u00e9", "to be"]) == 2
    assert capsys.readouterr().err.startswith(r"decoderlab: error: --stop '\n\u00e9' cannot be encoded by this "
                                              "model's tokenizer: character '\u00e9' (U+00E9)")


def test_cli_passes_top_k_0_through(lm_checkpoint, capsys, monkeypatch):
    """--top-k 0 means "no top-k filter"; the CLI hands the 0 to the library's SamplingParams unchanged."""
    import decoderlab.generation

    seen = {}

    def fake_stream_text(model, tok, prompt_ids, params, **kwargs):
        seen.update(kwargs, params=params)
        return iter([])

    monkeypatch.setattr(decoderlab.generation, "stream_text", fake_stream_text)
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--no-stream", "--top-k", "0", "to be"]) == 0
    assert seen["params"] == SamplingParams(top_k=0)  # read by the library's one check: 0 = no filter


def test_cli_stop_string_in_a_subprocess(newline_bpe, tmp_path, capsys):
    """The real console script: --stop "\\n\\n" ends the output before the first blank line (and, in this
    process, with --no-stream --echo)."""
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "ckpt", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab"))
    cmd = [exe, "generate", "--checkpoint", str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "6"]
    r = subprocess.run(cmd + ["--stop", "\n\n", "p"], capture_output=True, text=True, env=run_env())
    assert (r.returncode, r.stdout, r.stderr) == (0, "a\n", "")  # was "a" and six newlines
    assert cli_main(cmd[1:] + ["--no-stream", "--echo", "--stop", "\n\n", "p"]) == 0
    assert capsys.readouterr().out == "pa\n"


def test_cli_sample_ends_at_eos_and_writes_no_control_token(tmp_path, capsys):
    """`sample` on a model whose most probable token is <PAD>: it ends at <EOS> and prints no control token."""
    tok = CharTokenizer.from_text("hello world\n")
    pad, eos = tok.pad_id, tok.eos_id
    model = biased_char_model(tok, {pad: 3.0, eos: -1.0})  # <PAD> is the most probable token
    # the CLI: `sample` ends at <EOS>, prints no control token
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm"})
    assert cli_main(["sample", "--checkpoint", str(tmp_path / "c"), "--max-new-tokens", "2000", "--seed", "0",
                     "h"]) == 0
    out, err = capsys.readouterr()
    want = "h" + "".join(stream_text(model, "h", tok, 2000, seed=0)) + "\n"
    assert err == "" and out == want and "<" not in out


def test_invalid_unicode_on_the_command_line(newline_bpe, lm_checkpoint, tmp_path, capsys):
    """$'para\\xff' (a byte that is not UTF-8; Python makes it U+DCFF): one error line and exit status 2 for
    every checkpoint kind and command; chat reports it in one such line and goes on."""
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "bpe", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab")).encode()
    for ckpt, commands in ((tmp_path / "bpe", ("generate", "sample", "stop", "explain", "verify")),
                           (lm_checkpoint, ("generate", "chat"))):
        for argv in ([b"generate", b"--checkpoint", bytes(ckpt), b"to be\xff"],
                     [b"sample", b"--checkpoint", bytes(ckpt), b"to be\xff"],
                     [b"generate", b"--checkpoint", bytes(ckpt), b"--stop", b"\xff", b"to be"],
                     [b"explain", b"--checkpoint", bytes(ckpt), b"to be\xff"],
                     [b"verify", b"--checkpoint", bytes(ckpt), b"to be\xff"]):
            if (b"stop" if b"--stop" in argv else argv[0]).decode() not in commands:
                continue
            if argv[0] == b"generate" and b"--stop" not in argv:  # the real bytes through the console script
                r = subprocess.run([exe, *argv], capture_output=True, env=run_env())
                code, err = r.returncode, r.stderr.decode("utf-8", "backslashreplace")
            else:  # the same text as Python makes of those bytes (U+DCFF), in this process (~4 s a process saved)
                code = cli_main([a.decode("utf-8", "surrogateescape") for a in argv])
                err = capsys.readouterr().err
            assert code == 2, (argv, err)
            assert err.count("\n") == 1 and err.startswith("decoderlab: error: "), (argv, err)
            assert "not valid Unicode: U+DCFF" in err and "0xff" in err, (argv, err)
        if "chat" not in commands:
            continue
        r = subprocess.run([exe, b"chat", b"--checkpoint", bytes(ckpt)], input=b"to be\xff\n", capture_output=True,
                           env=run_env())
        assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr  # piped: a turn's error fails the run
        (error,) = [line for line in r.stderr.splitlines() if line.startswith(b"decoderlab: error: ")]
        assert b"0xff" in error, r.stderr


def test_ctrl_c_keeps_what_was_produced(lm_checkpoint, capsys, monkeypatch):
    """Ctrl-C while `generate` / `sample` run: the text so far, one line on stderr, exit status 130."""
    model, tok = dl.load_checkpoint(lm_checkpoint)
    want = tok.decode(generate(model, "to be", 4, seed=13, tokenizer=tok))
    real_call = Sampler.choose  # (the engine draws with choose, then reads the ids once)
    calls = []

    def interrupted(self, logits, generators, counts=None):
        calls.append(1)
        if len(calls) == 5:  # during the fifth token
            raise KeyboardInterrupt
        return real_call(self, logits, generators, counts)

    monkeypatch.setattr(Sampler, "choose", interrupted)
    for command, out in (("generate", want + "\n"), ("sample", "to be" + want + "\n")):
        calls.clear()
        assert cli_main([command, "--checkpoint", str(lm_checkpoint), "--seed", "13", "to be"]) == 130
        got = capsys.readouterr()
        assert got.out == out
        assert got.err == f"decoderlab: interrupted ({command} stopped by Ctrl-C)\n"


def test_ctrl_c_in_a_subprocess(newline_bpe, tmp_path):
    """A real SIGINT to the console script while it streams: no traceback, one line, exit status 130."""
    import signal
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab"))
    proc = subprocess.Popen([exe, "generate", "--checkpoint", str(tmp_path / "c"), "--temperature", "0",
                             "--max-new-tokens", "100000000", "p"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=run_env())
    try:
        first = proc.stdout.read(3)  # "a\n\n": it is generating
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first == b"a\n\n"
    assert proc.returncode == 130
    assert err == b"decoderlab: interrupted (generate stopped by Ctrl-C)\n"
    assert set((first + out).decode()) <= {"a", "\n"}


@pytest.mark.parametrize("argv, line", [
    (("generate", "--seed", "99999999999999999999999", "what"),
     "--seed must be an integer in 0 .. 2**63-1, got '99999999999999999999999' (see decoderlab generate --help)"),
    (("sample", "--seed=-1", "what"), "--seed must be an integer in 0 .. 2**63-1, got '-1' "
                                                   "(see decoderlab sample --help)"),
    (("chat", "--seed", str(2**63)), f"--seed must be an integer in 0 .. 2**63-1, got '{2**63}' "
                                     f"(see decoderlab chat --help)"),
])
def test_out_of_range_seeds_are_refused_in_one_line(statquest_checkpoint, decoderlab_cli, argv, line):
    """`--seed 99999999999999999999999` printed torch's "Overflow when unpacking long long"; -1 was accepted."""
    r = decoderlab_cli(argv[0], "--checkpoint", statquest_checkpoint, *argv[1:])
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: {line}\n")


def test_generate_sample_and_chat_end_at_a_chat_models_end_of_turn(tmp_path, capsys, monkeypatch):
    """On a chat checkpoint's tokens, `generate` and `sample` end at the model's <|end|> (they went on to
    --max-new-tokens, hiding it), as `chat` and `generate --chat` end their replies there."""
    from decoderlab.chat import TEMPLATES

    tok, model, _ = end_of_turn_model()
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm", "chat_template": TEMPLATES["decoderlab"].to_dict()})
    common = ["--checkpoint", str(tmp_path / "c"), "--temperature", "0"]
    assert cli_main(["generate", *common, "a"]) == 0
    assert capsys.readouterr().out == "bc\n"
    assert cli_main(["sample", *common, "a"]) == 0
    assert capsys.readouterr().out == "abc\n"
    assert cli_main(["generate", *common, "--chat", "b"]) == 0
    assert capsys.readouterr().out == "abc\n"
    type_lines(monkeypatch, ["b"])
    assert cli_main(["chat", *common]) == 0
    assert capsys.readouterr().out == "abc\n"


@pytest.mark.parametrize("asked", ["q8_0", "q4_1"])
def test_verbose_names_the_block_type_the_weights_hold_and_the_read_line_how(tmp_path, capsys, asked):
    """--dtype q8_0 of a Q4_1 GGUF file: the weights are q8_0 -- requantized, as the read line says -- and
    --verbose says q8_0; --dtype q4_1 keeps the file's blocks, and says so."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    bpe = byte_level_bpe(300)
    path = write_gguf(tmp_path / "q4_1.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q4_1")
    assert cli_main(["generate", "--checkpoint", str(path), "--dtype", asked, "--eager", "--verbose", "--temperature",
                     "0", "--max-new-tokens", "3", "The quick"]) == 0
    lines = capsys.readouterr().err.splitlines()
    read = next(line for line in lines if line.startswith(f"decoderlab: read {path}"))
    device = next(line for line in lines if line.startswith("decoderlab: device"))
    assert f", weights {asked}," in device
    if asked == "q8_0":
        assert "dequantized 15 tensors (15 Q4_1)" in read and "the matrices then quantized to q8_0" in read
        assert "kept" not in read
    else:
        assert "kept 15 tensors in their blocks (15 Q4_1" in read and "quantized to" not in read


def test_verbose_names_the_device_dtype_threads_and_the_cpus_instructions(lm_checkpoint, capsys):
    from decoderlab.devices import cpu_features

    args = ["generate", "--checkpoint", str(lm_checkpoint), "--temperature", "0", "--max-new-tokens", "5",
            "--threads", "1", "--verbose", "to be"]
    assert cli_main(args) == 0
    quiet = cli_main(args[:-2] + ["to be"])
    out = capsys.readouterr()
    first, last = out.err.strip().splitlines()[0], out.err.strip().splitlines()[-1]
    assert first.startswith("decoderlab: device cpu, weights float32, 1 intra-op thread(s), decode eager; cpu ")
    assert all(f in first for f in cpu_features()) and "torch kernels" in first
    assert re.fullmatch(r"decoderlab: first text after \d+\.\d\d s, \d+\.\d\d s in all", last)
    assert quiet == 0 and out.err.count("decoderlab:") == 2  # the run without --verbose says nothing
    half = out.out.split("\n")
    assert half[0] == half[1] and half[2:] == [""]  # the same text with and without --verbose


def test_generate_chat_verbose_prints_the_timing_line_as_plain_generate_does(tmp_path, capsys):
    """`generate --chat --verbose` said its setup line and dropped the timing line `generate --verbose` ends with."""
    from decoderlab.chat import TEMPLATES

    tok, model, _ = end_of_turn_model()
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "chat", "chat_template": TEMPLATES["decoderlab"].to_dict()})
    common = ["generate", "--checkpoint", str(tmp_path / "c"), "--temperature", "0", "--verbose"]
    for extra in ([], ["--chat"]):
        assert cli_main([*common, *extra, "b"]) == 0, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith("decoderlab: device cpu, weights float32"), (extra, err)
        assert re.fullmatch(r"decoderlab: first text after \d+\.\d\d s, \d+\.\d\d s in all", err[-1]), (extra, err)


def test_generate_chat_and_chat_take_a_jinja_template_and_say_its_error(tmp_path, capsys, monkeypatch):
    """A checkpoint storing a Jinja chat template (here decoderlab's own, as an exported model's
    tokenizer_config.json carries it) replies as with the built-in one; a template that raises is one line
    naming it and its message."""
    from decoderlab.chat import TEMPLATES, JinjaChatTemplate, chat_template_jinja

    tok, model, _ = end_of_turn_model()
    jinja = JinjaChatTemplate(chat_template_jinja(TEMPLATES["decoderlab"]), name="exported")
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "chat", "chat_template": jinja.to_dict()})
    common = ["--checkpoint", str(tmp_path / "c"), "--temperature", "0"]
    assert cli_main(["generate", *common, "--chat", "b"]) == 0
    assert capsys.readouterr().out == "abc\n"
    type_lines(monkeypatch, ["b"])
    assert cli_main(["chat", *common]) == 0
    assert capsys.readouterr().out == "abc\n"
    raising = JinjaChatTemplate("{{ raise_exception('System role not supported') }}", name="strict")
    save_checkpoint(tmp_path / "r", model, tok, meta={"task": "chat", "chat_template": raising.to_dict()})
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "r"), "--chat", "b"]) == 2
    assert capsys.readouterr().err == ("decoderlab: error: the 'strict' chat template raised: System role not "
                                       "supported\n")


def test_generate_and_sample_read_a_llama_prompt_with_its_start_token_and_never_print_it(llama_directory, capsys):
    """A Llama 2 / TinyLlama-style directory (add_bos_token): the prompt is transformers' ``tokenizer(text)``,
    <s> first, so the continuation is transformers' greedy one; ``sample`` (--echo) prints the prompt without
    <s>; ``--chat`` reads the chat template's own <s> only."""
    from hf.families import greedy_tokens

    path, hf, auto = llama_directory
    text = "To be, or not to be"
    ids = auto(text)["input_ids"]
    new = greedy_tokens(hf, ids, 8)
    assert not set(new) & set(auto.all_special_ids)  # the CLI stops at a special token
    want = auto.decode(new, skip_special_tokens=True)
    greedy = ["--checkpoint", str(path), "--temperature", "0", "--max-new-tokens", "8"]
    assert cli_main(["generate", *greedy, text]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert cli_main(["sample", *greedy, text]) == 0
    assert capsys.readouterr().out == text + want + "\n"
    chat = auto.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    reply = greedy_tokens(hf, chat, 8)
    reply = reply[:next((i for i, t in enumerate(reply) if t in auto.all_special_ids), len(reply))]
    assert cli_main(["generate", *greedy, "--chat", "--no-stream", text]) == 0
    assert capsys.readouterr().out.strip() == auto.decode(reply, skip_special_tokens=True).strip()


def test_without_a_prompt_the_lesson_model_asks_for_words_it_knows(statquest_checkpoint, capsys):
    """`generate --checkpoint runs/statquest` said `e.g. "hello"` of a model whose vocabulary is what, is, statquest,
    awesome, <EOS>; and the help said the prompt defaults to a newline, which the lesson's model cannot answer."""
    from decoderlab.cli.generate import example_message

    assert cli_main(["generate", "--checkpoint", str(statquest_checkpoint)]) == 2
    assert capsys.readouterr().err == ('decoderlab: error: give the user message to answer, e.g. "what is statquest"'
                                       "\n")
    assert example_message(CharTokenizer.from_text("hello world")) == "hello"
    text = actions("generate")["prompt"].help
    assert "default: a newline" in text and "required with --chat and for the lesson's model" in text


def test_an_empty_chat_message_is_refused_before_the_model_is_read(tmp_path, capsys):
    """`generate --chat ""` rendered an empty user turn and answered it; it is one error line now, before any file
    is read (the checkpoint here does not exist: the message is refused first)."""
    for empty in ("", "  \n"):
        assert cli_main(["generate", "--checkpoint", str(tmp_path / "none"), "--chat", empty]) == 2
        assert capsys.readouterr().err == (f"decoderlab: error: --chat's user message is empty ({empty!r}); give the "
                                           "message to answer\n")
