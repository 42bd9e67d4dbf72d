"""Limits and defaults of serving and generation, as plain data (no torch, no FastAPI): the server, the
command line's ``--help`` and the engine read them from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: new tokens a generation asks for when the caller gives no number (``generate``, ``chat``, the CLI)
DEFAULT_MAX_NEW_TOKENS = 200


@dataclass
class ServeLimits:
    """Request limits of ``decoderlab serve``; each violation is a 400 that names the limit.

    max_body_bytes: largest request body, in bytes. max_messages: most chat messages. max_tokens: most tokens
    one choice may ask for (more than max_len is fine: the context window slides as in ``generate``). max_n:
    most choices per request. max_stop: most stop strings (OpenAI's 4). max_batch: rows (choices) decoded
    together. max_queue: requests waiting to join the batch (then 429). default_max_tokens: used when a request
    gives neither max_tokens nor max_completion_tokens.
    """

    max_body_bytes: int = 1_000_000
    max_messages: int = 256
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_n: int = 8
    max_stop: int = 4
    max_batch: int = 32
    max_queue: int = 64


#: what each limit a command-line flag sets means (``decoderlab serve --max-tokens ...``)
SERVE_LIMIT_HELP = {
    "max_tokens": "most tokens one choice may ask for",
    "max_body_bytes": "largest request body in bytes",
    "max_messages": "most chat messages in a request",
    "max_n": "most choices per request",
    "max_batch": "most rows (choices) decoded together",
    "max_queue": "most requests waiting to join the batch before the server answers 429",
}

#: the defaults of the limits that have a flag
SERVE_LIMIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeLimits) if f.name in SERVE_LIMIT_HELP}
