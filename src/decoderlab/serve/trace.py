"""``POST /v1/decoderlab/trace``: the glass-box numbers of ``decoderlab.trace`` for the page.

What is traced: a ``prompt`` (text or ids) and an optional ``continuation`` (generated text, encoded on its
own, as it was produced after the prompt's tokens), ``messages`` (a last assistant message is a reply: rendered
without a generation prompt), or ``token_ids``. The prompt must fit the context as for ``/v1/completions``
(else the same 400 ``context_length_exceeded``); only a continuation or a reply -- text the model generated
while its window slid -- may pass ``max_len``, and then the last ``max_len`` tokens are traced, the window the
model saw.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter, Depends

from ..glassbox import trace
from .body import JSONRoute
from .errors import ERROR_RESPONSES, bad
from .generation import Settings, described, next_token, settings_of
from .prompts import check_context, encode_prompt, need_template, render_messages
from .protocol import TraceRequest, TraceResponse
from .state import AppState, app_state

router = APIRouter(route_class=JSONRoute, tags=["glass box"])


def _continued(state: AppState, ids: list[int], continuation: str | None) -> list[int]:
    if not continuation:
        return ids
    try:
        more = list(state.tokenizer.encode(continuation))
    except (KeyError, ValueError) as e:
        raise bad("continuation", f"the continuation cannot be encoded: {e}", "invalid_prompt") from None
    return (ids + more)[-state.max_len:]


def traced_ids(state: AppState, body: TraceRequest) -> list[int]:
    """The token ids to trace (see the module docstring)."""
    if body.token_ids is not None:
        return check_context(state, encode_prompt(state, body.token_ids, "token_ids"), "token_ids")
    if body.messages is not None:
        need_template(state, "trace a prompt instead")
        reply = body.messages[-1].role == "assistant"
        asked = render_messages(state, body.messages[:-1]) if reply and len(body.messages) > 1 else None
        ids = render_messages(state, body.messages, add_generation_prompt=not reply)
        check_context(state, asked if asked is not None else ids, "messages")
        return ids[-state.max_len:]
    ids = check_context(state, encode_prompt(state, body.prompt), "prompt")
    return _continued(state, ids, body.continuation)


def trace_numbers(model, tokenizer, ids: list[int], settings: Settings, top: int,
                  layers: list[int] | None) -> TraceResponse:
    """The page's numbers for ``ids``: ``decoderlab.trace``'s attention percents per layer and head (queries
    down, keys across; masked cells 0 and listed in ``mask``) and the last position's top next-token
    probabilities before (softmax of the logits) and after the sampling filter, plus the token the filter's
    distribution gives next (:func:`decoderlab.serve.generation.next_token`)."""
    tr = trace(model, ids, tokenizer, layers=layers)
    # the page's numbers and its draw (a CPU generator) on the CPU, wherever the model runs
    logits = tr.logits[0, -1].float().cpu()
    after, nxt = next_token(settings, tokenizer, logits, len(ids))

    def top_list(dist: torch.Tensor) -> list[dict]:
        vals, idx = torch.topk(dist, min(top, dist.numel()))
        return [{"id": int(i), "token": tokenizer.decode([int(i)]), "prob": float(v)}
                for v, i in zip(vals.tolist(), idx.tolist())]

    t, mask = len(ids), tr.layers[0].mask if tr.layers else None
    return TraceResponse(
        token_ids=ids, tokens=[tokenizer.decode([i]) for i in ids], n_layer=model.config.n_layer,
        n_head=model.config.n_head, mask=None if mask is None else mask.reshape(t, t).tolist(),
        layers=[{"layer": lt.index, "heads": lt.heads, "percents": lt.percents[0].tolist()} for lt in tr.layers],
        top_before=top_list(torch.softmax(logits, dim=-1)), top_after=top_list(after),
        next={"id": nxt, "token": tokenizer.decode([nxt])},
        sampling=described(settings))


@router.post("/v1/decoderlab/trace", response_model=TraceResponse, responses=ERROR_RESPONSES)
async def trace_endpoint(body: TraceRequest, state: AppState = Depends(app_state)) -> TraceResponse:
    """The glass box of the traced tokens, computed on the scheduler's thread between two decode steps."""
    state.check_model(body.model)
    settings = settings_of(body, state.limits)
    ids = traced_ids(state, body)
    n_layer = state.model.config.n_layer
    if body.layers is not None and not all(0 <= i < n_layer for i in body.layers):
        raise bad("layers", f"layers must be a list of layer indices 0 .. {n_layer - 1}")
    fut = state.scheduler().call(lambda: trace_numbers(state.model, state.tokenizer, ids, settings, body.top,
                                                       body.layers))
    return await asyncio.wrap_future(fut)
