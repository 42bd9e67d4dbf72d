"""The server tests' own helpers: ``cli_server`` waits for the server's readiness line, however long its warm-up
takes, and fails with the server's output when it exits first (it waited a fixed 120 s for /health and then
yielded the address anyway: a slow warm-up on a loaded machine became "Connection refused")."""

from __future__ import annotations

import sys
import urllib.request

import pytest
from support.processes import running

from .helpers import READY, cli_server

# a stand-in for `decoderlab serve`, taking its arguments: it says things, warms up (FAKE_WARM_UP seconds), then
# listens and prints the readiness line -- or, with --checkpoint missing, one error line and exit status 2
FAKE_SERVER = r"""
import argparse, http.server, sys, time
p = argparse.ArgumentParser()
p.add_argument("--checkpoint"); p.add_argument("--port", type=int); p.add_argument("--warm-up", type=float)
a = p.parse_args()
if a.checkpoint == "missing":
    print("decoderlab: error: no checkpoint at missing", file=sys.stderr, flush=True)
    sys.exit(2)
print("decoderlab: warming up the compiled decode step before serving ...", file=sys.stderr, flush=True)
time.sleep(a.warm_up)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")

server = http.server.HTTPServer(("127.0.0.1", a.port), Health)
url = f"http://127.0.0.1:{a.port}"
print(f"decoderlab: serving fake on {url} (the page at {url}/, the API at {url}/v1)", file=sys.stderr, flush=True)
server.serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path):
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return [sys.executable, str(path)]


def test_cli_server_waits_for_the_readiness_line_of_a_slow_server(fake_server, tmp_path):
    with cli_server("ck", "--warm-up", "2", command=fake_server) as url:
        assert url.startswith("http://127.0.0.1:")
        assert urllib.request.urlopen(url + "/health", timeout=30).read() == b"ok"


def test_cli_server_fails_with_the_output_of_a_server_that_exits_first(fake_server):
    with pytest.raises(AssertionError) as e:
        with cli_server("missing", command=fake_server):
            pytest.fail("a server that exited was yielded")
    assert "exited with status 2 before printing a line matching" in str(e.value)
    assert "decoderlab: error: no checkpoint at missing" in str(e.value)


def test_a_command_that_says_nothing_ready_fails_at_the_safety_net_with_its_output():
    argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"]
    with pytest.raises(AssertionError, match=r"(?s)printed no line matching .* taken to hang.*loading"):
        with running(argv, READY, safety=0.5):
            pass


def test_a_closed_standard_output_leaves_standard_error_read():
    argv = [sys.executable, "-c", "import sys; print('decoderlab: serving x on http://h:1 (the page at x', "
                                  "file=sys.stderr, flush=True); sys.stdin.read()"]
    with running(argv, READY, close_stdout=True) as proc:
        assert proc.ready.group(1) == "http://h:1"
