"""Logprobs of a byte-level BPE model add up: a token that is part of a UTF-8 character is written
``bytes:\\xNN`` (OpenAI's and vLLM's), so different byte tokens never collide as keys of ``top_logprobs``;
``bytes`` are the token's own; ``text_offset`` counts characters of the decoded text; on completions (echo,
generated, streamed) and on chat."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import decoderlab as dl  # noqa: E402
from decoderlab.chat import add_chat_tokens, get_template  # noqa: E402
from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID  # noqa: E402

TEXT = "café 日本"


@pytest.fixture(scope="module")
def bpe_server():
    torch.manual_seed(0)
    tok = dl.BPETokenizer.train("the cat sat on the mat, and the dog ran.\n" * 8, 270)
    cfg = dl.preset("baby-shakespeare", n_layer=1, n_head=2, d_model=32, max_len=64, num_tokens=tok.vocab_size)
    model, tok = add_chat_tokens(dl.DecoderOnlyTransformer(cfg).eval(), tok, "decoderlab")[:2]
    template = get_template("decoderlab")
    app = create_app(model, tok, model_id=MODEL_ID, template=template, limits=Limits(max_tokens=64))
    with ServerThread(app) as url:
        yield url, model, tok


def _post(url, path, body):
    r = httpx.post(url + path, json={"model": MODEL_ID, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_echoed_prompt_s_byte_tokens_are_distinct_and_add_up(bpe_server):
    url, model, tok = bpe_server
    ids = tok.encode(TEXT)
    assert any(t.startswith("bytes:") for t in (dl.generation.scoring.logprob_token(tok, i)[0] for i in ids))
    lp = _post(url, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 3, "max_tokens": 0})
    lp = lp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    want = [tok.token_bytes(i) for i in ids]
    for t, raw in zip(lp["tokens"], want):  # the token's text, or its bytes written out
        assert t == (raw.decode("utf-8") if _complete(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
    assert all(len(top) == 3 for top in lp["top_logprobs"][1:])  # three distinct keys each
    # offsets in characters of the text: "c" 0 "a" 1 "f" 2 "é" 3 (both its bytes), " " 4, ...
    done, offsets = b"", []
    for raw in want:
        offsets.append(len(done.decode("utf-8", errors="ignore")))
        done += raw
    assert done.decode("utf-8") == TEXT and lp["text_offset"] == offsets
    space = [k for k, raw in enumerate(want) if raw.startswith(b" ")][0]
    assert lp["text_offset"][space] == TEXT.index(" ") == 4
    with torch.no_grad():  # the values: the model's log-softmax in float64
        logp = torch.log_softmax(model(torch.tensor(ids)).double(), -1)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(float(logp[t - 1, ids[t]]), abs=1e-4)


def _complete(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_generated_and_streamed_offsets_count_characters(bpe_server):
    url, _, tok = bpe_server
    body = {"prompt": TEXT, "logprobs": 2, "max_tokens": 12, "temperature": 1.0, "seed": 3}
    whole = _post(url, "/v1/completions", body)["choices"][0]
    lp = whole["logprobs"]
    assert lp["text_offset"][0] == 0
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL_ID, **body, "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    streamed = [o for e in events for c in e["choices"] if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    for k, off in enumerate(lp["text_offset"][1:], 1):
        assert lp["text_offset"][k - 1] <= off <= len(whole["text"])


def test_chat_logprobs_bytes_are_the_token_s_own(bpe_server):
    url, _, tok = bpe_server
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}], "logprobs": True,
                                             "top_logprobs": 3, "max_tokens": 12, "temperature": 1.0, "seed": 1})
    content = r["choices"][0]["logprobs"]["content"]
    text = r["choices"][0]["message"]["content"]
    assert bytes(b for it in content for b in it["bytes"]).decode("utf-8", errors="replace").startswith(text)
    for it in content:
        assert len({t["token"] for t in it["top_logprobs"]}) == len(it["top_logprobs"]) == 3
        for t in it["top_logprobs"]:
            raw = bytes(t["bytes"])
            assert t["token"] == (raw.decode("utf-8") if _complete(raw) else
                                  "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
