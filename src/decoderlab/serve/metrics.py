"""``GET /metrics``: the server's counters in Prometheus's text format, through ``prometheus-client`` (one
registry per app, so that several apps in one process -- tests, notebooks -- count apart).

Series (all prefixed ``decoderlab_``): ``requests_total{endpoint, status}`` (every answered request),
``prompt_tokens_total`` and ``completion_tokens_total`` (generation requests), ``queue_length`` (requests
waiting to join the batch) and ``running_rows`` (rows being decoded), read from the scheduler when scraped,
``time_to_first_token_seconds`` (from the request's settings checked to its first text) and
``time_per_output_token_seconds`` (the mean gap between a choice's tokens after the first) histograms.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

#: the endpoints counted by name; any other path is "other" (so a scan of random paths adds no series)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
             "/v1/decoderlab/trace", "/health", "/metrics")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The app's instruments (a ``prometheus_client.CollectorRegistry`` of its own)."""

    def __init__(self, stats):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("decoderlab_requests", "answered HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("decoderlab_prompt_tokens", "prompt tokens of generation requests", registry=r)
        self.completion_tokens = Counter("decoderlab_completion_tokens", "generated tokens", registry=r)
        Gauge("decoderlab_queue_length", "requests waiting to join the batch",
              registry=r).set_function(lambda: stats().get("waiting", 0))
        Gauge("decoderlab_running_rows", "rows (choices) being decoded",
              registry=r).set_function(lambda: stats().get("running", 0))
        self.ttft = Histogram("decoderlab_time_to_first_token_seconds", "request checked to its first text",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("decoderlab_time_per_output_token_seconds",
                              "mean gap between a choice's tokens after the first", buckets=_LATENCY_BUCKETS,
                              registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Timing:
    """One generation request's clock: :meth:`text` at each text delta of a choice, :meth:`done` with the usage;
    observes time to first token and time per output token."""

    def __init__(self, metrics: Metrics | None):
        self.metrics, self.start = metrics, time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, tuple[float, float]] = {}  # choice -> (its first text, its last text)

    def text(self, index: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            if self.metrics is not None:
                self.metrics.ttft.observe(now - self.start)
        first, _ = self.last.get(index, (now, now))
        self.last[index] = (first, now)

    def done(self, usage: dict) -> None:
        if self.metrics is None:
            return
        self.metrics.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        out = usage.get("completion_tokens", 0)
        self.metrics.completion_tokens.inc(out)
        choices = max(1, len(self.last))
        spans = [last - first for first, last in self.last.values()]
        per_choice = out / choices
        if spans and per_choice > 1:
            self.metrics.tpot.observe(sum(spans) / len(spans) / (per_choice - 1))


class CountRequests:
    """ASGI middleware: every answered HTTP request counted by endpoint and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS or path.startswith("/v1/models") else "other"
        endpoint = "/v1/models" if endpoint.startswith("/v1/models") else endpoint

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus's text format"}})
async def metrics(request: Request) -> Response:
    """The counters and histograms of the module docstring (behind the API key, like the data endpoints)."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)
