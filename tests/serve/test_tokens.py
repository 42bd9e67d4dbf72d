"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the ids ``/v1/completions`` encodes (and the chat
template renders), their pieces, the text generation writes; bad bodies are 400s naming the field."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

from .helpers import MODEL_ID  # noqa: E402


def test_tokenize_gives_the_ids_and_pieces_completions_uses(server, mt):
    url, _ = server
    model, tok = mt
    r = httpx.post(url + "/tokenize", json={"model": MODEL_ID, "prompt": "hi there", "add_special_tokens": False})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("hi there") and body["count"] == 8 and body["max_model_len"] == 32
    assert body["token_strs"] == list("hi there")
    used = httpx.post(url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 1}).json()
    assert used["usage"]["prompt_tokens"] == body["count"]
    back = httpx.post(url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": "hi there"}


def test_tokenize_messages_renders_the_chat_template(chat_server, mt):
    url, _ = chat_server
    model, tok = mt
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", headers={"Authorization": "Bearer sekret"}, json={"messages": msgs})
    want = tok.encode("s:be brief") + [tok.eos_id] + tok.encode("u:hi") + [tok.eos_id] + tok.encode("a:")
    assert r.status_code == 200 and r.json()["tokens"] == want  # developer is rendered as the system message


def test_tokenizer_info_names_the_control_tokens(server, mt):
    url, _ = server
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<EOS>" and info["pad_token"] == "<PAD>" and info["vocab_size"] == 35
    assert info["model_max_length"] == 32 and info["tokenizer_class"] == "CharTokenizer"


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": ""}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"), ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": "#"}, "prompt"), ("/detokenize", {"tokens": [1, 99]}, "tokens[1]"),
    ("/detokenize", {"tokens": "12"}, "tokens"), ("/detokenize", {}, "tokens")])
def test_bad_token_requests_are_400s_naming_the_field(server, path, body, param):
    url, _ = server
    r = httpx.post(url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for raw in (b"", b"[1, 2]", b'"text"'):
        r = httpx.post(url + path, content=raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert httpx.post(url + "/tokenize", json={"prompt": "ok"}).status_code == 200  # it serves the others


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_tokenize_takes_tools_and_counts_what_chat_completions_sends(tools_server, tools_model):
    """vLLM's tokenize request takes ``tools``, so a client can count the tool block before sending; the ids are
    the chat template's render with the tools, the prompt chat completions builds (its usage says so)."""
    from decoderlab.chat import get_template

    _, tok = tools_model
    msgs = [{"role": "user", "content": "1 plus 2"}]
    r = httpx.post(tools_server + "/tokenize", json={"messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    want, _ = get_template("tools").render(msgs, tok, add_generation_prompt=True, tools=TOOLS)
    assert r.json()["tokens"] == list(want)
    without = httpx.post(tools_server + "/tokenize", json={"messages": msgs}).json()
    assert without["count"] < r.json()["count"]
    used = httpx.post(tools_server + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 1,
                                                                    "tool_choice": "none"}).json()
    assert used["usage"]["prompt_tokens"] == r.json()["count"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "tools": TOOLS}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
])
def test_tokenize_with_bad_tools_is_a_400_naming_the_field(tools_server, body, param):
    r = httpx.post(tools_server + "/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_tokenize_with_tools_on_a_template_that_writes_no_tool_calls_says_so(chat_server):
    url, _ = chat_server
    r = httpx.post(url + "/tokenize", headers={"Authorization": "Bearer sekret"},
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "writes no tool calls" in r.text


def test_tokenize_puts_the_start_token_first_as_vllm_does_and_messages_get_only_the_template_s(llama_server):
    """vLLM's /tokenize: a prompt with ``add_special_tokens`` (default true: Llama's <s>, transformers'
    ``tokenizer(text)``); messages rendered by the chat template, which writes <s> itself: exactly one, as
    transformers' ``apply_chat_template``."""
    url, m, hf, auto = llama_server
    text = "To be, or not to be"
    ids = auto(text)["input_ids"]
    body = httpx.post(url + "/tokenize", json={"prompt": text}).json()
    assert body["tokens"] == ids and body["token_strs"][0] == "<s>" and body["count"] == len(ids)
    bare = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:] == auto(text, add_special_tokens=False)["input_ids"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    want = auto.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    for flag in ({}, {"add_special_tokens": True}, {"add_special_tokens": False}):
        got = httpx.post(url + "/tokenize", json={"messages": messages, **flag}).json()["tokens"]
        assert got == want and got.count(auto.bos_token_id) == 1, flag
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)
    info = httpx.get(url + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
