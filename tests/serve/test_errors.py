"""Bad input over HTTP: every error in OpenAI's shape, naming the field; the server keeps serving."""

from __future__ import annotations

import logging
import socket
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, client  # noqa: E402


BAD = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {"model": MODEL_ID}, 400, "messages", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3001}, 400, "max_tokens", "max_tokens_limit"),
    ("/v1/completions", {"prompt": "a", "n": 4}, 400, "n", "n_limit"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "a" * 33}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, 400, "suffix", "unsupported_parameter"),
    # the sampling controls: each out of its range is a 400 naming it
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "min_p": -0.1}, 400, "min_p", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"9999": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"2": 101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "best_of": 1, "n": 2}, 400, "best_of", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "best_of": 3, "stream": True}, 400, "best_of", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "echo": True, "n": 2}, 400, "echo", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": "zero"}}}}, 400, "response_format", "invalid_grammar"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format",
     "invalid_grammar"),  # this model's characters have no "{": it cannot write JSON
    ("/v1/completions", {"prompt": "a", "guided_regex": "a(b"}, 400, "guided_regex", "invalid_grammar"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo",
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, 400, "top_k", "invalid_value"),  # (0 = no filter, as generate)
    ("/v1/completions", {"prompt": "a", "top_k": 2.5}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed", "invalid_value"),  # (was accepted)
    ("/v1/completions", {"prompt": "a", "seed": 99999999999999999999999}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {"prompt": "#"}, 400, "prompt", "invalid_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
     "no_chat_template"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{b[3]}-{b[4]}" for b in BAD])
def test_bad_inputs_are_openai_shaped(server, path, body, status, param, code):
    url, _ = server
    r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"]


def test_bad_request_error_carries_code_and_param(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="a" * 40, max_tokens=3)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert "32" in e.value.message and "40" in e.value.message  # both lengths named
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_ID, prompt="a", max_tokens=5000)
    assert e.value.param == "max_tokens" and "3000" in e.value.message  # the limit is named
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="a")
    assert e.value.code == "model_not_found"


def test_body_not_json_and_too_large(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", content=b"x" * 10_000_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"  # 413: the status for it
    assert "100000" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


HUGE = "9" * 5000  # more digits than Python reads from text (a plain ValueError inside json.loads)
BAD_BODIES = [
    # (path, raw JSON body, param) -- through the pydantic models and the strict JSON reader
    ("/v1/completions", '{"prompt": "a", "temperature": "hot"}', "temperature"),  # a string for a number
    ("/v1/completions", '{"prompt": "a", "seed": "7"}', "seed"),
    ("/v1/completions", '{"prompt": "a", "model": ["tiny"]}', "model"),  # a list for a string
    ("/v1/completions", '{"prompt": "a", "stop": [["x"]]}', "stop"),
    ("/v1/completions", '{"prompt": {"text": "a"}}', "prompt"),  # extra nesting
    ("/v1/completions", '{"prompt": "a", "top_p": {"value": 0.5}}', "top_p"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": ' + HUGE + "}", "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "user": ' + HUGE + "}", "user"),  # even in an ignored field
    ("/v1/completions", '{"prompt": [' + HUGE + "]}", "prompt[0]"),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}',
     "messages[1].role"),  # an unknown role
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": {"text": "x"}}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [[{"role": "user", "content": "x"}]]}', "messages[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": ' + HUGE + "}]}",
     "messages[0].name"),
    ("/v1/decoderlab/trace", '{"prompt": "a", "top": "5"}', "top"),
    ("/v1/decoderlab/trace", '{"token_ids": [1, [2]]}', "token_ids[1]"),
    ("/v1/decoderlab/trace", '{"prompt": "a", "seed": ' + HUGE + "}", "seed"),
]


@pytest.mark.parametrize("path,raw,param", BAD_BODIES, ids=[f"{b[0][4:]}-{b[2]}" for b in BAD_BODIES])
def test_bad_fields_through_the_models_are_400s_naming_them(chat_server, path, raw, param):
    url, _ = chat_server
    r = httpx.post(url + path, content=raw.encode(), headers={"Authorization": "Bearer sekret",
                                                              "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_value", "invalid_request_error"), err
    assert param.split("[")[0] in err["message"]
    assert httpx.get(url + "/health").status_code == 200  # and it keeps serving


def test_a_body_without_json_content_type_is_read_as_json(server):
    url, _ = server  # curl -d sends application/x-www-form-urlencoded
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "ab", "max_tokens": 2, "temperature": 0}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(url + "/v1/completions", content=b"")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_an_oversized_body_is_a_413_in_openai_s_shape_declared_or_not(server):
    url, _ = server

    def chunks():  # no Content-Length: the size is known only while reading
        for _ in range(30):
            yield b"x" * 10_000

    for r in (httpx.post(url + "/v1/completions", content=b"{" + b" " * 200_000 + b"}"),
              httpx.post(url + "/v1/chat/completions", content=chunks())):
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "body_too_large"
        assert "100000" in err["message"] and "--max-body-bytes" in err["message"]


def test_a_500_carries_no_internal_text(server, mt, monkeypatch, caplog):
    """An exception inside a route is logged with its traceback; the client reads a generic 500."""
    url, _ = server
    _, tok = mt  # the served tokenizer

    def boom(*a, **k):
        raise RuntimeError("secret detail at /srv/internal/path")

    monkeypatch.setattr(tok, "encode", boom)
    r = httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    monkeypatch.undo()
    assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
    err = r.json()["error"]
    assert (err["code"], err["type"], err["param"]) == ("internal_error", "server_error", None)
    assert "secret" not in r.text and "RuntimeError" not in r.text and "/srv" not in r.text
    assert "secret detail at /srv/internal/path" in caplog.text  # the log has it
    assert httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_that_hangs_up_mid_body_is_one_log_line(mt):
    """Content-Length 500, 10 bytes, then the client closes: one line in the log, no traceback."""
    model, tok = mt
    thread = ServerThread(create_app(model, tok, model_id=MODEL_ID, template=None), log_level="info")
    seen = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "decoderlab.serve")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        with thread as url:
            with socket.create_connection((thread.host, thread.port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 500\r\n\r\n" + b'{"prompt":')
                time.sleep(0.3)
            deadline = time.time() + 5
            while not seen.records and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # (a traceback would follow the line)
            assert httpx.get(url + "/health").status_code == 200
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    assert not [r for r in seen.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in seen.records]
    lines = [r.getMessage() for r in seen.records if r.name == "decoderlab.serve"]
    assert len(lines) == 1 and "hung up" in lines[0] and "10 of 500 bytes" in lines[0], lines
