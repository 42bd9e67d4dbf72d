"""Prompts to token ids: a completion's prompt (text or ids) and a chat's messages (the chat template), checked
against the model's context length, its vocabulary and the server's limits."""

from __future__ import annotations

from ..chat import JinjaChatTemplate, arguments_as_objects
from ..tokenizers import encode_with_special_tokens
from .errors import APIError, bad
from .protocol import ChatMessage
from .state import AppState


def check_context(state: AppState, ids: list[int], param: str) -> list[int]:
    """``ids`` when they fit the context; else the 400 ``context_length_exceeded`` naming both lengths."""
    if len(ids) > state.max_len:
        raise APIError(400, f"this model's maximum context length is {state.max_len} tokens; the prompt has "
                            f"{len(ids)} tokens", param=param, code="context_length_exceeded")
    return ids


def encode_prompt(state: AppState, prompt: str | list[int], param: str = "prompt", *,
                  add_special_tokens: bool = True) -> list[int]:
    """Text (the tokenizer's ids, with the start token it puts first when ``add_special_tokens``, vLLM's field
    and default: :func:`~decoderlab.tokenizers.encode_with_special_tokens`) or token ids (each in range, taken
    as given, as vLLM takes them); an empty prompt is ``<EOS>``, the start token. Not checked against the context
    length (see :func:`check_context`)."""
    tok, vocab = state.tokenizer, state.model.config.num_tokens
    if isinstance(prompt, str):
        try:
            ids = encode_with_special_tokens(tok, prompt) if add_special_tokens else list(tok.encode(prompt))
        except (KeyError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise bad(param, f"the {param} cannot be encoded by this model's tokenizer: {msg}",
                      "invalid_prompt") from None
    else:
        out_of_range = [i for i in prompt if not 0 <= i < vocab]
        if out_of_range:
            raise bad(param, f"token id {out_of_range[0]} is out of range; allowed ids are 0 .. {vocab - 1}")
        ids = list(prompt)
    if not ids:
        eos = getattr(tok, "eos_id", None)
        if eos is None:
            raise bad(param, f"the {param} is empty and this model has no start token (<EOS>)")
        ids = [eos]
    return ids


def need_template(state: AppState, hint: str) -> None:
    """A base model (no chat template) answers messages with a 400 saying what to do instead."""
    if state.template is None:
        raise APIError(400, f"the model {state.model_id!r} is a base model without a chat template: {hint}",
                       param="messages", code="no_chat_template")


def _message(m: ChatMessage) -> dict:
    """A request's message as the chat template reads it (``developer`` is ``system``)."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def merged_system(messages: list[dict]) -> list[dict]:
    """The messages with every system message after the first merged into one system message first (their
    texts joined by a blank line, in order): a chat template has one system turn, at the start, while clients
    (LangChain's agents, OpenAI's own examples) send instructions later too, which peers accept."""
    systems = [m["content"] for m in messages if m["role"] == "system"]
    if len(systems) <= 1 and (not systems or messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": "\n\n".join(systems)}] + [m for m in messages if m["role"] != "system"]


def _check_tool_results(messages: list[ChatMessage]) -> None:
    """Each ``tool`` message answers a call of the assistant message before it: a 400 naming its
    ``tool_call_id`` otherwise."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                raise bad(f"messages[{i}].tool_call_id", f"messages[{i}] is a tool result for tool_call_id "
                          f"{m.tool_call_id!r}, which no call of the assistant message before it has "
                          f"(open calls: {', '.join(sorted(open_calls)) or 'none'})")
            open_calls.discard(m.tool_call_id)
        else:
            open_calls = {c.id for c in m.tool_calls or ()}


def render_messages(state: AppState, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """The messages' token ids through the chat template (at most ``--max-messages`` of them; ``tools``: the
    functions offered, rendered by a template that writes tool calls: :meth:`AppState.chat_template`). A Hugging
    Face template reads each call's arguments as an object, as vLLM gives them (OpenAI's JSON text would be
    written quoted). Not checked against the context length."""
    if len(messages) > state.limits.max_messages:
        raise bad("messages", f"messages has {len(messages)} entries; this server's limit is "
                              f"{state.limits.max_messages} (--max-messages)", "messages_limit")
    _check_tool_results(messages)
    clean = merged_system([_message(m) for m in messages])
    template = state.chat_template(bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages))
    if isinstance(template, JinjaChatTemplate):
        clean = arguments_as_objects(clean)
    more = {"tools": tools} if tools else {}
    try:
        ids, _mask = template.render(clean, state.tokenizer, add_generation_prompt=add_generation_prompt, **more)
    except (KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise bad("messages", f"the messages cannot be rendered with this model's chat template: {msg}",
                  "invalid_prompt") from None
    return list(ids)
