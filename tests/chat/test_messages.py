"""A conversation's shape: the check names the message and what is wrong, in plain English."""

import pytest
from tiny_runs import conv

from decoderlab.chat import check_messages


@pytest.mark.parametrize("messages, final, message", [
    (conv("a", "b"), "user", "the conversation must end with a user message, but its last message (1) is an "
                             "assistant message"),
    (conv("a"), "assistant", "the conversation must end with an assistant message, but its last message (0) is a "
                             "user message"),
])
def test_the_last_message_is_named_with_its_article(messages, final, message):
    """"a assistant message" read wrong."""
    with pytest.raises(ValueError) as e:
        check_messages(messages, final=final)
    assert str(e.value) == message


def _call(i):
    return {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_tool_calls_are_answered_by_tool_results_before_the_assistant_speaks():
    ok = [{"role": "user", "content": "q"},
          {"role": "assistant", "content": None, "tool_calls": [_call("a"), _call("b")]},
          {"role": "tool", "tool_call_id": "b", "content": "1"}, {"role": "tool", "tool_call_id": "a", "content": "2"}]
    check_messages(ok, final="user")  # a tool result may end a conversation awaiting the reply
    check_messages(ok + [{"role": "assistant", "content": "3"}])
    with pytest.raises(ValueError, match="message 3 is a tool result for tool_call_id 'b'"):
        check_messages(ok[:3] + [{"role": "tool", "tool_call_id": "b", "content": "2"}], final=None)
    with pytest.raises(ValueError, match="message 2: a tool call without its result"):
        check_messages(ok[:2] + [{"role": "user", "content": "x"}], final=None)
    with pytest.raises(ValueError, match="have no tool result"):
        check_messages(ok[:3], final=None)
    with pytest.raises(ValueError, match="only an assistant message may call tools"):
        check_messages([{"role": "user", "content": "q", "tool_calls": [_call("a")]}], final=None)
    with pytest.raises(ValueError, match="message 1 is a tool result"):
        check_messages([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "a", "content": "1"}],
                       final=None)


def test_an_empty_reply_is_refused_in_training_data_and_kept_in_a_conversation_to_answer():
    """A model that ends its turn at once has replied: the conversation goes on (chat wedged on it). Training
    data never holds an empty reply (it would teach a model to say nothing)."""
    with pytest.raises(ValueError, match="message 1 is an empty assistant turn"):
        check_messages(conv("a", "", "b", "c"), final="assistant")
    check_messages(conv("a", "", "b"), final="user")
    check_messages(conv("a", ""), final=None)
