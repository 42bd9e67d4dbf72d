"""A conversation's shape: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]`` -- an optional
system message first, then user and assistant turns alternating, starting with the user."""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


def check_messages(messages, *, final: str | None = "assistant") -> None:
    """Check a conversation: a list of ``{"role", "content"}`` dicts with string content, roles among
    system/user/assistant, an optional system message first, then user and assistant alternating from the
    user; assistant turns non-empty. ``final``: the role the last message must have ("assistant" for
    training data, "user" before a reply, None: either).

    Raises:
        ValueError: naming the message index and what is wrong.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    expect = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be an object with \"role\" and \"content\", got {str(m)[:80]}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) content must be a string, got {type(content).__name__}")
        if role == "system":
            if i != 0:
                raise ValueError(f"message {i} is a system message; only the first message may be one")
            continue
        if role != expect:
            what = "two user turns in a row" if role == "user" else (
                "two assistant turns in a row" if i > 0 and messages[i - 1].get("role") == "assistant"
                else "an assistant turn before any user turn")
            raise ValueError(f"message {i}: {what}; after an optional system message, user and assistant "
                             f"turns must alternate, starting with the user")
        if role == "assistant" and not content.strip():
            raise ValueError(f"message {i} is an empty assistant turn")
        expect = "assistant" if role == "user" else "user"
    last = messages[-1]["role"]
    if final is not None and last != final:
        raise ValueError(f"the conversation must end with {_a(final)} message, but its last message "
                         f"({len(messages) - 1}) is {_a(last)} message")


def _a(role: str) -> str:
    """The role with its article: "an assistant", "a user", "a system" (by sound: "a user")."""
    return f"{'an' if role == 'assistant' else 'a'} {role}"
