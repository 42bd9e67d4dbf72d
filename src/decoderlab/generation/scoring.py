"""Scoring text instead of generating it: each token's log-probability given the tokens before it, from one
forward pass -- what evaluation harnesses ask for (the log-likelihood of a continuation after a context, as
lm-evaluation-harness's ``loglikelihood``), and what the server's ``echo`` + ``logprobs`` returns for a prompt."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Sequence

import torch

from .engine import _EvalMode, check_prompt, model_device


@dataclass
class TokenScores:
    """The scores of T tokens (T - 1 of them predicted: the first has nothing before it).

    Attributes:
        ids: the T token ids.
        logprobs: (T - 1,) float32, nats: ``log p(ids[t] | ids[:t])`` for t = 1 .. T-1.
        top_ids, top_logprobs: (T - 1, k) the k most probable tokens at each of those positions and their
            logprobs (k = the ``top`` asked for; 0 columns when 0).
    """

    ids: list[int]
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@torch.inference_mode()
def score_tokens(model, ids: Sequence[int], *, top: int = 0, tokenizer=None) -> TokenScores:
    """Each token's log-probability after the ones before it, in one forward pass over ``ids`` (the
    model's own causal pass: position t sees tokens 0 .. t), as float32 log-softmax of the logits.

    Args:
        model: a ``DecoderOnlyTransformer`` (put in eval mode for the call, its flag restored).
        ids: 1 .. max_len token ids (or text with ``tokenizer``).
        top: also the ``top`` most probable tokens at each position (0 .. vocabulary size).

    Raises: ``ValueError`` for more than max_len tokens (a window would have to slide: score each window
    yourself), an empty prompt without a start token, ids out of range; ``TypeError`` as ``generate``.
    """
    ids = check_prompt(model, ids, tokenizer, name="ids")
    max_len, v = model.config.max_len, model.config.num_tokens
    if len(ids) > max_len:
        raise ValueError(f"ids has {len(ids)} tokens; scoring takes at most max_len={max_len} (one window)")
    if not (isinstance(top, int) and 0 <= top <= v):
        raise ValueError(f"top must be an integer in 0 .. {v}, got {top!r}")
    with _EvalMode(model):
        logits = model(torch.tensor([ids], dtype=torch.long, device=model_device(model)))[0, :-1]
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T - 1, V)
    target = torch.tensor(ids[1:], dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    vals, idx = torch.topk(lp, top, dim=-1) if top else (lp[:, :0], torch.zeros_like(lp[:, :0], dtype=torch.long))
    return TokenScores(ids, chosen.cpu(), idx.cpu(), vals.cpu())


def loglikelihood(model, context: Sequence[int], continuation: Sequence[int]) -> tuple[float, bool]:
    """(the log-likelihood of ``continuation`` after ``context``, in nats; whether it is the greedy
    continuation) -- lm-evaluation-harness's ``loglikelihood`` for one request, from one forward pass over
    ``context + continuation`` (at most max_len tokens; ``context`` at least one token).

    Raises: ``ValueError`` for an empty context or continuation; what :func:`score_tokens` raises."""
    context, continuation = list(context), list(continuation)
    if not context or not continuation:
        raise ValueError("loglikelihood needs a non-empty context and continuation")
    s = score_tokens(model, context + continuation, top=1)
    cont = slice(len(context) - 1, None)
    lps = s.logprobs[cont]
    greedy = bool((s.top_ids[cont, 0] == torch.tensor(continuation)).all())
    return sum(lps.tolist()), greedy  # summed in order in Python floats, as the harness sums the JSON numbers


def logprob_token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """``(token string, its bytes)`` of one token in a logprobs answer, as OpenAI and vLLM write them: the
    token's text, or for a token that is part of a UTF-8 character (a byte-level BPE piece) ``"bytes:\\xNN..."``
    so that different byte tokens never share a string; the bytes are the token's own (``token_bytes``), so a
    client joins them back into the text's UTF-8."""
    raw = tokenizer.token_bytes(token_id) if hasattr(tokenizer, "token_bytes") else None
    if raw is not None:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
    s = tokenizer.decode([token_id])
    return s, list(s.encode("utf-8"))


def text_offsets(items: Sequence[dict], start: int = 0) -> list[int]:
    """Where each logprob item's token starts in the decoded text, in characters from ``start``: the characters
    the bytes before it complete (a token inside a character starts at that character; bytes that are no
    UTF-8 count as one U+FFFD each, as the text writes them)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, chars = [], start
    for it in items:
        out.append(chars)
        raw = bytes(it["bytes"]) if it.get("bytes") is not None else it["token"].encode("utf-8")
        chars += len(decoder.decode(raw))
    return out
