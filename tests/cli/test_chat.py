"""``decoderlab chat`` (decoderlab.cli.chat): the help's defaults are what a conversation uses, and a closed
output ends it quietly."""

from __future__ import annotations

from decoderlab.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE

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
    assert (session.temperature, session.max_new_tokens) == (DEFAULT_TEMPERATURE, DEFAULT_MAX_NEW_TOKENS)
    assert ChatSession(model, tok, pairs=True).temperature == 0.0


def test_a_closed_output_ends_chat_quietly(closed_stdout_cli, statquest_checkpoint):
    """A reply written to a closed pipe said "decoderlab: error: [Errno 32] Broken pipe" (exit 2)."""
    assert closed_stdout_cli("chat", "--checkpoint", statquest_checkpoint, stdin="what is statquest\n") == (141, "")
