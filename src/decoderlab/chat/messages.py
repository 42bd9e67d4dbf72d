"""A conversation's shape: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]`` -- an
optional system message first, then user and assistant turns alternating, starting with the user; an assistant
turn may call tools (``"tool_calls"``), answered by one ``tool`` message per call (``"tool_call_id"``) before the
assistant speaks again."""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")

#: the keys a message may have besides role and content
_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def check_tool_calls(calls, where: str) -> list[str]:
    """The ids of an assistant message's ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``, ``arguments`` a JSON text or an object. Raises ``ValueError`` naming ``where``."""
    if not isinstance(calls, (list, tuple)) or not calls:
        raise ValueError(f"{where} tool_calls must be a non-empty list of calls")
    ids = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"] \
                or not isinstance(fn.get("arguments"), (str, dict)):
            raise ValueError(f"{where} tool call {j} must be {{\"id\", \"type\": \"function\", \"function\": "
                             f"{{\"name\", \"arguments\"}}}}, got {str(c)[:80]}")
        ids.append(str(c.get("id", "")))
    return ids


def _check_one(i: int, m, pending: list[str]) -> None:
    if not isinstance(m, dict) or set(m) - _KEYS or "role" not in m or "content" not in m:
        raise ValueError(f"message {i} must be an object with \"role\" and \"content\", got {str(m)[:80]}")
    role, content = m["role"], m["content"]
    if role not in ROLES:
        raise ValueError(f"message {i} has unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
    if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
        raise ValueError(f"message {i} ({role}) content must be a string, got {type(content).__name__}")
    if m.get("tool_calls") is not None and role != "assistant":
        raise ValueError(f"message {i} ({role}) has tool_calls; only an assistant message may call tools")
    if role == "tool":
        if m.get("tool_call_id") not in pending:
            raise ValueError(f"message {i} is a tool result for tool_call_id {m.get('tool_call_id')!r}, which no "
                             f"unanswered call of the assistant message before it has"
                             + (f" (open calls: {', '.join(pending)})" if pending else ""))
        pending.remove(m["tool_call_id"])


def check_messages(messages, *, final: str | None = "assistant") -> None:
    """Check a conversation: a list of ``{"role", "content"}`` dicts with string content, roles among
    system/user/assistant/tool, an optional system message first, then user and assistant alternating from the
    user; an assistant turn with ``tool_calls`` followed by one ``tool`` message per call (its
    ``tool_call_id``), then an assistant turn. ``final``: the role the last message must have ("assistant" for
    training data, "user" before a reply -- a tool result may end it too --, None: either). Training data
    (``final="assistant"``) has no empty assistant turn (it would teach a model to say nothing); a conversation
    to answer may hold one: a model that ends its turn at once has said nothing, and that was its reply.

    Raises:
        ValueError: naming the message index and what is wrong.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    expect, pending = "user", []
    for i, m in enumerate(messages):
        _check_one(i, m, pending)
        role = m["role"]
        if role == "system":
            if i != 0:
                raise ValueError(f"message {i} is a system message; only the first message may be one")
            continue
        if role == "tool":
            expect = "tool" if pending else "assistant"
            continue
        if role != expect:
            what = ("a tool call without its result" if expect == "tool" else
                    "two user turns in a row" if role == "user" else (
                        "two assistant turns in a row" if i > 0 and messages[i - 1].get("role") == "assistant"
                        else "an assistant turn before any user turn"))
            raise ValueError(f"message {i}: {what}; after an optional system message, user and assistant "
                             f"turns must alternate, starting with the user (each tool call answered by a tool "
                             f"message)")
        if role == "assistant" and m.get("tool_calls") is not None:
            pending = check_tool_calls(m["tool_calls"], f"message {i}")
            expect = "tool"
            continue
        if role == "assistant" and final == "assistant" and not m["content"].strip():
            raise ValueError(f"message {i} is an empty assistant turn")
        expect = "assistant" if role == "user" else "user"
    last = messages[-1]["role"]
    if pending:
        raise ValueError(f"the tool call(s) {', '.join(pending)} of the last assistant message have no tool result")
    if final is not None and last != final and not (final == "user" and last == "tool"):
        raise ValueError(f"the conversation must end with {_a(final)} message, but its last message "
                         f"({len(messages) - 1}) is {_a(last)} message")


def _a(role: str) -> str:
    """The role with its article: "an assistant", "a user", "a system" (by sound: "a user")."""
    return f"{'an' if role == 'assistant' else 'a'} {role}"
