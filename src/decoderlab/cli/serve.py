"""``decoderlab serve``: a checkpoint over an OpenAI-compatible HTTP API with the glass-box page at /
(``decoderlab.serve``)."""

from __future__ import annotations

from ..config.defaults import (SERVE_HOST, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, SERVE_LIMITS, SERVE_PORT,
                               SERVE_PREFILL_CHUNK_HELP)
from ..output import KeepWriting
from .argtypes import number
from .options import (DEVICE_OPTIONS, DTYPE_OPTIONS, EAGER_OPTIONS, THREADS_OPTIONS, add_checkpoint_option, add_options,
                      announce_compiles, check_checkpoint, decode_mode, device, flag, set_threads)


def add_serve(p) -> None:
    add_checkpoint_option(p)
    add_options(p, DTYPE_OPTIONS)
    add_options(p, DEVICE_OPTIONS)
    add_options(p, EAGER_OPTIONS)
    p.add_argument("--compile", action="store_true", default=False,
                   help="compile the decode step whatever the model's size (default: compiled, and warmed up before "
                        "serving, for a model of at least a million parameters -- smaller ones decode a token in about "
                        "a millisecond eagerly -- on a CPU or a CUDA GPU)")
    p.add_argument("--host", default=SERVE_HOST, help=f"address to bind (default {SERVE_HOST}: this machine only)")
    p.add_argument("--port", type=number(int, 0, maximum=65535), default=SERVE_PORT, metavar="N",
                   help=f"port, 0 .. 65535 (default {SERVE_PORT})")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none, open)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="allow this browser origin (repeatable; default: CORS off)")
    p.add_argument("--model-id", default=None, metavar="NAME",
                   help="the model id clients name (default: the checkpoint's name, else the directory's name)")
    for field, default in SERVE_LIMIT_DEFAULTS.items():
        p.add_argument(flag(field), type=number(int, 1), default=default, metavar="N",
                       help=f"{SERVE_LIMIT_HELP[field]}, >= 1 (default {default})")
    p.add_argument("--prefill-chunk", type=number(int), default=SERVE_LIMITS["prefill_chunk"], metavar="N",
                   help=SERVE_PREFILL_CHUNK_HELP)
    p.add_argument("--sae", default=None, metavar="DIR",
                   help="a sparse autoencoder of this model (`decoderlab sae --out DIR`) whose features the page shows "
                        "(default: none)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_serve)


def _check_numbers(args) -> None:
    for name in ("port", *SERVE_LIMIT_DEFAULTS):
        value = getattr(args, name)
        low = 0 if name == "port" else 1
        if value < low or (name == "port" and value > 65535):
            raise ValueError(f"{flag(name)} must be {'0 .. 65535' if name == 'port' else '>= 1'}, got {value}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1 (tokens of a prompt read per decode step), got "
                         f"{args.prefill_chunk}")


def cmd_serve(args) -> int:
    _check_numbers(args)
    where = device(args)  # a device the machine lacks: one line before the port is bound
    from ..dtypes import check_dtype

    check_dtype(args.dtype, where)  # likewise an unknown --dtype, or one the device does not run
    check_checkpoint(args.checkpoint)  # the values first, then the path: each named before the port is bound
    from ..serve import Limits, serve

    threads = set_threads(args)
    # compiled by default where Inductor serves (a CPU, a CUDA GPU) and it pays (a model of a million parameters
    # and more); its compiles are said on standard error
    mode = decode_mode(args)
    compile_ = {"compile": True, "eager": False}.get(mode, "auto" if where.type in ("cpu", "cuda") else False)
    if compile_:
        announce_compiles()
    limits = Limits(**{name: getattr(args, name) for name in SERVE_LIMIT_DEFAULTS},
                    default_max_tokens=min(Limits.default_max_tokens, args.max_tokens),
                    prefill_chunk=args.prefill_chunk)
    # serve() binds --host:--port before loading (a busy port or an unknown host: one error line); a closed
    # output (uvicorn writes its access lines there) must not disturb the server
    with KeepWriting():
        serve(args.checkpoint, host=args.host, port=args.port, api_key=args.api_key, cors_origins=args.cors_origin,
              limits=limits, model_id=args.model_id, device=where, dtype=args.dtype, compile=compile_, sae=args.sae,
              threads=threads)
    return 0
