"""The app's state: what every endpoint reads (the model, its tokenizer and chat template, the limits, the
model id) and the scheduler that owns the model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..config.limits import ServeLimits
from ..generation.checks import check_int
from ..generation.scheduler import Scheduler
from ..generation.stops import text_decoder
from .errors import APIError

from ..chat import template_from_meta, tools_template


@dataclass
class AppState:
    """One served model.

    Attributes:
        model, tokenizer: the model (owned by the scheduler's thread once it runs) and its tokenizer.
        template: the chat template (``render(messages, tokenizer, add_generation_prompt=...)`` -> (ids,
            mask), ``end_of_turn_id(tokenizer)``, ``name``); None for a base model.
        limits: the request limits (:class:`decoderlab.config.ServeLimits`).
        model_id: the id clients name.
        meta: the checkpoint's meta.json.
        created: when the app was built (Unix seconds; the model card's ``created``).
    """

    model: Any
    tokenizer: Any
    template: Any
    limits: ServeLimits
    model_id: str
    meta: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None  # the app's serve.metrics.Metrics (set by create_app)
    _scheduler: Scheduler | None = None
    _decode: Any = None

    @classmethod
    def build(cls, model, tokenizer, *, meta: dict | None, template: Any, model_id: str | None,
              limits: ServeLimits | None) -> AppState:
        """``template="auto"`` takes the template from ``meta``; ``model_id`` defaults to meta's "name", else
        "decoderlab". Raises ``ValueError`` / ``TypeError`` for a ``limits.prefill_chunk`` that is not None or an
        integer >= 1."""
        meta = dict(meta or {})
        limits = limits or ServeLimits()
        if limits.prefill_chunk is not None:  # (the scheduler starts with the app: say it now, not at start-up)
            check_int("prefill_chunk", limits.prefill_chunk, 1)
        if template == "auto":
            template = template_from_meta(meta)
        return cls(model, tokenizer, template, limits,
                   model_id or str(meta.get("name") or "decoderlab"), meta)

    def chat_template(self, tools: bool = False):
        """The template a request's messages are rendered with: ``template``; with ``tools`` (offered, or calls
        and results in the messages) the one that writes them for it (:func:`decoderlab.chat.tools_template`:
        SmolLM2-Instruct's ChatML is served with chatml-tools, the same text without tools)."""
        return tools_template(self.template) if tools else self.template

    @property
    def max_len(self) -> int:
        return self.model.config.max_len

    def scheduler(self) -> Scheduler:
        """The scheduler (started on first use: with the app's lifespan)."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self.model, self.tokenizer, max_batch=self.limits.max_batch,
                                        max_queue=self.limits.max_queue, prefill_chunk=self.limits.prefill_chunk)
        return self._scheduler

    def text_of(self, ids: list[int]) -> str:
        """Token ids as text, as generation writes it (control tokens are not text)."""
        return self.decode(ids)

    @property
    def decode(self):
        if self._decode is None:
            self._decode = text_decoder(self.tokenizer)
        return self._decode

    def stats(self) -> dict:
        return self._scheduler.stats() if self._scheduler is not None else {}

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()

    def check_model(self, name: str | None) -> None:
        """A request's ``model``: None or this server's id; another id is a 404."""
        if name is not None and name != self.model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def app_state(request: Request) -> AppState:
    """The endpoint dependency: the state of the app that received ``request``."""
    return request.app.state.decoderlab
