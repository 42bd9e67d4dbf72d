"""``decoderlab serve``: a checkpoint over an OpenAI-compatible HTTP API with the glass-box page at /
(``decoderlab.serve``)."""

from __future__ import annotations

from ..config.defaults import SERVE_HOST, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, SERVE_PORT
from ..output import KeepWriting
from .argtypes import number
from .options import THREADS_OPTIONS, add_checkpoint_option, add_options, flag, set_threads

#: uvicorn's exit status when its server did not start (``uvicorn.main.STARTUP_FAILURE``)
_UVICORN_STARTUP_FAILURE = 3


def add_serve(p) -> None:
    add_checkpoint_option(p)
    p.add_argument("--host", default=SERVE_HOST, help=f"address to bind (default {SERVE_HOST}: this machine only)")
    p.add_argument("--port", type=number(int), default=SERVE_PORT, metavar="N",
                   help=f"port, 0 .. 65535 (default {SERVE_PORT})")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none, open)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="allow this browser origin (repeatable; default: CORS off)")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model id clients name (default: the checkpoint's name, else the directory's name)")
    for field, default in SERVE_LIMIT_DEFAULTS.items():
        p.add_argument(flag(field), type=number(int), default=default, metavar="N",
                       help=f"{SERVE_LIMIT_HELP[field]}, >= 1 (default {default})")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_serve)


def _check_numbers(args) -> None:
    for name in ("port", *SERVE_LIMIT_DEFAULTS):
        value = getattr(args, name)
        low = 0 if name == "port" else 1
        if value < low or (name == "port" and value > 65535):
            raise ValueError(f"{flag(name)} must be {'0 .. 65535' if name == 'port' else '>= 1'}, got {value}")


_BIND_HINTS = {
    "EADDRINUSE": "another program listens there; choose another --port, or --port 0 for a free one",
    "EACCES": "ports below 1024 need root; choose --port 1024 or above",
    "EADDRNOTAVAIL": "--host must be an address of this machine, such as 127.0.0.1 or 0.0.0.0",
}


def check_listen(host: str, port: int) -> None:
    """Bind (and release) every address ``host`` resolves to, as the server will (asyncio's ``create_server``:
    ``SO_REUSEADDR``, IPv6 sockets IPv6-only), so that a name that does not resolve or a port in use is one line
    naming them, said before the checkpoint is loaded.

    Raises:
        ValueError: ``host`` does not resolve, or ``host:port`` cannot be bound (in use, a port below 1024
            without root, not an address of this machine).
    """
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve this name to an address to listen on ({e.strerror})") \
            from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                hint = _BIND_HINTS.get(errno.errorcode.get(e.errno, ""))
                raise ValueError(f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}"
                                 + (f" ({hint})" if hint else "")) from None


def cmd_serve(args) -> int:
    _check_numbers(args)
    check_listen(args.host, args.port)
    from ..serve import Limits, serve

    set_threads(args)
    limits = Limits(**{name: getattr(args, name) for name in SERVE_LIMIT_DEFAULTS},
                    default_max_tokens=min(Limits.default_max_tokens, args.max_tokens))
    try:
        with KeepWriting():  # a closed output (uvicorn's access lines) must not stop the server
            serve(args.checkpoint, host=args.host, port=args.port, api_key=args.api_key,
                  cors_origins=args.cors_origin, limits=limits, model_id=args.model_id)
    except SystemExit as e:  # the address was taken between the check and the server's start
        if e.code != _UVICORN_STARTUP_FAILURE:
            raise
        raise ValueError(f"the server could not start on {args.host}:{args.port} (uvicorn's lines above say "
                         f"why)") from None
    return 0
