"""Running the app: :func:`serve` (``decoderlab serve``) and :class:`ServerThread` (tests, benchmarks,
notebooks). Both log ``decoderlab.serve``'s lines (a client that hung up, a failed request) with uvicorn's."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import socket
import sys
import threading
import time
from pathlib import Path

from ..chat import load_model
from ..config.limits import ServeLimits
from ..waiting import Heartbeat, MeasuredWaits, starting
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


#: connections the kernel queues before uvicorn accepts them (uvicorn's own default)
LISTEN_BACKLOG = 2048


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` and listening (uvicorn serves on it), so that a host that is not this
    machine's or a busy port is an error in decoderlab's words before anything is loaded.

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
        # listening from now: a client that connects once the address is said (a test that waits for that
        # line, a script) waits in the kernel's queue until uvicorn accepts it, instead of being refused
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        hint = " (another server is using it: choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def say(line: str) -> None:
    """One ``decoderlab:`` line on standard error (beside uvicorn's lines; standard output may be a closed pipe)."""
    print(f"decoderlab: {line}", file=sys.stderr, flush=True)


def compile_pays(model) -> bool:
    """``compile="auto"``: whether ``model`` has the parameters for a compiled step to pay for its compile
    (``decoderlab.config.COMPILE_PAYS_FROM``, why that many in its comment); a smaller one is said to decode
    eagerly (the lesson's 37-parameter model made its first client wait ~50 s for the compiler)."""
    from ..config.defaults import COMPILE_PAYS_FROM

    n = model.num_parameters()
    if n >= COMPILE_PAYS_FROM:
        return True
    say(f"decoding eagerly: {n:,} parameters decode a token in about a millisecond, too few for a compiled step to "
        f"pay for its compile (it pays from {COMPILE_PAYS_FROM:,}; --compile compiles anyway)")
    return False


def warm_up(scheduler, timeout: float = 3600, *, say=None, expected: float | None = None) -> float:
    """Run one short greedy request (a prompt of one token, four new tokens) through ``scheduler``, whose model
    decodes with a compiled step, so that the step's graph for one row -- its decode, the common first request's,
    one graph for every length of the timeline (the scheduler's compiled step takes the length as dynamic) -- is
    compiled before a client waits for it. While it runs, ``say`` (if given) gets a line every
    ``decoderlab.waiting.EVERY`` seconds with the time so far, and the time left of ``expected`` (seconds an
    earlier warm-up took on this machine; None: no time left is said). Returns the seconds it took.

    Raises: what the request raised (the scheduler's ``("error", e)`` event); ``TimeoutError`` after ``timeout``.
    """
    from ..generation import SamplingParams
    from ..generation.scheduler import GenerationRequest

    done, failed = threading.Event(), []

    def on_event(event: tuple) -> None:
        if event[0] == "error":
            failed.append(event[1])
        if event[0] in ("done", "error"):
            done.set()

    with Heartbeat("warming up", say or (lambda line: None), expected=expected) as beat:
        scheduler.submit(GenerationRequest([0], SamplingParams(max_new_tokens=4, temperature=0, stop_at_eos=False),
                                           on_event=on_event))
        finished = done.wait(timeout)
    if not finished:
        raise TimeoutError(f"the warm-up request took over {timeout:g} s")
    if failed:
        raise failed[0]
    return beat.seconds


def shape_key(model) -> str:
    """What a compile of ``model``'s decode step depends on, hashed (for :class:`decoderlab.waiting.MeasuredWaits`):
    its config, its weights' dtype, its device and torch's version -- not the weights' values."""
    import torch

    from ..dtypes import model_dtype

    what = {"config": model.config.to_dict(), "dtype": model_dtype(model), "torch": torch.__version__,
            "device": str(next(model.parameters()).device)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def warm_up_said(scheduler, model, waits: MeasuredWaits | None = None) -> float:
    """:func:`warm_up`, said on standard error: what it does and how long it should take where this machine
    measured an earlier warm-up of the kind (``waits``, default ``MeasuredWaits()``: the decoderlab cache), how
    long it has run every ``decoderlab.waiting.EVERY`` seconds, and its time when done, recorded for the next one.
    Returns its seconds."""
    from ..dtypes import model_dtype

    waits = waits or MeasuredWaits()
    what = f"serve warm-up, {next(model.parameters()).device.type}, {model_dtype(model)}"
    key, size = shape_key(model), model.config.n_layer
    estimate = waits.estimate(what, key, size)
    say(starting("warming up the compiled decode step before serving, so that a first client does not wait for the "
                 "compiler; --eager serves at once, uncompiled", estimate))
    seconds = warm_up(scheduler, say=say, expected=None if estimate is None else estimate.seconds)
    waits.record(what, key, size, seconds)
    say(f"warmed up in {seconds:.0f} s (a batch of several rows compiles at its first request)")
    return seconds


def serve(checkpoint, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          cors_origins: list[str] | None = None, limits: ServeLimits | None = None, model_id: str | None = None,
          log_level: str = "info", device=None, dtype=None, compile: bool | str = False, sae=None,
          threads: int | None = None) -> None:
    """Load a checkpoint directory (or a Hugging Face directory, or a GGUF file) and serve it with uvicorn until
    interrupted (``decoderlab serve``), on ``device`` (``decoderlab.devices.resolve_device``'s names; None:
    the CPU), its weights in ``dtype`` (:mod:`decoderlab.dtypes`: None = as stored; ``"q8_0"`` ... GGUF's blocks),
    decoding with a compiled step if ``compile`` (``model.compile_decode``), or with ``compile="auto"`` (what
    ``decoderlab serve`` asks unless ``--eager``) where it pays (:func:`compile_pays`); a compiled step is warmed
    up before the address is announced (:func:`warm_up`), so that a first client does not wait for the compiler;
    ``sae``: an SAE directory
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
        compile = compile_pays(model) if compile == "auto" else compile
        if compile:
            model.compile_decode()
        if model_id is None and not meta.get("name"):
            model_id = Path(checkpoint).resolve().name
        app = create_app(model, tokenizer, meta=meta, template=template, model_id=model_id, api_key=api_key,
                         cors_origins=cors_origins, limits=limits, run_dir=checkpoint, sae=sae)
        if compile:
            warm_up_said(app.state.decoderlab.scheduler(), model)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config(log_level))
        # uvicorn names no address when it is handed a socket: say where the page and the API are (stderr,
        # beside uvicorn's own lines; stdout may be a closed pipe)
        url = f"http://{host}:{sock.getsockname()[1]}"
        say(f"serving {app.state.decoderlab.model_id} on {url} (the page at {url}/, the API at {url}/v1)")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
