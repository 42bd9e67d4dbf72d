"""LangChain's ``ChatOpenAI`` against a real uvicorn: invoke and stream give the server's own reply,
``with_structured_output`` (json_schema) a dict valid against the schema, ``bind_tools`` a tool call whose
arguments follow the function's schema."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
langchain_openai = pytest.importorskip("langchain_openai")
jsonschema = pytest.importorskip("jsonschema")

from .helpers import MODEL_ID, client  # noqa: E402
from .test_tools import ADD, ASK, TOOLS  # noqa: E402

POINT = {"title": "point", "description": "a point", "type": "object",
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
         "required": ["x", "ok"], "additionalProperties": False}


def chat_model(url, **kw):
    return langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="none", model=MODEL_ID, max_retries=0,
                                       timeout=30, **kw)


def test_invoke_and_stream_are_the_servers_reply(tools_server):
    llm = chat_model(tools_server, temperature=0.8, seed=3, max_tokens=12)
    want = client(tools_server).chat.completions.create(model=MODEL_ID, messages=ASK, temperature=0.8, seed=3,
                                                        max_tokens=12).choices[0].message.content
    assert llm.invoke(ASK[0]["content"]).content == want
    assert "".join(chunk.content for chunk in llm.stream(ASK[0]["content"])) == want


def test_with_structured_output_json_schema_gives_a_valid_dict(tools_server):
    llm = chat_model(tools_server, seed=1, max_tokens=60).with_structured_output(POINT, method="json_schema")
    for _ in range(3):
        got = llm.invoke("a point?")
        jsonschema.validate(got, POINT)


def test_bind_tools_calls_the_tool_with_valid_arguments(tools_server):
    llm = chat_model(tools_server, seed=0, max_tokens=80).bind_tools(TOOLS[:1], tool_choice="add")
    msg = llm.invoke(ASK[0]["content"])
    (call,) = msg.tool_calls
    assert call["name"] == "add" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], ADD)
    stream = chat_model(tools_server, seed=0, max_tokens=80).bind_tools(TOOLS[:1], tool_choice="add")
    chunks = list(stream.stream(ASK[0]["content"]))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.tool_calls[0]["name"] == "add" and whole.tool_calls[0]["args"] == call["args"]
