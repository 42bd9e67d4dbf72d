"""Held-out metrics of a chat model and the rows it trains on: conversations rendered and shifted once
(:func:`build_examples`), the padding id, teacher-forced loss, bits per byte, token accuracy, and greedy
replies' end-of-turn rate and exact match (:func:`evaluate_chat`), in one line for the terminal."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..chat import ChatTemplate, fit_messages, stream_chat_reply
from ..checkpoint import unwrap_model
from ..tokenizers import Tokenizer
from ..training.sft import IGNORE_INDEX, Examples, collate, masked_ce_sum, shift_for_training


def build_examples(conversations: Sequence, tokenizer: Tokenizer, template: ChatTemplate,
                   max_len: int) -> Examples:
    """Render every conversation with ``template`` and shift it (:func:`shift_for_training`)."""
    eot = template.end_of_turn_id(tokenizer)
    specials = {tokenizer.token_to_id[t] for t in template.special_tokens if t in tokenizer.token_to_id}
    rows, kept, truncated, dropped, nbytes = [], [], 0, 0, 0
    for i, conv in enumerate(conversations):
        ids, mask = template.render(conv, tokenizer)
        if len(ids) > max_len + 1:
            truncated += 1
        x, y = shift_for_training(ids, mask, max_len)
        if all(t == IGNORE_INDEX for t in y):
            dropped += 1
            continue
        rows.append((x, y))
        kept.append(i)
        nbytes += sum(len(tokenizer.token_bytes(t)) for t in y if t != IGNORE_INDEX and t != eot
                      and t not in specials)
    return Examples(rows, kept, truncated, dropped, nbytes)


def pad_id_for(tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """The padding id: ``<PAD>`` when the tokenizer has one, else 0 -- never the end-of-turn id (its label is
    -100 anyway, but the input must not read as an end of turn)."""
    eot = template.end_of_turn_id(tokenizer)
    pad = tokenizer.pad_id
    if pad is None or pad == eot:
        pad = next(i for i in range(tokenizer.vocab_size) if i != eot)
    return pad


# ---------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_chat(model, tokenizer: Tokenizer, template: ChatTemplate, conversations: Sequence,
                  *, max_new_tokens: int = 64, max_prompts: int | None = 100, batch_size: int = 32) -> dict:
    """Held-out metrics of a chat model on ``conversations`` (each ending with an assistant turn).

    Teacher-forced over every conversation with a supervised token within max_len + 1 tokens (the others are
    counted as ``dropped``): ``loss`` (mean nats per supervised token: assistant content + end of turn),
    ``bpb`` (the summed loss / ln 2 / UTF-8 bytes of the supervised assistant text), ``token_accuracy``
    (argmax == target over supervised tokens). Greedy replies to the first ``max_prompts`` of those
    conversations' last user turn (with the history before it), through
    :func:`decoderlab.chat.stream_chat_reply`: ``end_of_turn_rate`` (share whose reply ends with the end of
    turn within ``max_new_tokens``) and ``exact_match`` (reply == reference after stripping whitespace). A
    measure of nothing (no supervised token; no prompt answered, e.g. ``max_prompts`` 0) is None, never NaN.
    Returns a dict of these plus the counts ``conversations`` (evaluated), ``dropped``, ``tokens``, ``prompts``.
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        ex = build_examples(conversations, tokenizer, template, model.config.max_len)
        ce_sum, count, correct = _teacher_forced(model, ex, pad_id_for(tokenizer, template), batch_size)
        kept = [conversations[i] for i in ex.conversations]
        prompts = kept if max_prompts is None else kept[:max_prompts]
        ended = exact = 0
        for conv in prompts:
            info: dict = {}
            reply = "".join(stream_chat_reply(model, tokenizer, conv[:-1], template, max_new_tokens=max_new_tokens,
                                              temperature=0.0, info=info))
            ended += bool(info["ended_with_end_of_turn"])
            exact += reply.strip() == (conv[-1].get("content") or "").strip()
    finally:
        model.train(was_training)
    return {
        "loss": ce_sum / count if count else None,
        "bpb": ce_sum / (math.log(2) * ex.bytes) if ex.bytes else None,
        "token_accuracy": correct / count if count else None,
        "end_of_turn_rate": ended / len(prompts) if prompts else None,
        "exact_match": exact / len(prompts) if prompts else None,
        "conversations": len(ex.rows), "dropped": ex.dropped, "tokens": count, "prompts": len(prompts),
    }


def check_eval_prompts(tokenizer: Tokenizer, template: ChatTemplate, conversations: Sequence, max_len: int,
                       max_prompts: int | None = 100) -> None:
    """Before training: each prompt :func:`evaluate_chat` will answer (the first ``max_prompts``
    conversations' history before their last reply) renders and fits ``max_len`` after the oldest exchanges
    are dropped (:func:`decoderlab.chat.fit_messages`), so that no data error waits for the end of the run.

    Raises:
        ValueError: naming the conversation (its index) and what is wrong with its prompt.
    """
    chosen = conversations if max_prompts is None else conversations[:max_prompts]
    for k, conv in enumerate(chosen):
        try:
            fit_messages(conv[:-1], tokenizer, template, max_len, 1)
        except ValueError as e:
            raise ValueError(f"evaluation prompt of conversation {k} (the history before its last reply): {e}") \
                from None


def _teacher_forced(model, ex: Examples, pad: int, batch_size: int) -> tuple[float, int, int]:
    """``(summed cross-entropy, supervised tokens, correct argmax predictions)`` over the rows of ``ex``."""
    ce_sum, count, correct = 0.0, 0, 0
    for i in range(0, len(ex.rows), batch_size):
        x, y = collate(ex.rows[i : i + batch_size], pad)
        logits = model(x)
        ce, n = masked_ce_sum(logits, y)
        ce_sum += float(ce)
        count += int(n)
        sel = y != IGNORE_INDEX
        correct += int((logits.argmax(-1)[sel] == y[sel]).sum())
    return ce_sum, count, correct


def format_evaluation(ev: dict, on: str = "held-out") -> str:
    """One line of the evaluation dict for the terminal (``on``: which conversations it is about); what was not
    measured says why instead of a NaN."""
    dropped = f", {ev['dropped']} dropped: no assistant token within max_len" if ev.get("dropped") else ""
    if ev["tokens"]:
        bpb = f"{ev['bpb']:.3f}" if ev.get("bpb") is not None else "n/a"
        scores = (f"loss {ev['loss']:.4f} nats/token, {bpb} bits per byte, token accuracy "
                  f"{ev['token_accuracy']:.1%}")
    else:
        scores = "no loss: no assistant token to score"
    if ev["prompts"]:
        replies = (f"greedy replies to {ev['prompts']} prompts: end of turn {ev['end_of_turn_rate']:.1%}, exact "
                   f"match {ev['exact_match']:.1%}")
    else:
        replies = "no greedy replies (" + ("eval_prompts 0)" if ev["conversations"] else "no conversation to answer)")
    return f"{on} ({ev['conversations']} conversations{dropped}, {ev['tokens']} assistant tokens): {scores}; {replies}"
