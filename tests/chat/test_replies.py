"""Chat replies: the prompt is exactly the training layout, the oldest turns go first (never the system
message), a reply needs a final user message, and a last message too long for the model is named."""

import pytest
from tiny_runs import CONVS, chat_pair, conv, one_thread  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import TemplateChatSession, chat_reply, check_messages, load_model, render_chat, stream_chat_reply


@pytest.mark.slow
def test_chat_renders_exactly_the_training_ids(overfit):
    out, _ = overfit
    model, tok, template, _ = load_model(out)
    c = CONVS[3]  # two turns
    train_ids, _ = render_chat(c, tok, template)
    info = {}
    chat_reply(model, c[:1], tok, template, temperature=0.0, info=info)
    assert info["prompt_ids"] == train_ids[: len(info["prompt_ids"])]
    assert info["prompt_ids"][-1] == tok.token_to_id["<|assistant|>"]
    session = TemplateChatSession(model, tok, template, temperature=0.0)
    assert "".join(session.reply(c[0]["content"])) == c[1]["content"]
    second = {}
    list(stream_chat_reply(model, session.messages + [c[2]], tok, template, temperature=0.0, info=second))
    assert second["prompt_ids"] == train_ids[: len(second["prompt_ids"])]
    assert "".join(session.reply(c[2]["content"])) == c[3]["content"]


@pytest.mark.slow
def test_chat_trims_oldest_turns_keeps_system(overfit, capsys):
    out, _ = overfit
    model, tok, template, _ = load_model(out)
    long = [{"role": "system", "content": "be brief"}]
    for _ in range(4):
        long += conv("say yes", "yes")
    long.append({"role": "user", "content": "say no"})
    info = {}
    chat_reply(model, long, tok, template, temperature=0.0, max_new_tokens=8, info=info)
    assert info["dropped_messages"] > 0 and info["dropped_messages"] % 2 == 0
    assert info["prompt_ids"][0] == tok.token_to_id["<|system|>"] and len(info["prompt_ids"]) <= 48 - 8
    session = TemplateChatSession(model, tok, template, system="be brief", temperature=0.0, max_new_tokens=8)
    for _ in range(5):
        "".join(session.reply("say yes"))
    assert session.messages[0]["role"] == "system" and "dropped" in session.notice


def test_reply_needs_a_final_user_message():
    model, tok = chat_pair()
    with pytest.raises(ValueError, match="must end with a user message"):
        chat_reply(model, conv("a", "b"), tok)
    with pytest.raises(ValueError, match="only the first message"):
        check_messages([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], final=None)


@pytest.mark.slow
def test_the_last_message_alone_renders_too_long_in_the_singular(overfit):
    out, _ = overfit
    model, tok, template, _ = load_model(out)
    with pytest.raises(ValueError, match=r"^the last user message alone renders to \d+ tokens, which leaves no room"):
        chat_reply(model, [{"role": "user", "content": "say yes " * 40}], tok, template, max_new_tokens=4)


def test_chat_reply_in_the_old_order_still_works_and_warns(statquest_checkpoint):
    """(model, messages, tokenizer) is the order; the old (model, tokenizer, messages) gives the same reply for
    one release, with a DeprecationWarning."""
    model, tok, template, _ = load_model(statquest_checkpoint)
    messages = [{"role": "user", "content": "what is statquest"}]
    with pytest.warns(DeprecationWarning, match=r"chat_reply\(model, messages, tokenizer, ...\)"):
        old = chat_reply(model, tok, messages, template, temperature=0)
    with pytest.warns(DeprecationWarning, match=r"stream_chat_reply\(model, messages, tokenizer, ...\)"):
        old_stream = "".join(stream_chat_reply(model, tok, messages, template, temperature=0))
    assert old == old_stream == chat_reply(model, messages, tok, template, temperature=0) == "awesome"
