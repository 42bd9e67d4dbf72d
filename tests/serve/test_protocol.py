"""The wire protocol without HTTP: the request models, the 400 a validation error becomes, strict JSON, and the
sampling settings a request asks for."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from decoderlab.config import ServeLimits  # noqa: E402
from decoderlab.serve import protocol as P  # noqa: E402
from decoderlab.serve import trace_protocol as TP  # noqa: E402
from decoderlab.serve.body import loads  # noqa: E402
from decoderlab.serve.errors import APIError, from_validation, param_of  # noqa: E402
from decoderlab.serve.generation import settings_of  # noqa: E402

USER = {"role": "user", "content": "hi"}


def refusal(model, body: dict) -> APIError:
    """The 400 the server answers for ``body`` (as FastAPI reports a body's errors: located under "body")."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return from_validation([dict(err, loc=("body", *err["loc"])) for err in e.value.errors()])


BAD_FIELDS = [
    # (model, body, param, words in the message)
    (P.CompletionRequest, {"prompt": "a", "temperature": "hot"}, "temperature", ["number", '"hot"']),
    (P.CompletionRequest, {"prompt": "a", "max_tokens": "12"}, "max_tokens", ["integer"]),
    (P.CompletionRequest, {"prompt": "a", "max_tokens": 2.0}, "max_tokens", ["integer"]),
    (P.CompletionRequest, {"prompt": "a", "top_k": True}, "top_k", ["integer"]),
    (P.CompletionRequest, {"prompt": "a", "stream": "yes"}, "stream", ["true or false"]),
    (P.CompletionRequest, {"prompt": "a", "model": ["tiny"]}, "model", ["string"]),  # a list for a string
    (P.CompletionRequest, {"prompt": "a", "stop": [["x"]]}, "stop", ["non-empty string"]),
    (P.CompletionRequest, {"prompt": "a", "stop": ""}, "stop", ["non-empty string"]),
    (P.CompletionRequest, {"prompt": {"text": "a"}}, "prompt", ["string", "token ids"]),  # extra nesting
    (P.CompletionRequest, {"prompt": [[1, [2]]]}, "prompt", ["token ids"]),
    (P.CompletionRequest, {"prompt": ["a", [2]]}, "prompt", ["a list of strings or a list of token-id lists"]),
    (P.CompletionRequest, {"prompt": "a", "temperature": {"value": 1}}, "temperature", ["number"]),
    (P.CompletionRequest, {"prompt": "a", "temperature": 2.5}, "temperature", ["<= 2"]),
    (P.CompletionRequest, {"prompt": "a", "top_p": 0}, "top_p", ["> 0"]),
    (P.CompletionRequest, {"prompt": "a", "seed": -1}, "seed", [">= 0"]),
    (P.CompletionRequest, {"prompt": "a", "seed": 2**64}, "seed", ["<="]),
    (P.CompletionRequest, {"prompt": "a", "logprobs": 6}, "logprobs", ["<= 5"]),
    (P.CompletionRequest, {"prompt": "a", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage", ["true or false"]),
    (P.CompletionRequest, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     ["only allowed when stream is true"]),
    (P.ChatCompletionRequest, {"messages": [USER, {"role": "robot", "content": "x"}]}, "messages[1].role",
     ["'system', 'developer', 'user', 'assistant' or 'tool'", '"robot"']),
    (P.ChatCompletionRequest, {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content",
     ["text content parts"]),
    (P.ChatCompletionRequest, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content",
     ["string or a list of text parts"]),  # extra nesting
    (P.ChatCompletionRequest, {"messages": [[USER]]}, "messages[0]", ["object"]),  # extra nesting
    (P.ChatCompletionRequest, {"messages": "hi"}, "messages", ["list"]),  # a string for a list
    (P.ChatCompletionRequest, {"messages": []}, "messages", ["at least 1"]),
    (P.ChatCompletionRequest, {"messages": [USER], "top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    (P.ChatCompletionRequest, {"messages": [USER], "logprobs": 1}, "logprobs", ["true or false"]),
    (TP.TraceRequest, {"prompt": "a", "top": 0}, "top", [">= 1"]),
    (TP.TraceRequest, {"prompt": "a", "layers": "0"}, "layers", ["list"]),
    (TP.TraceRequest, {"prompt": "a", "continuation": 5}, "continuation", ["string"]),
    (TP.TraceRequest, {"token_ids": [1, "2"]}, "token_ids[1]", ["integer"]),
]


@pytest.mark.parametrize("model,body,param,words", BAD_FIELDS, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_FIELDS)])
def test_a_bad_field_is_a_400_naming_it(model, body, param, words):
    err = refusal(model, body)
    assert (err.status, err.param, err.code) == (400, param, "invalid_value"), err.message
    assert err.message.startswith(param) or param in err.message
    for w in words:
        assert w in err.message, err.message


@pytest.mark.parametrize("model,field,value", [(P.CompletionRequest, "suffix", "x"),
                                               (P.CompletionRequest, "functions", [{"name": "f"}]),
                                               (P.ChatCompletionRequest, "best_of", 2),
                                               (P.ChatCompletionRequest, "echo", True)])
def test_unsupported_fields_stay_refused_with_their_message(model, field, value):
    body = {"prompt": "a"} if model is P.CompletionRequest else {"messages": [USER]}
    err = refusal(model, {**body, field: value})
    assert (err.param, err.code) == (field, "unsupported_parameter")
    assert err.message.endswith("is not supported by this server (it would change the output); remove it")
    assert err.message.startswith(f"{field}=")


def test_chat_only_unsupported_fields_are_refused_on_chat():
    for field, value in (("modalities", ["audio"]),):
        err = refusal(P.ChatCompletionRequest, {"messages": [USER], field: value})
        assert (err.param, err.code) == (field, "unsupported_parameter")
    # tools are chat's fields now (checked against the template by the endpoint), and unknown on completions
    chat = P.ChatCompletionRequest.model_validate({"messages": [USER], "tools": [{"type": "function"}],
                                                   "tool_choice": "auto"})
    assert chat.tools == [{"type": "function"}] and chat.tool_choice == "auto"
    for field, value in (("tools", [{"type": "function"}]), ("tool_choice", "auto")):
        err = refusal(P.CompletionRequest, {"prompt": "a", field: value})
        assert (err.param, err.code) == (field, "unsupported_parameter")


def test_neutral_values_and_metadata_are_accepted_and_ignored():
    body = {"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1,
            "echo": False, "suffix": "", "min_p": 0, "response_format": {"type": "text"}, "user": "u",
            "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "p",
            "safety_identifier": "s", "parallel_tool_calls": True}
    req = P.CompletionRequest.model_validate(body)
    assert req.prompt == "a"
    chat = P.ChatCompletionRequest.model_validate({"messages": [USER], "tools": [], "tool_choice": "none",
                                                   "modalities": ["text"]})
    assert chat.messages[0].content == "hi"


def test_an_unknown_field_is_refused_listing_the_supported_ones():
    err = refusal(P.CompletionRequest, {"prompt": "a", "temprature": 0})
    assert (err.param, err.code) == ("temprature", "unsupported_parameter")
    assert "unknown field 'temprature'" in err.message and "temperature" in err.message


def test_missing_required_fields_name_them():
    err = refusal(P.CompletionRequest, {"max_tokens": 3})
    assert (err.param, err.code) == ("prompt", "missing_required_parameter")
    assert "prompt is required" in err.message
    err = refusal(P.ChatCompletionRequest, {"model": "x"})
    assert (err.param, err.code) == ("messages", "missing_required_parameter")
    err = refusal(P.ChatCompletionRequest, {"messages": [USER, {"content": "x"}]})
    assert (err.param, err.code) == ("messages[1].role", "missing_required_parameter")
    err = refusal(TP.TraceRequest, {"temperature": 0})
    assert (err.param, err.code) == ("prompt", "missing_required_parameter")


def test_the_body_must_be_an_object():
    err = refusal(P.CompletionRequest, [1, 2])
    assert (err.param, err.code) == (None, "invalid_json") and "JSON object" in err.message


def test_prompts_and_contents_are_normalised():
    assert P.CompletionRequest.model_validate({"prompt": ["one"]}).prompt == "one"
    assert P.CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompt == [1, 2]
    assert P.CompletionRequest.model_validate({"prompt": [3, 4], "stop": "x"}).stop == ["x"]
    m = P.ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}], "name": "n"})
    assert m.content == "ab"


def test_union_member_names_are_not_part_of_param():
    assert param_of(("messages", 1, "role")) == "messages[1].role"
    assert param_of(("prompt", "list[int]", 0)) == "prompt[0]"
    assert param_of(("stop", "str")) == "stop"
    assert param_of(()) is None


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    ('{"prompt": "a", "user": -' + "1" * 5000 + "}", "user"),  # even in an ignored field
    ('{"messages": [{"role": "user", "content": "x", "name": [' + "7" * 4301 + "]}]}", "messages[0].name[0]"),
    ('{"prompt": "a", "temperature": NaN}', "temperature"),
    ('{"prompt": "a", "top_p": Infinity}', "top_p"),
    ("-" + "5" * 5000, None),
])
def test_a_number_python_cannot_read_is_a_400_naming_where_it_is(raw, param):
    with pytest.raises(APIError) as e:
        loads(raw.encode())
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    assert "digits" in e.value.message or "not a JSON number" in e.value.message


def test_loads_reads_ordinary_json():
    assert loads(b'{"a": [1, 2.5, "x", null, true], "b": ' + b"9" * 4300 + b"}")["a"] == [1, 2.5, "x", None, True]
    with pytest.raises(APIError) as e:
        loads(b"\xff\xfe")
    assert e.value.code == "invalid_json"


def test_settings_are_generate_s_with_this_server_s_limits():
    limits = ServeLimits(max_tokens=100, default_max_tokens=50, max_n=2, max_stop=2)
    s = settings_of(P.CompletionRequest.model_validate({"prompt": "a", "top_k": -1, "temperature": 0}), limits)
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.stop, s.n, s.logprobs) == (50, 0.0, None, None, (), 1,
                                                                                         None)
    assert settings_of(P.CompletionRequest.model_validate({"prompt": "a", "top_k": 0}), limits).top_k is None
    assert settings_of(P.CompletionRequest.model_validate({"prompt": "a"}), limits).temperature == 1.0
    chat = P.ChatCompletionRequest.model_validate({"messages": [USER], "max_tokens": 7, "max_completion_tokens": 9,
                                                   "logprobs": True, "top_logprobs": 3, "seed": 4})
    s = settings_of(chat, limits)
    assert (s.max_tokens, s.logprobs, s.seed) == (9, 3, 4)  # max_completion_tokens wins
    assert settings_of(P.ChatCompletionRequest.model_validate({"messages": [USER], "logprobs": True}),
                       limits).logprobs == 0


@pytest.mark.parametrize("body,param,code,words", [
    ({"prompt": "a", "max_tokens": 101}, "max_tokens", "max_tokens_limit", ["100", "--max-tokens"]),
    ({"prompt": "a", "n": 3}, "n", "n_limit", ["2"]),
    ({"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "invalid_value", ["3 strings", "at most 2"]),
])
def test_limits_are_400s_naming_the_field(body, param, code, words):
    with pytest.raises(APIError) as e:
        settings_of(P.CompletionRequest.model_validate(body), ServeLimits(max_tokens=100, max_n=2, max_stop=2))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert all(w in e.value.message for w in words), e.value.message


def test_responses_and_chunks_serialise_in_openai_s_shape():
    chunk = P.ChatCompletionChunk(id="c", created=1, model="m", choices=[
        P.ChatChunkChoice(index=0, delta=P.ChatDelta(content="x"))])
    d = chunk.model_dump(mode="json")
    assert d["object"] == "chat.completion.chunk" and d["choices"][0]["delta"] == {"content": "x"}
    assert d["choices"][0]["logprobs"] is None and d["choices"][0]["finish_reason"] is None
    assert P.ChatDelta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    err = P.ErrorResponse(error=P.ErrorDetail(message="m", type="t", param=None, code="c")).model_dump()
    assert err == {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}


def test_messages_quote_the_value_as_given():
    err = refusal(P.CompletionRequest, {"prompt": "a", "suffix": {"1": 2}})
    assert err.message.startswith('suffix={"1": 2} is not supported')


def test_the_trace_shapes_live_in_trace_protocol_alone():
    """decoderlab's own shapes moved to trace_protocol; protocol keeps no alias of them (and imports nothing of
    trace_protocol: no circle)."""
    for name in ("TraceRequest", "TraceResponse", "HeadRef", "TokenProb"):
        assert getattr(TP, name).__module__ == "decoderlab.serve.trace_protocol"
        assert not hasattr(P, name)
