"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes, so that clients
count tokens, and evaluation harnesses tokenize, exactly as this server does (lm-evaluation-harness's
``local-completions`` finds them and uses the server's tokenizer: no tokenizer files on the client)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .body import JSONRoute
from .errors import ERROR_RESPONSES, bad
from .prompts import encode_prompt, need_template, render_messages
from .protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo)
from .state import AppState, app_state
from .tools import check_tools

router = APIRouter(route_class=JSONRoute, tags=["tokens"])


def pieces(tok, ids: list[int]) -> list[str]:
    """Each token's text (``Tokenizer.tokens``: a control token's name, partial UTF-8 as \\xNN)."""
    if hasattr(tok, "tokens"):
        return list(tok.tokens(ids))
    return [tok.decode([i]) for i in ids]


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: AppState = Depends(app_state)) -> TokenizeResponse:
    """The ids (and pieces) of a prompt, as ``/v1/completions`` encodes it (with the start token unless
    ``add_special_tokens`` is false), or of messages, as chat renders them (the template writes its own)."""
    state.check_model(body.model)
    if body.messages is not None:
        need_template(state, "tokenize a prompt instead")
        check_tools(state, body.tools)
        ids = render_messages(state, body.messages, add_generation_prompt=body.add_generation_prompt is not False,
                              tools=body.tools)
    else:
        ids = encode_prompt(state, body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_len, tokens=ids,
                            token_strs=pieces(state.tokenizer, ids))


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: AppState = Depends(app_state)) -> DetokenizeResponse:
    """The text of token ids, as generation writes it."""
    state.check_model(body.model)
    v = state.model.config.num_tokens
    for i, t in enumerate(body.tokens):
        if not 0 <= t < v:
            raise bad(f"tokens[{i}]", f"token id {t} is out of range; allowed ids are 0 .. {v - 1}")
    return DetokenizeResponse(prompt=state.text_of(list(body.tokens)))


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses={401: ERROR_RESPONSES[401]})
async def tokenizer_info(state: AppState = Depends(app_state)) -> TokenizerInfo:
    tok = state.tokenizer
    names = getattr(tok, "id_to_token", {})
    eos, pad, bos = (getattr(tok, f"{k}_id", None) for k in ("eos", "pad", "bos"))
    return TokenizerInfo(tokenizer_class=type(tok).__name__, vocab_size=state.model.config.num_tokens,
                         model_max_length=state.max_len, eos_token=names.get(eos) if eos is not None else None,
                         bos_token=names.get(bos) if bos is not None else None,
                         pad_token=names.get(pad) if pad is not None else None)
