"""What the server's tests share: a tiny model, a stand-in chat template, the reference text of
``decoderlab.generate``, clients of the official ``openai`` package, and ``decoderlab serve`` in a subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import openai
from support.processes import running
from tiny_models import tiny_model  # noqa: F401 -- the served model, shared with the scheduler's tests

import decoderlab as dl

MODEL_ID = "tiny"


class FakeTemplate:
    """The duck-typed interface of ``decoderlab.chat.ChatTemplate`` (render, end_of_turn_id, name)."""

    name = "fake"

    def render(self, messages, tokenizer, *, add_generation_prompt=False):
        ids, mask = [], []
        for m in messages:
            part = tokenizer.encode(f"{m['role'][0]}:{m['content']}") + [tokenizer.eos_id]
            ids += part
            mask += [m["role"] == "assistant"] * len(part)
        if add_generation_prompt:
            part = tokenizer.encode("a:")
            ids += part
            mask += [False] * len(part)
        return ids, mask

    def end_of_turn_id(self, tokenizer):
        return tokenizer.eos_id


def ref_text(mt, prompt_ids, n, temperature, seed, stop=None, top_k=None, top_p=None):
    """``decoderlab.generate`` called as the server's semantics imply: with the tokenizer (``<PAD>`` never
    sampled, ``<EOS>`` ends the text), stop strings on the text; its text without control tokens."""
    model, tok = mt
    ids = dl.generate(model, list(prompt_ids), n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      stop=stop, tokenizer=tok)
    return tok.decode(ids, skip_special=True)


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def aclient(url, key="none"):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the line ``decoderlab serve`` prints once it serves (its socket listens from then on), naming its address
READY = r"^decoderlab: serving .* on (http://\S+) \(the page at "


@contextlib.contextmanager
def cli_server(directory, *args, command=None, env=None):
    """``decoderlab serve --checkpoint DIR ARGS`` in a subprocess (the real command; ``command``: another one
    taking the same arguments), with ``env`` added to the environment: yields its URL once it says it serves --
    however long its warm-up takes on a loaded machine -- and fails with everything it printed if it exits first
    (``support.processes.running``)."""
    env = dict(os.environ, PYTHONPATH=str(Path(dl.__file__).resolve().parents[1]), **(env or {}))
    command = command or [sys.executable, "-m", "decoderlab.cli", "serve"]
    argv = [*command, "--checkpoint", str(directory), "--port", str(_free_port()), *args]
    with running(argv, READY, env=env) as server:
        yield server.ready.group(1)
