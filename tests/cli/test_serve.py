"""``decoderlab serve`` (decoderlab.cli.serve): the limits and address in the help are the config's; an address
it cannot listen on is one line naming it, before the checkpoint is loaded; a closed output does not disturb
the server."""

from __future__ import annotations

import re
import signal
import socket
import sys
import urllib.request

import pytest

from support.caches import own_cache
from support.processes import running

from decoderlab.config import SERVE_HOST, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, SERVE_PORT, ServeLimits

from .conftest import cli_env
from .helps import actions

READY = r"^decoderlab: serving .* on http://"  # (the line `serve` says once its socket listens)

pytest.importorskip("uvicorn")


def test_serve_help_shows_the_config_limits_and_address():
    a = actions("serve")
    for field, default in SERVE_LIMIT_DEFAULTS.items():
        assert a[field].default == default == getattr(ServeLimits(), field), field
        assert a[field].help == f"{SERVE_LIMIT_HELP[field]}, >= 1 (default {default})"
    assert (a["host"].default, a["port"].default) == (SERVE_HOST, SERVE_PORT)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_an_address_in_use_or_unknown_is_one_line(decoderlab_cli, statquest_checkpoint, busy_port):
    """A busy port or `--host bogus.invalid` printed uvicorn's startup lines and its error, and exited 3; now one
    line naming what was given, without the errno's number. (The console script's whole standard error for a busy
    port; `--host bogus.invalid` in this process: serve/test_runner.py.)"""
    r = decoderlab_cli("serve", "--checkpoint", statquest_checkpoint, "--port", busy_port, timeout=60)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.startswith("decoderlab: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert f"127.0.0.1:{busy_port}" in r.stderr and "[Errno" not in r.stderr and "INFO" not in r.stderr, r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*argv, close_stdout: bool = False, env=None):
    """``decoderlab serve ARGV`` on a free port: ``(Running, port)`` once it says it serves, however long its
    warm-up takes (``support.processes.running``: a server that exits first fails the test with its output)."""
    port = _free_port()
    return running([sys.executable, "-m", "decoderlab.cli", "serve", "--port", str(port), *map(str, argv)], READY,
                   env={**cli_env(), **(env or {})}, close_stdout=close_stdout), port


def test_a_closed_output_does_not_disturb_the_server(statquest_checkpoint):
    """uvicorn writes its access lines to standard output: on a closed pipe every request printed a logging
    traceback ("--- Logging error --- ... BrokenPipeError")."""
    server, port = _serve("--checkpoint", statquest_checkpoint, close_stdout=True)
    with server as p:
        # the address is said once the socket listens: a first request is answered, not refused
        statuses = [urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status for _ in range(3)]
        assert statuses == [200, 200, 200]
        p.proc.send_signal(signal.SIGINT)
        err = p.finish()
    assert p.proc.returncode == 130 and err.endswith("decoderlab: interrupted (serve stopped by Ctrl-C)\n"), err
    assert "Traceback" not in err and "Logging error" not in err and "Broken pipe" not in err, err
    # the address is said once, before uvicorn's lines (uvicorn names none when it is handed a socket)
    assert err.count(f"on http://127.0.0.1:{port} (the page at http://127.0.0.1:{port}/, the API at ") == 1, err
    # the lesson's 37 parameters decode eagerly by default: its first request waited ~50 s for the compiler
    eager = err.index("decoderlab: decoding eagerly: 37 parameters decode a token in about a millisecond, too few "
                      "for a compiled step to pay for its compile")
    assert eager < err.index("decoderlab: serving") and "compiling" not in err, err


@pytest.mark.slow
def test_a_compiled_step_is_warmed_up_before_the_address_is_said(statquest_checkpoint, tmp_path):
    """`serve --compile`: the decode step compiles before `serving ... on http://...` -- one graph, for every
    length of the timeline (the first length seen and then a dynamic one were two compiles of the whole model:
    SmolLM2's warm-up took 265 s) --, said with no time promised (none measured yet), a line every waiting.EVERY
    seconds while it runs, and its time, which is recorded for the next warm-up of this shape to promise
    (serve/test_runner.py holds what that one says); a first request of a longer prompt then compiles nothing
    (it waited ~50 s for the compiler)."""
    import json

    from decoderlab.waiting import MeasuredWaits

    server, port = _serve("--checkpoint", statquest_checkpoint, "--compile", env={"DECODERLAB_CACHE": str(own_cache(tmp_path))})
    with server as p:
        body = json.dumps({"prompt": "what is statquest", "max_tokens": 3}).encode()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(ask, timeout=600).status == 200
        p.proc.send_signal(signal.SIGINT)
        out = p.finish()
    before, after = out.split("decoderlab: serving", 1)
    (start,) = re.findall(r"decoderlab: warming up the compiled decode step before serving.*", before)
    took = re.findall(r"decoderlab: warmed up in (\d+) s", before)
    assert len(took) == 1 and before.count("decoderlab: compiled the decode step in ") == 1, out
    assert before.count("decoderlab: compiling the decode step with torch.compile") == 1, out
    assert "nothing measured yet to estimate its time from" in start and "minute" not in start, start
    (kept,) = [r for r in MeasuredWaits(tmp_path / "waits.json").records() if r["kind"].startswith("serve warm-up")]
    assert abs(kept["seconds"] - int(took[0])) <= 1, (kept, took)
    assert "compiling" not in after, out


def test_eager_and_compile_together_is_one_line(statquest_checkpoint, capsys):
    from decoderlab.cli import main as cli_main

    assert cli_main(["serve", "--checkpoint", str(statquest_checkpoint), "--eager", "--compile"]) == 2
    assert capsys.readouterr().err == ("decoderlab: error: --eager decodes without a compiled step: give it without "
                                       "--compile\n")
