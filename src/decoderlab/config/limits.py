"""Limits of serving as a dataclass (no torch, no FastAPI): the server reads ``ServeLimits``; its defaults,
and those of generation, are plain data in :mod:`.defaults` (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass

from .defaults import DEFAULT_MAX_NEW_TOKENS, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, SERVE_LIMITS

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "SERVE_LIMIT_DEFAULTS", "SERVE_LIMIT_HELP", "ServeLimits"]

_D = SERVE_LIMITS


@dataclass
class ServeLimits:
    """Request limits of ``decoderlab serve``; each violation is a 400 that names the limit.

    max_body_bytes: largest request body, in bytes. max_messages: most chat messages. max_tokens: most tokens
    one choice may ask for (more than max_len is fine: the context window slides as in ``generate``). max_n:
    most choices per request. max_stop: most stop strings (OpenAI's 4). max_batch: rows (choices) decoded
    together. max_queue: requests waiting to join the batch (then 429). default_max_tokens: used when a request
    gives neither max_tokens nor max_completion_tokens. prefill_chunk: None (whole prompts, every newcomer of a
    step in one padded pass) or C >= 1 tokens: a longer prompt is read C tokens per decode step (the scheduler's
    chunked prefill, ``decoderlab.generation.scheduler.Scheduler``'s ``prefill_chunk``).
    """

    max_body_bytes: int = _D["max_body_bytes"]
    max_messages: int = _D["max_messages"]
    max_tokens: int = _D["max_tokens"]
    default_max_tokens: int = _D["default_max_tokens"]
    max_n: int = _D["max_n"]
    max_stop: int = _D["max_stop"]
    max_batch: int = _D["max_batch"]
    max_queue: int = _D["max_queue"]
    prefill_chunk: int | None = _D["prefill_chunk"]
