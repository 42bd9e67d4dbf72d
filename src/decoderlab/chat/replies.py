"""Chat replies: the assistant's reply to a conversation, rendered with the checkpoint's template (the renderer
training used), streamed as text, stopping at the end of turn; and ``TemplateChatSession``, the conversation of
``decoderlab chat``."""

from __future__ import annotations

from typing import Iterator, Sequence

from ..generation import ChatSession, SamplingParams, TextStreamer, stream
from ..generation.text import EMPTY_REPLY
from ..tokenizers import Tokenizer, check_input_first
from .messages import check_messages
from .templates import ChatTemplate, get_template


def fit_messages(messages: Sequence[dict], tokenizer: Tokenizer, template: ChatTemplate, max_len: int,
                 reserve: int) -> tuple[list[dict], int, list[int]]:
    """Drop the oldest exchanges (a user message with everything up to the next user message: the assistant's
    reply, or its tool calls, their results and the reply after them -- never a call without its result; never
    the system message) until the rendered prompt (with the generation prompt) plus ``reserve`` new tokens
    fits in ``max_len``.

    Returns:
        ``(kept_messages, number_of_messages_dropped, prompt_ids)``. When even the last exchange alone (the
        last user message, with the tool calls and results after it) leaves less than ``reserve`` tokens, it is
        kept with what room there is.

    Raises:
        ValueError: the system message and the last user message alone render to ``max_len`` tokens or more.
    """
    messages = list(messages)
    check_messages(messages, final="user")
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    dropped = 0
    while True:
        ids, _ = template.render(head + body, tokenizer, add_generation_prompt=True)
        users = [i for i, m in enumerate(body) if m["role"] == "user"]
        if len(ids) + reserve <= max_len or len(users) <= 1:
            break
        body = body[users[1]:]  # the oldest whole exchange
        dropped += users[1]
    if len(ids) >= max_len:
        what = "system message and the last user message alone render" if head else "last user message alone renders"
        raise ValueError(f"the {what} to {len(ids)} tokens, which leaves no room for a reply within the model's "
                         f"max_len={max_len}; shorten the message")
    return head + body, dropped, ids


def context_full_note(info: dict, max_len: int) -> str | None:
    """The line saying a reply ended because the context was full (its prompt and reply filled ``max_len``
    before the end of turn or ``max_new_tokens``), from :func:`stream_chat_reply`'s ``info``; else None."""
    if info.get("ended_with_end_of_turn") or not info.get("context_full"):
        return None
    return (f"(context full: the reply stopped at {info['max_new_tokens']} tokens, where the prompt and the reply "
            f"fill the model's {max_len}-token context)")


def stream_chat_reply(model, messages: Sequence[dict], tokenizer: Tokenizer,
                      template: str | ChatTemplate | None = None, params: SamplingParams | int | None = None, *,
                      info: dict | None = None, **sampling) -> Iterator[str]:
    """Stream the assistant's reply to ``messages`` (ending with a user message) as text pieces.

    The prompt is ``template.render(messages, add_generation_prompt=True)`` -- the renderer training used.
    If it does not fit in ``max_len`` with room for ``min(max_new_tokens, max_len // 2)`` new tokens, the
    oldest turns are dropped (:func:`fit_messages`; never the system message). Generation
    (:func:`decoderlab.generation.stream`, KV cache) stops at the end-of-turn token (not part of the reply)
    or after ``min(max_new_tokens, max_len - prompt length)`` tokens, so the context never slides.

    Args:
        model: e.g. from :func:`~decoderlab.chat.load_model`; messages: OpenAI's ``[{"role", "content"}]``.
        tokenizer: after the messages, as in every public function (one in the messages' place is a
            ``TypeError``).
        template: the checkpoint's (None: default).
        params, **sampling: the settings (a :class:`decoderlab.generation.SamplingParams`, or an int for
            max_new_tokens, and fields over it: ``temperature=0``), as :func:`decoderlab.generation.stream`.
        info: a dict to receive ``prompt_ids``, ``dropped_messages`` (count), ``reply_ids``,
            ``ended_with_end_of_turn`` (bool), ``max_new_tokens`` (the cap actually used) and ``context_full``
            (that cap is the room left in the context, below the one asked for).

    Raises:
        ValueError: bad messages; the tokenizer lacks the template's tokens; bad sampling values; a last
            message too long for the model.
    """
    check_input_first("stream_chat_reply", "messages", messages)
    params = SamplingParams.of(params, **sampling)
    template = get_template(template)
    max_len = model.config.max_len
    reserve = max(1, min(params.max_new_tokens, max_len // 2))
    kept, dropped, ids = fit_messages(messages, tokenizer, template, max_len, reserve)
    eot = template.end_of_turn_id(tokenizer)
    n_new = max(0, min(params.max_new_tokens, max_len - len(ids)))
    if info is not None:
        info.update(prompt_ids=list(ids), dropped_messages=dropped, max_new_tokens=n_new, reply_ids=[],
                    ended_with_end_of_turn=False, context_full=n_new < params.max_new_tokens)
    # the end of turn ends the reply, whatever the settings; <PAD> is never sampled and <EOS> ends it too
    params = params.replace(max_new_tokens=n_new, stop=(eot,) + (params.stop or ()))
    gen = stream(model, ids, params, tokenizer=tokenizer)
    streamer = TextStreamer(tokenizer)
    while True:
        try:
            token = next(gen)
        except StopIteration as end:
            matched = end.value
            break
        if info is not None:
            info["reply_ids"].append(token)
        piece = streamer.put(token)
        if piece:
            yield piece
    tail = streamer.end()
    if tail:
        yield tail
    if info is not None:
        info["ended_with_end_of_turn"] = matched == (eot,)


def chat_reply(model, messages: Sequence[dict], tokenizer: Tokenizer, template: str | ChatTemplate | None = None,
               params: SamplingParams | int | None = None, *, info: dict | None = None, **sampling) -> str:
    """The assistant's reply to ``messages`` as one string (``"".join(stream_chat_reply(...))``)."""
    check_input_first("chat_reply", "messages", messages)
    return "".join(stream_chat_reply(model, messages, tokenizer, template, params, info=info, **sampling))


class TemplateChatSession(ChatSession):
    """``decoderlab chat`` for a chat checkpoint: the conversation is kept as messages and every turn is
    rendered with the stored template (:func:`stream_chat_reply`), so the model sees the layout it was
    fine-tuned on. Replies stop at the end of turn. When the history no longer fits in ``max_len``, the oldest
    turns are dropped (never the system message) and ``notice`` says so until the next reply.

    Args: as :class:`decoderlab.generation.ChatSession`, plus ``template`` and an optional ``system`` message.
    Defaults: the template's ``default_temperature`` (greedy for the "lesson" template, as the lesson; 1.0
    otherwise); max_new_tokens the :class:`~decoderlab.generation.SamplingParams` default.
    """

    def __init__(self, model, tokenizer, template: ChatTemplate, params: SamplingParams | None = None, *,
                 system: str | None = None, **sampling):
        template = get_template(template)
        if params is None:
            sampling = {"temperature": template.default_temperature, **sampling}
        super().__init__(model, tokenizer, params, **sampling)
        self.template = template
        self.template.end_of_turn_id(tokenizer)  # the tokenizer must hold the template's tokens
        self.system = system
        self.notice: str | None = None
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Iterator[str]:
        messages = self.messages + [{"role": "user", "content": text}]
        info: dict = {}
        self.notice = None
        pieces: list[str] = []
        for piece in stream_chat_reply(self.model, messages, self.tokenizer, self.template, self.turn_params(),
                                       info=info):
            pieces.append(piece)
            yield piece
        head = 1 if messages[0]["role"] == "system" else 0
        kept = messages[:head] + messages[head + info["dropped_messages"]:]
        self.messages = kept + [{"role": "assistant", "content": "".join(pieces)}]
        self.notice = self._notes(info, head)
        self.turn += 1

    def _notes(self, info: dict, head: int) -> str | None:
        """What the last reply did not say itself, one line each: turns dropped, no end of turn."""
        notes = []
        if not info["reply_ids"] and info["ended_with_end_of_turn"]:
            notes.append(EMPTY_REPLY)
        if info["dropped_messages"]:
            notes.append(f"(the conversation was longer than the model's {self.model.config.max_len}-token "
                         f"context: dropped the {info['dropped_messages']} oldest messages"
                         f"{', kept the system message' if head else ''})")
        if not info["ended_with_end_of_turn"]:
            notes.append(context_full_note(info, self.model.config.max_len) or
                         f"(the reply stopped at {info['max_new_tokens']} tokens without an end of turn)")
        return "\n".join(notes) or None
