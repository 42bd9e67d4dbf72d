"""``decoderlab serve`` (decoderlab.cli.serve): the limits and address in the help are the config's; an address
it cannot listen on is one line naming it, before the checkpoint is loaded; a closed output does not disturb
the server."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from decoderlab.config import SERVE_HOST, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, SERVE_PORT, ServeLimits

from .conftest import cli_env
from .helps import actions

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
    line naming what was given, without the errno's number."""
    for argv, needle in ((("--port", busy_port), f"127.0.0.1:{busy_port}"),
                         (("--host", "bogus.invalid"), "bogus.invalid")):
        r = decoderlab_cli("serve", "--checkpoint", statquest_checkpoint, *argv, timeout=60)
        assert (r.returncode, r.stdout) == (2, ""), argv
        assert r.stderr.startswith("decoderlab: error: ") and r.stderr.count("\n") == 1, r.stderr
        assert needle in r.stderr and "[Errno" not in r.stderr and "INFO" not in r.stderr, r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_closed_output_does_not_disturb_the_server(statquest_checkpoint):
    """uvicorn writes its access lines to standard output: on a closed pipe every request printed a logging
    traceback ("--- Logging error --- ... BrokenPipeError")."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "serve", "--checkpoint", str(statquest_checkpoint),
                          "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    p.stdout.close()
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except OSError:
                assert p.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(0.2)
        statuses = [urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status for _ in range(3)]
        assert statuses == [200, 200, 200]
    finally:
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1].decode()
    assert p.returncode == 130 and err.endswith("decoderlab: interrupted (serve stopped by Ctrl-C)\n"), err
    assert "Traceback" not in err and "Logging error" not in err and "Broken pipe" not in err, err
    # the address is said once, before uvicorn's lines (uvicorn names none when it is handed a socket)
    assert err.count(f"on http://127.0.0.1:{port} (the page at http://127.0.0.1:{port}/, the API at ") == 1, err
    # the lesson's 37 parameters decode eagerly by default: its first request waited ~50 s for the compiler
    eager = err.index("decoderlab: decoding eagerly: 37 parameters decode a token in about a millisecond, too few "
                      "for a compiled step to pay for its compile")
    assert eager < err.index("decoderlab: serving") and "compiling" not in err, err


def _serve(*argv):
    """``decoderlab serve ARGV`` on a free port, its standard error a pipe: ``(process, port)`` once /health
    answers."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "serve", "--port", str(port), *map(str, argv)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env())
    deadline = time.time() + 600  # (a compile on a loaded 2-core machine)
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return p, port
        except OSError:
            if p.poll() is not None or time.time() > deadline:
                p.kill()
                raise AssertionError(f"the server did not start: {p.communicate()[1].decode()}") from None
            time.sleep(0.2)


@pytest.mark.slow
def test_a_compiled_step_is_warmed_up_before_the_address_is_said(statquest_checkpoint):
    """`serve --compile`: the decode step compiles before `serving ... on http://...` (said, with its time), and a
    first request of one prompt then compiles nothing (it waited ~50 s for the compiler)."""
    import json

    p, port = _serve("--checkpoint", statquest_checkpoint, "--compile")
    try:
        body = json.dumps({"prompt": "what is statquest", "max_tokens": 3}).encode()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(ask, timeout=600).status == 200
    finally:
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1].decode()
    before, after = err.split("decoderlab: serving", 1)
    assert "decoderlab: compiling the decode step before serving" in before, err
    assert re.search(r"decoderlab: warmed up in \d+ s", before) and "compiled the decode step in" in before, err
    assert "compiling" not in after, err


def test_eager_and_compile_together_is_one_line(statquest_checkpoint, capsys):
    from decoderlab.cli import main as cli_main

    assert cli_main(["serve", "--checkpoint", str(statquest_checkpoint), "--eager", "--compile"]) == 2
    assert capsys.readouterr().err == ("decoderlab: error: --eager decodes without a compiled step: give it without "
                                       "--compile\n")
