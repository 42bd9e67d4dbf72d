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
