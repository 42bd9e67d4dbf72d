"""``POST /v1/decoderlab/trace``: the glass-box numbers of ``decoderlab.trace`` for the page, and what the
glass box reads from the same pass (``serve/glass.py``): the logit lens and the decomposition of a logit at a
position, the head detectors' scores, and the next-token distribution with chosen heads ablated.

What is traced: a ``prompt`` (text or ids) and an optional ``continuation`` (generated text, encoded on its
own, as it was produced after the prompt's tokens), ``messages`` (rendered with the generation prompt; an
optional ``continuation`` is the reply so far; a last assistant message instead is a finished reply: rendered
with its end of turn, so the trace has ``ended``), or ``token_ids``. The prompt must fit the context as for
``/v1/completions`` (else the same 400 ``context_length_exceeded``); only a continuation or a reply -- text the
model generated while its window slid -- may pass ``max_len``, and then the last ``max_len`` tokens are
traced, the window the model saw.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter, Depends

from ..generation.stops import end_of_text_ids
from ..glassbox import run_with_cache, trace_from_cache
from ..glassbox.trace import trace_names
from .body import JSONRoute
from .errors import ERROR_RESPONSES, bad
from .generation import Settings, described, next_token, settings_of
from .glass import ablation_part, decomposition_part, glass_names, lens_part, scores_part, top_probs
from .prompts import check_context, encode_prompt, need_template, render_messages
from .trace_protocol import TraceNext, TraceRequest, TraceResponse
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


def ends_turn(body: TraceRequest) -> bool:
    """Messages ending with an assistant reply (no continuation): rendered with the end of turn, finished."""
    return body.messages is not None and body.messages[-1].role == "assistant" and body.continuation is None


def traced_ids(state: AppState, body: TraceRequest) -> list[int]:
    """The token ids to trace (see the module docstring)."""
    if body.token_ids is not None:
        return check_context(state, encode_prompt(state, body.token_ids, "token_ids"), "token_ids")
    if body.messages is not None:
        need_template(state, "trace a prompt instead")
        if not ends_turn(body):
            ids = check_context(state, render_messages(state, body.messages), "messages")
            return _continued(state, ids, body.continuation)
        asked = render_messages(state, body.messages[:-1]) if len(body.messages) > 1 else None
        ids = render_messages(state, body.messages, add_generation_prompt=False)
        check_context(state, asked if asked is not None else ids, "messages")
        return ids[-state.max_len:]
    ids = check_context(state, encode_prompt(state, body.prompt), "prompt")
    return _continued(state, ids, body.continuation)


def check_glass_fields(state: AppState, body: TraceRequest, t: int) -> int:
    """The layers, the position (returned as 0 .. t - 1), the token and the ablated heads of ``body``, each
    checked against the model and the ``t`` traced tokens (a 400 naming the field and the valid range)."""
    cfg = state.model.config
    if body.layers is not None and not all(0 <= i < cfg.n_layer for i in body.layers):
        raise bad("layers", f"layers must be a list of layer indices 0 .. {cfg.n_layer - 1}")
    position = -1 if body.position is None else body.position
    if not -t <= position < t:
        raise bad("position", f"position {position} is outside the {t} traced tokens; valid positions are "
                              f"0 .. {t - 1} (or -{t} .. -1 from the end)")
    if body.token is not None and body.token >= cfg.num_tokens:
        raise bad("token", f"token {body.token} is outside the vocabulary; valid ids are 0 .. {cfg.num_tokens - 1}")
    for i, h in enumerate(body.ablate or []):
        if h.layer >= cfg.n_layer or h.head >= cfg.n_head:
            raise bad(f"ablate[{i}]", f"there is no head L{h.layer}H{h.head}: layers are 0 .. {cfg.n_layer - 1}, "
                                      f"heads 0 .. {cfg.n_head - 1}")
    return position % t


def trace_numbers(model, tokenizer, ids: list[int], settings: Settings, body: TraceRequest, position: int,
                  ended: bool = False) -> TraceResponse:
    """The page's numbers for ``ids``, from one ``run_with_cache`` pass: ``decoderlab.trace``'s attention
    percents per layer and head (queries down, keys across; masked cells 0 and listed in ``mask``), the last
    position's top next-token probabilities before (softmax of the logits) and after the sampling filter and
    the token the filter's distribution gives next (:func:`decoderlab.serve.generation.next_token`), the logit
    lens and the decomposition at ``position``, and as asked the head scores and an ablation."""
    layers = sorted(set(body.layers)) if body.layers is not None else list(range(model.config.n_layer))
    names = trace_names(model, layers) + glass_names(model, body.scores == "text")
    _, cache = run_with_cache(model, ids, names_filter=list(dict.fromkeys(names)))
    tr = trace_from_cache(cache, layers)
    # the page's numbers and its draw (a CPU generator) on the CPU, wherever the model runs
    logits = tr.logits[0, -1].float().cpu()
    after, nxt = next_token(settings, tokenizer, logits, len(ids))
    t, mask = len(ids), tr.layers[0].mask if tr.layers else None
    return TraceResponse(
        token_ids=ids, tokens=[tokenizer.decode([i]) for i in ids], n_layer=model.config.n_layer,
        n_head=model.config.n_head, mask=None if mask is None else mask.reshape(t, t).tolist(),
        layers=[{"layer": lt.index, "heads": lt.heads, "percents": lt.percents[0].tolist()} for lt in tr.layers],
        top_before=top_probs(tokenizer, torch.softmax(logits, dim=-1), body.top),
        top_after=top_probs(tokenizer, after, body.top),
        next=TraceNext(id=nxt, token=tokenizer.decode([nxt]), ends_text=nxt in end_of_text_ids(tokenizer)),
        ended=ended, sampling=described(settings), position=position,
        lens=lens_part(cache, tokenizer, position),
        decomposition=decomposition_part(cache, tokenizer, position, body.token),
        head_scores=scores_part(model, cache, body.scores),
        ablation=None if not body.ablate else ablation_part(model, tokenizer, ids, logits, body.ablate, body.top))


@router.post("/v1/decoderlab/trace", response_model=TraceResponse, responses=ERROR_RESPONSES)
async def trace_endpoint(body: TraceRequest, state: AppState = Depends(app_state)) -> TraceResponse:
    """The glass box of the traced tokens, computed on the scheduler's thread between two decode steps."""
    state.check_model(body.model)
    settings = settings_of(body, state.limits)
    ids = traced_ids(state, body)
    position = check_glass_fields(state, body, len(ids))
    fut = state.scheduler().call(lambda: trace_numbers(state.model, state.tokenizer, ids, settings, body, position,
                                                       ends_turn(body)))
    return await asyncio.wrap_future(fut)
