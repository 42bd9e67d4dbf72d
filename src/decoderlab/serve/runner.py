"""Running the app: :func:`serve` (``decoderlab serve``) and :class:`ServerThread` (tests, benchmarks,
notebooks). Both log ``decoderlab.serve``'s lines (a client that hung up, a failed request) with uvicorn's."""

from __future__ import annotations

import copy
import errno
import socket
import sys
import threading
import time
from pathlib import Path

from ..chat import load_model
from ..config.limits import ServeLimits
from .app import create_app


def log_config(log_level: str) -> dict:
    """uvicorn's logging configuration with the ``decoderlab.serve`` logger on its handler and level."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["decoderlab.serve"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": True}
    return cfg


class ServerThread:
    """Run an app with uvicorn on a background thread.

    ``with ServerThread(app, port=0) as url: ...``: port 0 picks a free port; ``url`` is ``http://host:port``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    log_config=log_config(log_level), lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (uvicorn listens on it), so that a host that is not this machine's
    or a busy port is an error in decoderlab's words before anything is loaded.

    Raises:
        ValueError: ``host`` is not a name or address that resolves.
        OSError: the address cannot be bound (the port is in use, a port below 1024 without the right, an
            address of another machine), naming ``host:port``.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = " (another server is using it: choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def serve(checkpoint, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          cors_origins: list[str] | None = None, limits: ServeLimits | None = None, model_id: str | None = None,
          log_level: str = "info", device=None, dtype=None, compile: bool = False, sae=None,
          threads: int | None = None) -> None:
    """Load a checkpoint directory (or a Hugging Face directory, or a GGUF file) and serve it with uvicorn until
    interrupted (``decoderlab serve``), on ``device`` (``decoderlab.devices.resolve_device``'s names; None:
    the CPU), its weights in ``dtype`` (:mod:`decoderlab.dtypes`: None = as stored; ``"q8_0"`` ... GGUF's blocks),
    decoding with a compiled step if ``compile`` (``model.compile_decode``: ``decoderlab serve`` compiles unless
    ``--eager``); ``sae``: an SAE directory
    whose features the page shows (``/v1/decoderlab/features``). ``limits.prefill_chunk`` turns on the
    scheduler's chunked prefill (:class:`decoderlab.config.ServeLimits`).

    ``threads``: PyTorch intra-op threads for the scheduler's forward passes (``torch.set_num_threads``, which
    the scheduler's thread inherits); None chooses them as every command does
    (:func:`decoderlab.threads.choose_threads`: the cores the 1-minute load average leaves idle, at most 2).

    Raises: what :func:`listen` raises for a bad ``host`` / ``port`` (checked first); ``ValueError`` for
    ``threads`` < 1 or a ``limits.prefill_chunk`` < 1; what :func:`decoderlab.chat.load_model` raises
    (FileNotFoundError, ValueError) for a bad checkpoint.
    """
    import uvicorn

    from ..threads import set_threads

    set_threads(threads)  # (a bad value: one error before the port is bound)
    sock = listen(host, port)
    try:
        # the one loader: a decoderlab or Hugging Face directory, a GGUF file
        model, tokenizer, template, meta = load_model(checkpoint, device="cpu" if device is None else device,
                                                      dtype=dtype)
        if compile:
            model.compile_decode()
        if model_id is None and not meta.get("name"):
            model_id = Path(checkpoint).resolve().name
        app = create_app(model, tokenizer, meta=meta, template=template, model_id=model_id, api_key=api_key,
                         cors_origins=cors_origins, limits=limits, run_dir=checkpoint, sae=sae)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config(log_level))
        # uvicorn names no address when it is handed a socket: say where the page and the API are (stderr,
        # beside uvicorn's own lines; stdout may be a closed pipe)
        url = f"http://{host}:{sock.getsockname()[1]}"
        print(f"decoderlab: serving {app.state.decoderlab.model_id} on {url} (the page at {url}/, the API at {url}/v1)",
              file=sys.stderr, flush=True)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
