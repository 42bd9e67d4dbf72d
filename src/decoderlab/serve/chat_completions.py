"""``POST /v1/chat/completions``: the next assistant turn, for checkpoints with a chat template."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from .body import JSONRoute
from .errors import ERROR_RESPONSES
from .generation import settings_of
from .prompts import check_context, need_template, render_messages
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, ChatLogprobs, Usage)
from .state import AppState, app_state
from .streaming import respond, streamed
from .tools import answer, banned_calls, tool_turn

router = APIRouter(route_class=JSONRoute, tags=["chat"])


class ChatCompletions:
    """The chat family of the streaming adapter."""

    id_prefix = "chatcmpl-"

    def response(self, head: dict, texts, finish, logprobs, usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(**head, usage=usage, choices=[
            ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish[i],
                       logprobs=None if logprobs is None else ChatLogprobs(content=logprobs[i]))
            for i, text in enumerate(texts)])

    def chunk(self, head: dict, choices, usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=choices, usage=usage)

    def opening(self, index: int) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))

    def delta(self, index: int, text: str, logprobs, offset: int) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=ChatDelta(content=text),
                               logprobs=None if logprobs is None else ChatLogprobs(content=logprobs))

    def finish(self, index: int, reason: str) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**ERROR_RESPONSES, 200: streamed(ChatCompletionChunk)})
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: AppState = Depends(app_state)):
    """The messages rendered with the checkpoint's chat template, continued as ``decoderlab.generate`` does;
    the template's end of turn (and ``<EOS>``) ends the reply. With ``tools``, the turn may call one
    (:mod:`decoderlab.serve.tools`)."""
    state.check_model(body.model)
    need_template(state, "use /v1/completions, or fine-tune it for chat first (the chat template is stored in its "
                         "checkpoint)")
    settings = settings_of(body, state.limits)
    turn = tool_turn(state, body, settings)
    ids = check_context(state, render_messages(state, body.messages, tools=body.tools), "messages")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if turn is not None and turn.choice != "none":
        return await answer(request, state, settings, ids, turn, stream=bool(body.stream),
                            include_usage=include_usage)
    if turn is not None:
        settings = banned_calls(settings, turn)
    stop_ids = [int(state.template.end_of_turn_id(state.tokenizer))]
    return await respond(request, state, ChatCompletions(), settings, [ids], stop_ids, stream=bool(body.stream),
                         include_usage=include_usage)
