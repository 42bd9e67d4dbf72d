"""``POST /v1/completions``: continue a prompt (text or token ids), any checkpoint."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..generation.scoring import text_offsets
from .body import JSONRoute
from .errors import ERROR_RESPONSES, bad
from .prompts import check_context, encode_prompt
from .protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       Usage)
from .generation import Settings, prompt_items, settings_of
from .state import AppState, app_state
from .streaming import Echo, respond, streamed

router = APIRouter(route_class=JSONRoute, tags=["completions"])


def logprobs_of(items: list[dict], offset: int = 0) -> CompletionLogprobs:
    """The scheduler's logprob items in the completions API's shape (``text_offset`` from ``offset``)."""
    offsets = text_offsets(items, offset)  # in characters of the text, however its bytes were tokenized
    return CompletionLogprobs(tokens=[it["token"] for it in items], token_logprobs=[it["logprob"] for it in items],
                              top_logprobs=[None if it["top_logprobs"] is None else
                                            {t["token"]: t["logprob"] for t in it["top_logprobs"]} for it in items],
                              text_offset=offsets)


class Completions:
    """The completions family of the streaming adapter."""

    id_prefix = "cmpl-"

    def response(self, head: dict, texts, finish, logprobs, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**head, usage=usage, choices=[
            CompletionChoice(index=i, text=text, finish_reason=finish[i],
                             logprobs=None if logprobs is None else logprobs_of(logprobs[i]))
            for i, text in enumerate(texts)])

    def chunk(self, head: dict, choices, usage) -> CompletionChunk:
        return CompletionChunk(**head, choices=choices, usage=usage)

    def opening(self, index: int) -> CompletionChoice:
        return CompletionChoice(index=index, text="")

    def delta(self, index: int, text: str, logprobs, offset: int) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=None if logprobs is None else
                                logprobs_of(logprobs, offset))

    def finish(self, index: int, reason: str) -> CompletionChoice:
        return CompletionChoice(index=index, text="", finish_reason=reason)


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**ERROR_RESPONSES, 200: streamed(CompletionChunk)})
async def create_completion(body: CompletionRequest, request: Request, state: AppState = Depends(app_state)):
    """The text ``decoderlab.generate`` gives for the prompt with the same settings and the tokenizer
    (``<PAD>`` never sampled, ``<EOS>`` ends the text). With ``echo`` the answer starts with the prompt (and its
    tokens' logprobs, with ``logprobs``); ``max_tokens`` 0 then scores the prompt without generating."""
    state.check_model(body.model)
    settings = settings_of(body, state.limits)
    prompts = body.prompts()
    if len(prompts) > state.limits.max_queue:
        raise bad("prompt", f"the batch has {len(prompts)} prompts; this server takes at most "
                            f"{state.limits.max_queue} (its queue)")
    param = "prompt" if len(prompts) == 1 else "prompt[{}]"
    add = body.add_special_tokens is not False  # vLLM's default: a text prompt gets its start token
    ids = [check_context(state, encode_prompt(state, p, param.format(k), add_special_tokens=add), param.format(k))
           for k, p in enumerate(prompts)]
    echoes = [await echo_of(state, settings, x) for x in ids] if settings.echo else None
    return await respond(request, state, Completions(), settings, ids, [], stream=bool(body.stream),
                         include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         echoes=echoes)


async def echo_of(state: AppState, settings: Settings, ids: list[int]) -> Echo:
    """The prompt as an echo answer starts: its text, and with logprobs its tokens' logprobs (one forward pass on
    the model's thread, ``decoderlab.generation.scoring``)."""
    items = await prompt_items(state, ids, settings.logprobs) if settings.logprobs is not None else []
    return Echo(text=state.text_of(ids), items=items, tokens=len(ids))
