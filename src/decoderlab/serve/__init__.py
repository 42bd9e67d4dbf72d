"""An OpenAI-compatible HTTP server for a decoderlab model, and the live glass-box page.

``create_app(model, tokenizer, ...)`` returns a FastAPI app; ``serve(checkpoint, ...)`` runs it with uvicorn
(``decoderlab serve --checkpoint DIR``). Generation runs on the
:class:`decoderlab.generation.scheduler.Scheduler`'s thread (continuous batching), never on the event loop.

Endpoints (each documented in ``/openapi.json`` and ``/docs``):
    GET  /health                  {"status": "ok", ...}; never needs the API key.
    GET  /v1/models               the model: id, max_len, vocab_size, parameters, chat_template.
    GET  /v1/models/{id}          one model (404 for another id).
    POST /v1/completions          any checkpoint: ``prompt`` (text, or token ids).
    POST /v1/chat/completions     chat checkpoints: ``messages`` rendered with the checkpoint's chat template.
    POST /v1/decoderlab/trace     glass-box numbers of ``decoderlab.trace`` for the page.
    GET  /                        the page (one self-contained HTML file, nothing fetched elsewhere).

The package, one job per module: ``protocol`` (pydantic models of every request, response, chunk and error;
the fields accepted, ignored and refused), ``app`` (``create_app``), ``state`` (what the endpoints share),
``body`` (reading a body: size limit, hang-ups, strict JSON), ``errors`` (OpenAI's error shape), ``middleware``
(API key, CORS), ``prompts`` (prompt and messages to ids), ``generation`` (the one door to the engine: fields
-> sampling settings -> the scheduler), ``streaming`` (the one adapter from the scheduler's events to JSON or
SSE), one module per endpoint family (``completions``, ``chat_completions``, ``models``, ``trace``, ``page``)
and ``runner`` (``serve``, ``ServerThread``).

Each choice is the text ``decoderlab.generate`` gives with the same settings and the tokenizer: ``<PAD>`` is
never sampled and ``<EOS>`` (and a chat template's end of turn) ends it. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (see :mod:`decoderlab.serve.errors`).
"""

from ..config.limits import ServeLimits
from .app import create_app
from .runner import ServerThread, serve

#: request limits (one definition, in the config floor, which ``decoderlab serve --help`` reads too)
Limits = ServeLimits

__all__ = ["create_app", "serve", "ServerThread", "Limits"]
