"""``decoderlab chat`` (decoderlab.cli.chat): the help's defaults are what a conversation uses, a closed output
ends it quietly, the slash commands are named as the flags and say what they take, Ctrl-C stops a reply."""

from __future__ import annotations

import io
import sys

from conftest import type_lines
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.cli import CHAT_HELP
from decoderlab.cli import main as cli_main
from decoderlab.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
from decoderlab.generation import Sampler

from .helps import helps


def test_chat_help_shows_the_defaults_a_conversation_uses(statquest_checkpoint):
    """chat leaves --temperature and --max-new-tokens to the session when not given: the help's values must be
    the session's."""
    import decoderlab as dl
    from decoderlab.generation import ChatSession

    h = helps("chat")
    assert h["--temperature"] == ("sampling temperature (default: 0 = greedy for pair-trained models, else "
                                  f"{DEFAULT_TEMPERATURE:g})")
    assert f"(default {DEFAULT_MAX_NEW_TOKENS};" in h["--max-new-tokens"]
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    session = ChatSession(model, tok)
    assert (session.params.temperature, session.params.max_new_tokens) == (DEFAULT_TEMPERATURE,
                                                                            DEFAULT_MAX_NEW_TOKENS)
    assert ChatSession(model, tok, pairs=True).params.temperature == 0.0


def test_a_closed_output_ends_chat_quietly(closed_stdout_cli, statquest_checkpoint):
    """A reply written to a closed pipe said "decoderlab: error: [Errno 32] Broken pipe" (exit 2)."""
    assert closed_stdout_cli("chat", "--checkpoint", statquest_checkpoint, stdin="what is statquest\n") == (141, "")


def test_cli_chat_with_the_lesson_model(statquest_checkpoint, capsys, monkeypatch):
    type_lines(monkeypatch, ["what is statquest", "/temperature 0.7", "/temperature -1", "/top_k 20", "/help",
                             "/reset", "/temperature 0", "statquest is what", "what is hello", "/nope"])
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "awesome"
    assert out[1] == "(temperature = 0.7)"
    assert out[2].startswith("error: /temperature '-1'")
    assert out[3] == "(top_k = 20)"
    assert "/reset" in "\n".join(out) and "(conversation reset)" in out
    i = out.index("(temperature = 0)")
    assert out[i + 1] == "awesome"
    assert out[i + 2].startswith("error: unknown word 'hello'")
    assert out[-1].startswith("unknown command /nope")


def test_chat_reads_stdin_until_end_of_file(statquest_checkpoint, capsys, monkeypatch):
    """The real input() on a non-terminal stdin: two turns, then end of input (Ctrl-D) exits with 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("what is statquest\n/reset\nstatquest is what\n"))
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    assert capsys.readouterr().out.splitlines() == ["awesome", "(conversation reset)", "awesome"]


def test_cli_chat_commands_named_as_flags(statquest_checkpoint, decoderlab_cli):
    stdin = ("what is statquest\n/top-k 3\n/top_k 0\n/max-new-tokens 4\n/max_new_tokens x\n/top-p 0.9\n/help\n"
             "/quit\nwhat is statquest\n")
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stderr) == (0, "")
    out = r.stdout.splitlines()
    assert out[:6] == ["awesome", "(top-k = 3)", "(top_k off)", "(max-new-tokens = 4)",
                       "error: /max_new_tokens takes an integer >= 0, got 'x'", "(top-p = 0.9)"]
    assert out[6:] == CHAT_HELP.splitlines()  # and nothing after /quit
    for command in ("/top-k K", "/top-p P", "/max-new-tokens N", "/temperature T", "/reset", "/quit"):
        assert any(line.strip().startswith(command) for line in CHAT_HELP.splitlines()), command
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin="/exit\nwhat is statquest\n")
    assert (r.returncode, r.stdout) == (0, "")


def test_ctrl_c_in_chat(statquest_checkpoint, capsys, monkeypatch):
    """Ctrl-C during a reply stops the reply and the conversation goes on; at the prompt it leaves (130)."""
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    real_call = Sampler.__call__
    calls = []

    def interrupted(self, logits, generators, counts=None):
        calls.append(1)
        if len(calls) == 1:  # the first reply's first token
            raise KeyboardInterrupt
        return real_call(self, logits, generators, counts)

    type_lines(monkeypatch, ["what is statquest", "statquest is what", KeyboardInterrupt])
    monkeypatch.setattr(Sampler, "__call__", interrupted)
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 130
    out = capsys.readouterr()
    assert out.out.splitlines() == ["(reply stopped)", "awesome"]
    assert out.err == "decoderlab: interrupted (chat stopped by Ctrl-C)\n"


def test_chat_command_errors_say_what_is_allowed(statquest_checkpoint, decoderlab_cli):
    """`/max-new-tokens abc` said "invalid literal for int() with base 10: 'abc'"; /seed and /top-k the same."""
    stdin = "/max-new-tokens abc\n/seed abc\n/seed -1\n/seed 99999999999999999999999\n/seed 5\n/top-k abc\n/top-k -2\n"
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stderr) == (0, "")
    seed = "error: /seed takes an integer in 0 .. 2**63-1 (off: fresh entropy), got "
    top_k = "error: /top-k takes an integer >= 0 (0 or off: no top-k filter), got "
    assert r.stdout.splitlines() == ["error: /max-new-tokens takes an integer >= 0, got 'abc'", seed + "'abc'",
                                     seed + "'-1'", seed + "'99999999999999999999999'", "(seed = 5)",
                                     top_k + "'abc'", top_k + "'-2'"]
