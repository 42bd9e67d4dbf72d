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


def test_chat_reply_takes_the_tokenizer_after_the_messages_and_says_so(statquest_checkpoint):
    """(model, messages, tokenizer) is the order; the old (model, tokenizer, messages) is a TypeError showing the
    call to write."""
    model, tok, template, _ = load_model(statquest_checkpoint)
    messages = [{"role": "user", "content": "what is statquest"}]
    with pytest.raises(TypeError, match=r"chat_reply\(model, messages, tokenizer, ...\)"):
        chat_reply(model, tok, messages, template, temperature=0)
    with pytest.raises(TypeError, match=r"stream_chat_reply\(model, messages, tokenizer, ...\)"):
        "".join(stream_chat_reply(model, tok, messages, template, temperature=0))
    assert chat_reply(model, messages, tok, template, temperature=0) == "awesome"


def _tool_exchange(i):
    call = {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": {"a": i, "b": 2}}}
    return [{"role": "user", "content": f"{i} plus 2"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": str(i + 2)},
            {"role": "assistant", "content": f"it is {i + 2}"}]


def test_truncation_drops_whole_exchanges_never_a_call_without_its_result():
    """A tools conversation too long for the context lost its oldest messages two at a time, keeping a tool
    result without its call (check_messages then refused it); whole exchanges go now."""
    from decoderlab.chat import fit_messages, get_template
    from decoderlab.tokenizers import CharTokenizer

    template = get_template("tools")
    tok = CharTokenizer.from_text("".join(chr(c) for c in range(32, 127)) + "\n").add_special_tokens(
        list(template.special_tokens))
    messages = [{"role": "system", "content": "be brief"}, *_tool_exchange(1), *_tool_exchange(2)[:3]]
    whole, _ = template.render(messages, tok, add_generation_prompt=True)
    last, _ = template.render([messages[0], *messages[5:]], tok, add_generation_prompt=True)
    kept, dropped, ids = fit_messages(messages, tok, template, len(whole) - 1, 0)
    assert (kept, dropped, ids) == ([messages[0], *messages[5:]], 4, last)
    check_messages(kept, final="user")
    kept, dropped, _ = fit_messages(messages, tok, template, len(whole) + 1, 0)  # it fits: nothing dropped
    assert (kept, dropped) == (messages, 0)
    kept, dropped, _ = fit_messages(messages, tok, template, len(last) + 1, 10)  # the last exchange stays whole
    assert kept == [messages[0], *messages[5:]] and dropped == 4


def test_a_reply_cut_by_a_full_context_says_so(capsys):
    """A reply that stopped because the prompt and the reply filled the context ended with no word of it:
    the chat session's notice and `generate --chat` say "context full"."""
    from decoderlab.chat import get_template
    from decoderlab.chat.replies import context_full_note

    model, tok = chat_pair()
    template = get_template("decoderlab")
    eot = template.end_of_turn_id(tok)
    info = {}
    reply = chat_reply(model, [{"role": "user", "content": "hi"}], tok, template, max_new_tokens=1000,
                       temperature=1.0, seed=0, logit_bias={eot: -100, tok.eos_id: -100}, info=info)
    assert info["context_full"] and not info["ended_with_end_of_turn"] and len(info["reply_ids"]) <= 48
    note = context_full_note(info, 48)
    assert note.startswith("(context full: the reply stopped at ") and "48-token context" in note
    session = TemplateChatSession(model, tok, template, temperature=1.0, seed=0, max_new_tokens=1000,
                                  logit_bias={eot: -100, tok.eos_id: -100})
    "".join(session.reply("hi"))
    assert session.notice.startswith("(context full")
    info = {}
    chat_reply(model, [{"role": "user", "content": "hi"}], tok, template, max_new_tokens=3, temperature=1.0,
               seed=0, logit_bias={eot: -100, tok.eos_id: -100}, info=info)
    assert not info["context_full"] and context_full_note(info, 48) is None  # stopped at max_new_tokens
    assert reply is not None
