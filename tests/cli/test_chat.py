"""``decoderlab chat`` (decoderlab.cli.chat), and `generate --chat` and `explain --chat` on a chat checkpoint: the
help's defaults are what a conversation uses, a closed output ends it quietly, the slash commands are named as the
flags and say what they take, Ctrl-C stops a reply, the stored template renders every turn, flag combinations,
one note per line."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
from support.interaction import type_lines
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse
from tiny_runs import GOOD, write

import decoderlab as dl
from decoderlab import cli
from decoderlab.chat import load_model, render_chat
from decoderlab.checkpoint import load_checkpoint, save_checkpoint
from decoderlab.cli import CHAT_HELP
from decoderlab.cli import main as cli_main
from decoderlab.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
from decoderlab.generation import Sampler
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer

from .helps import helps


def test_chat_help_shows_the_defaults_a_conversation_uses(statquest_checkpoint):
    """chat leaves --temperature and --max-new-tokens to the session when not given: the help's values must be
    the session's."""
    import decoderlab as dl
    from decoderlab.chat import TEMPLATES, TemplateChatSession
    from decoderlab.generation import ChatSession

    h = helps("chat")
    assert h["--temperature"] == ("sampling temperature (default: 0 = greedy for pair-trained models, else "
                                  f"{DEFAULT_TEMPERATURE:g})")
    assert f"(default {DEFAULT_MAX_NEW_TOKENS};" in h["--max-new-tokens"]
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    session = ChatSession(model, tok)
    assert (session.params.temperature, session.params.max_new_tokens) == (DEFAULT_TEMPERATURE,
                                                                            DEFAULT_MAX_NEW_TOKENS)
    assert TemplateChatSession(model, tok, TEMPLATES["lesson"]).params.temperature == 0.0  # the lesson: greedy


def test_a_closed_output_ends_chat_quietly(closed_stdout_cli, statquest_checkpoint):
    """A reply written to a closed pipe said "decoderlab: error: [Errno 32] Broken pipe" (exit 2)."""
    assert closed_stdout_cli("chat", "--checkpoint", statquest_checkpoint, stdin="what is statquest\n") == (141, "")


def test_cli_chat_with_the_lesson_model(statquest_checkpoint, capsys, monkeypatch):
    type_lines(monkeypatch, ["what is statquest", "/temperature 0.7", "/temperature -1", "/top_k 20", "/help",
                             "/reset", "/temperature 0", "statquest is what", "what is hello", "/nope"])
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 2  # not a terminal: errors fail it
    captured = capsys.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    assert out[0] == "awesome"
    assert out[1] == "(temperature = 0.7)"
    assert out[2] == "(top_k = 20)"
    assert "/reset" in "\n".join(out) and "(conversation reset)" in out
    i = out.index("(temperature = 0)")
    assert out[i + 1:] == ["awesome"]
    assert len(err) == 3
    assert err[0].startswith("decoderlab: error: /temperature '-1'")
    assert err[1].startswith("decoderlab: error: unknown word 'hello'")
    assert err[2] == "decoderlab: error: unknown command /nope; type /help"


def test_chat_reads_stdin_until_end_of_file(statquest_checkpoint, capsys, monkeypatch):
    """The real input() on a non-terminal stdin: two turns, then end of input (Ctrl-D) exits with 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("what is statquest\n/reset\nstatquest is what\n"))
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    assert capsys.readouterr().out.splitlines() == ["awesome", "(conversation reset)", "awesome"]


def test_cli_chat_commands_named_as_flags(statquest_checkpoint, decoderlab_cli, monkeypatch, capsys):
    stdin = ("what is statquest\n/top-k 3\n/top_k 0\n/max-new-tokens 4\n/max_new_tokens x\n/top-p 0.9\n/help\n"
             "/quit\nwhat is statquest\n")
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stderr) == (2, "decoderlab: error: /max_new_tokens takes an integer >= 0 and <= 6 (the "
                                           "model's context, in tokens), got 'x'\n")
    out = r.stdout.splitlines()
    assert out[:5] == ["awesome", "(top-k = 3)", "(top_k off)", "(max-new-tokens = 4)", "(top-p = 0.9)"]
    assert out[5:] == CHAT_HELP.splitlines()  # and nothing after /quit
    for command in ("/top-k K", "/top-p P", "/max-new-tokens N", "/temperature T", "/reset", "/quit"):
        assert any(line.strip().startswith(command) for line in CHAT_HELP.splitlines()), command
    type_lines(monkeypatch, ["/exit", "what is statquest"])  # (in this process: a console-script process saved)
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    assert capsys.readouterr().out == ""


def test_ctrl_c_in_chat(statquest_checkpoint, capsys, monkeypatch):
    """Ctrl-C during a reply stops the reply and the conversation goes on; at the prompt it leaves (130)."""
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    real_call = Sampler.choose  # (the engine draws with choose, then reads the ids once)
    calls = []

    def interrupted(self, logits, generators, counts=None):
        calls.append(1)
        if len(calls) == 1:  # the first reply's first token
            raise KeyboardInterrupt
        return real_call(self, logits, generators, counts)

    type_lines(monkeypatch, ["what is statquest", "statquest is what", KeyboardInterrupt])
    monkeypatch.setattr(Sampler, "choose", interrupted)
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 130
    out = capsys.readouterr()
    assert out.out.splitlines() == ["(reply stopped)", "awesome"]
    assert out.err == "decoderlab: interrupted (chat stopped by Ctrl-C)\n"


def test_chat_command_errors_say_what_is_allowed(statquest_checkpoint, decoderlab_cli):
    """`/max-new-tokens abc` said "invalid literal for int() with base 10: 'abc'"; /seed and /top-k the same."""
    stdin = "/max-new-tokens abc\n/seed abc\n/seed -1\n/seed 99999999999999999999999\n/seed 5\n/top-k abc\n/top-k -2\n"
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stdout) == (2, "(seed = 5)\n")
    seed = "decoderlab: error: /seed takes an integer in 0 .. 2**63-1 (off: fresh entropy), got "
    top_k = "decoderlab: error: /top-k takes an integer >= 0 (0 or off: no top-k filter), got "
    assert r.stderr.splitlines() == ["decoderlab: error: /max-new-tokens takes an integer >= 0 and <= 6 (the model's "
                                     "context, in tokens), got 'abc'", seed + "'abc'",
                                     seed + "'-1'", seed + "'99999999999999999999999'",
                                     top_k + "'abc'", top_k + "'-2'"]


@pytest.mark.slow
def test_cli_generate_and_chat_use_the_stored_template(overfit, capsys, monkeypatch):
    out, _ = overfit
    assert cli.main(["generate", "--chat", "--checkpoint", str(out), "--temperature", "0", "abc"]) == 0
    assert capsys.readouterr().out == "def\n"
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("name a colour\nbye\n"))
    assert cli.main(["chat", "--checkpoint", str(out), "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["red", "see you"]


@pytest.mark.slow
def test_cli_explain_chat_renders_what_the_model_sees(overfit, capsys):
    """explain --chat traces exactly the ids chat and generate --chat give the model (the one renderer)."""
    out, _ = overfit
    model, tok, template, _ = load_model(out)
    want, _ = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}], tok,
                          template, add_generation_prompt=True)
    assert cli.main(["explain", "--chat", "--system", "be brief", "--checkpoint", str(out), "abc"]) == 0
    text = capsys.readouterr().out
    assert f"({len(want)} tokens, ids {want})" in text
    assert cli.main(["explain", "--checkpoint", str(out), "abc"]) == 0  # plain text: no template tokens
    assert f"(3 tokens, ids {tok.encode('abc')})" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_chat_flags_on_a_base_checkpoint_and_bad_combinations(statquest_checkpoint, overfit, tmp_path, capsys):
    out, _ = overfit
    data = write(tmp_path, GOOD)
    # a base language model (no template; the lesson's checkpoint stores the lesson's template)
    base = save_checkpoint(tmp_path / "base", *load_checkpoint(statquest_checkpoint), meta={"task": "lm"})
    cases = [
        (["generate", "--chat", "--checkpoint", str(base), "what is statquest"],
         "--chat needs a chat checkpoint"),
        (["generate", "--system", "x", "--checkpoint", str(out), "abc"], "--system applies with --chat"),
        (["generate", "--chat", "--stop", "x", "--checkpoint", str(out), "abc"], "--stop does not apply with --chat"),
        (["chat", "--system", "x", "--checkpoint", str(base)], "--system needs a chat checkpoint"),
        (["explain", "--chat", "--checkpoint", str(base), "what"], "--chat needs a chat checkpoint"),
        (["finetune", "--data", str(data), "--out", str(tmp_path / "o")], "give --checkpoint PATH"),
        (["finetune", "--checkpoint", str(out), "--n-layer", "2", "--data", str(data), "--out", str(tmp_path / "o")],
         "--n-layer applies with --preset"),
        (["finetune", "--preset", "statquest", "--val-fraction", "1", "--data", str(data), "--out",
          str(tmp_path / "o")], r"--val-fraction must be in \[0, 1\), got 1"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("decoderlab: error: ") and err.count("\n") == 1, err
        assert __import__("re").search(message, err), err


@pytest.mark.slow
def test_chat_notes_come_one_line_each(overfit, capsys, monkeypatch):
    """Both notes of one reply (turns dropped; no end of turn) were printed on one stderr line."""
    import io

    out, _ = overfit
    monkeypatch.setattr("sys.stdin", io.StringIO("/max-new-tokens 1\n" + "say yes\n" * 12))
    assert cli.main(["chat", "--checkpoint", str(out), "--temperature", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "(the reply stopped at 1 tokens without an end of turn)" in err
    both = [i for i, ln in enumerate(err) if ln.startswith("(the conversation was longer")]
    assert both and all(ln.startswith("(") and ln.endswith(")") and ln.count("(the ") == 1 for ln in err), err
    assert err[both[0] + 1] == "(the reply stopped at 1 tokens without an end of turn)"


def test_ctrl_c_during_a_reply_stops_only_that_reply(tmp_path):
    """One Ctrl-C (SIGINT) while a reply streams: "(reply stopped)", and the next line is answered (exit 0)."""
    import signal
    import time
    from pathlib import Path

    from decoderlab.checkpoint import save_checkpoint

    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1,
                                          n_head=2, tie_weights=False, lm_head_bias=True))
    with torch.no_grad():
        model.fc_layer.bias[tok.eos_id] = -1e4  # the reply never ends by itself
    ckpt = save_checkpoint(tmp_path / "ck", model, tok)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "chat", "--checkpoint", str(ckpt), "--seed", "1",
                          "--max-new-tokens", "100000000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        p.stdin.write(b"abc\n")
        p.stdin.flush()
        first = p.stdout.read(20)  # the reply is streaming
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        p.stdin.write(b"/max-new-tokens 3\nabc\n")
        p.stdin.close()
        rest = p.stdout.read()
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        p.kill()
    lines = (first + rest).decode().splitlines()
    stopped = lines.index("(reply stopped)")
    assert lines[stopped + 1:stopped + 2] == ["(max-new-tokens = 3)"] and len(lines) == stopped + 3
    assert len(lines[-1]) == 3 and set(lines[-1]) <= set("abcdefgh ")  # the next line got its 3-token answer
    assert p.stderr.read().decode().splitlines() == [
        f"({ckpt} has no chat template: each line continues the text so far, as a base model does; `decoderlab "
        "finetune` makes a chat checkpoint)"]


def test_max_new_tokens_in_chat_is_bounded_by_the_context(statquest_checkpoint, decoderlab_cli):
    """`/max-new-tokens 100000` was accepted while every reply is cut by the context (6 tokens here)."""
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin="/max-new-tokens 100000\n/max-new-tokens 6\n")
    assert r.stdout.splitlines() == ["(max-new-tokens = 6)"]
    assert r.stderr.splitlines() == ["decoderlab: error: /max-new-tokens takes an integer >= 0 and <= 6 (the model's "
                                     "context, in tokens), got '100000'"]


@pytest.mark.parametrize("template_name, flags", [("decoderlab", ()), ("tools", ("--tools", "calculator")),
                                                  ("decoderlab", ("--temperature", "1", "--seed", "3"))])
def test_an_empty_reply_is_a_reply_and_the_conversation_goes_on(tmp_path, capsys, monkeypatch, template_name, flags):
    """A model that ends its turn at once: every later turn said "error: message 5 is an empty assistant turn"
    (no decoderlab: prefix, exit status 0) until /reset. Now each empty reply is shown with why, and the
    conversation goes on."""
    from tiny_models import bigram_model

    from decoderlab.chat import TEMPLATES

    template = TEMPLATES[template_name]
    tok = CharTokenizer.from_text("abc").add_special_tokens(template.special_tokens)
    end, opener = tok.token_to_id["<|end|>"], tok.token_to_id["<|assistant|>"]
    model = bigram_model(tok.vocab_size, {opener: end}, max_len=64)  # after the opener: the end of turn at once
    ckpt = save_checkpoint(tmp_path / "ck", model, tok, meta={"task": "lm", "chat_template": template.to_dict()})
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\nb\nc\n"))
    assert cli_main(["chat", "--checkpoint", str(ckpt), *flags]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["", "", ""]
    assert captured.err.splitlines() == ["(an empty reply: the model ended its turn at once)"] * 3


def calling_checkpoint(path, template):
    """A chat checkpoint whose model calls the calculator in the chatml-tools layout: a byte-level BPE with
    ChatML's tokens and <tool_call> as an added token (Qwen's tokenizer), and a bigram model that opens a call
    after the assistant's opener, and under the call's grammar writes the expression "12+7" (after a token
    ending in a quote: 1, 2, +, 7, then the closing quote)."""
    from hf_chat_templates import CHATML_TOKENS, bpe_pair
    from tiny_models import bigram_model

    from decoderlab.chat import TOOLS, get_template

    tok, _ = bpe_pair(CHATML_TOKENS, ["<tool_call>", "</tool_call>"])
    ids, _ = get_template("chatml-tools").render([{"role": "user", "content": "What is 12 + 7?"}], tok,
                                                 add_generation_prompt=True, tools=[TOOLS["calculator"].definition])
    one, two, plus, seven, quote = (tok.token_to_id[c] for c in '12+7"')
    next_of = {i: one for i in range(tok.vocab_size) if tok.decode([i]).endswith('"')}
    next_of.update({ids[-1]: tok.token_to_id["<tool_call>"], one: two, two: plus, plus: seven, seven: quote})
    model = bigram_model(tok.vocab_size, next_of, max_len=2048)
    return save_checkpoint(path, model, tok, meta={"task": "chat", "chat_template": template.to_dict()})


def test_chat_tools_calculator_on_a_checkpoint_with_the_chatml_tools_template(tmp_path, capsys, monkeypatch):
    """`chat --tools calculator` was refused for every Hugging Face template; with chatml-tools the model's call,
    written in its own template's text, is read back, run, and shown with its result."""
    from decoderlab.chat import get_template

    ckpt = calling_checkpoint(tmp_path / "ck", get_template("chatml-tools"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 12 + 7?\n"))
    assert cli_main(["chat", "--checkpoint", str(ckpt), "--tools", "calculator", "--max-tool-calls", "1",
                     "--temperature", "0"]) == 0  # greedy: a sampled step may leave the bigram's choice
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ['[calculator {"expression": "12+7"} -> 19]', ""]
    assert captured.err.splitlines() == ["(the turn reached 1 tool calls, the most per turn)"]


#: ChatML without SmolLM2's default system message: a template chatml-tools does not extend
PLAIN_CHATML = (r"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                r"'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                r"{% endif %}")


def test_chat_tools_on_smollm2s_own_template_is_given_chatml_tools_and_calls_the_calculator(tmp_path, capsys,
                                                                                            monkeypatch):
    """SmolLM2-Instruct's own template writes no calls: --tools renders the conversation with chatml-tools (said
    once), so the model's call is read back, run and shown -- as with --template chatml-tools."""
    from hf_chat_templates import SMOLLM2

    from decoderlab.chat import JinjaChatTemplate

    ckpt = calling_checkpoint(tmp_path / "ck", JinjaChatTemplate(SMOLLM2, name="smollm2"))
    for flags in ([], ["--template", "chatml-tools"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("What is 12 + 7?\n"))
        assert cli_main(["chat", "--checkpoint", str(ckpt), "--tools", "calculator", "--max-tool-calls", "1",
                         "--temperature", "0", *flags]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines() == ['[calculator {"expression": "12+7"} -> 19]', ""]
        note = ([f"({ckpt}'s chat template 'smollm2' writes no tool calls: --tools renders the conversation with "
                 "'chatml-tools', the same ChatML with Qwen2.5's tool calls)"] if not flags else [])
        assert captured.err.splitlines() == note + ["(the turn reached 1 tool calls, the most per turn)"]


def test_chat_tools_on_a_template_without_calls_is_one_error_line_and_template_chooses_one(tmp_path, capsys,
                                                                                          monkeypatch):
    """A ChatML template that is not SmolLM2's (no default system message) writes no calls and chatml-tools would
    change its prompts: --tools is refused by name, and --template chatml-tools renders the conversation with the
    template that writes them."""
    from decoderlab.chat import JinjaChatTemplate

    ckpt = calling_checkpoint(tmp_path / "ck", JinjaChatTemplate(PLAIN_CHATML, name="chatml"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 12 + 7?\n"))
    assert cli_main(["chat", "--checkpoint", str(ckpt), "--tools", "calculator"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"decoderlab: error: --tools: {ckpt}: the 'chatml' chat template writes no tool calls decoderlab reads; "
        "tools need the \"tools\" or \"chatml-tools\" template, or a Hugging Face template that writes each call as "
        "JSON between <tool_call> and </tool_call> (as Qwen2.5's does)"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 12 + 7?\n"))
    assert cli_main(["chat", "--checkpoint", str(ckpt), "--template", "chatml-tools", "--tools", "calculator",
                     "--max-tool-calls", "1", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == ['[calculator {"expression": "12+7"} -> 19]', ""]
    assert cli_main(["chat", "--checkpoint", str(ckpt), "--template", "tools"]) == 2  # its tokens are not there
    assert capsys.readouterr().err.splitlines() == [
        "decoderlab: error: the tokenizer has no '<|system|>' token, which the 'tools' chat template needs; add the "
        "template's tokens first (decoderlab.chat.add_chat_tokens or Tokenizer.add_special_tokens)"]
