"""Tool calls on /v1/chat/completions through the official ``openai`` client against a real uvicorn: ``tools``
+ ``tool_choice`` ("required", a named function, "auto", "none"), the call's arguments valid against the
function's schema (a grammar), ``tool_calls`` + ``finish_reason: "tool_calls"`` as OpenAI returns and streams
them ("stop" for a function forced by name, as OpenAI's), tool results in the conversation, and each bad tool
field a 400 naming it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import decoderlab as dl  # noqa: E402
from decoderlab.chat import ToolSet, get_template  # noqa: E402

from .helpers import MODEL_ID, client  # noqa: E402

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
MUL = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": ADD}},
         {"type": "function", "function": {"name": "mul", "parameters": MUL}}]
SCHEMAS = {"add": ADD, "mul": MUL}
ASK = [{"role": "user", "content": "17+25?"}]


def tool_call_token(tok) -> int:
    return get_template("tools").tool_call_id(tok)


def test_required_calls_a_function_with_valid_arguments_equal_to_the_librarys(tools_server, tools_model):
    model, tok = tools_model
    c = client(tools_server)
    ids, _ = get_template("tools").render(ASK, tok, add_generation_prompt=True, tools=TOOLS)
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                                      max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        # the library's generation from the same prompt and <|tool_call|>, under the call grammar, writes the same
        ref = dl.generate(model, ids + [tool_call_token(tok)], 120, seed=seed, tokenizer=tok,
                          grammar=ToolSet.of(TOOLS).grammar())
        assert tok.decode(ref, skip_special=True) == f"{call.function.name} {call.function.arguments}"


def test_a_named_function_is_the_one_called_and_the_turn_finishes_with_stop(tools_server):
    """A function forced by name finished with "tool_calls"; OpenAI answers "stop" there (and "tool_calls" for
    "required" and "auto"), streamed and not -- vLLM changed to match it."""
    c = client(tools_server)
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, seed=0, max_tokens=60,
              tool_choice={"type": "function", "function": {"name": "mul"}})
    r = c.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "mul" and json.loads(call.function.arguments) in ({"x": True}, {"x": False})
    assert r.choices[0].finish_reason == "stop"
    finishes = [ch.finish_reason for chunk in c.chat.completions.create(**kw, stream=True) for ch in chunk.choices
                if ch.finish_reason]
    assert finishes == ["stop"]


def test_auto_calls_when_the_model_opens_a_call_and_none_never_does(tools_server, tools_model):
    _, tok = tools_model
    c = client(tools_server)
    tc = str(tool_call_token(tok))
    # auto: a model that opens a call (its first token, pushed by the bias) writes one under the grammar
    r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, seed=1, max_tokens=80,
                                  logit_bias={tc: 100})
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # auto: a model that does not open one answers in text
    r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, seed=1, max_tokens=20,
                                  logit_bias={tc: -100})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content
    # none: no call even when the bias pushes for one
    r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="none", seed=1,
                                  max_tokens=20, logit_bias={tc: 100})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_streamed_call_is_the_non_streamed_one_in_openai_s_pieces(tools_server):
    c = client(tools_server)
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", seed=2, max_tokens=120)
    whole = c.chat.completions.create(**kw).choices[0]
    deltas, finish = [], None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == whole.message.tool_calls[0].function.name and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.function.arguments for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert finish == "tool_calls"


def test_a_tool_result_is_rendered_and_answered(tools_server, tools_model):
    _, tok = tools_model
    c = client(tools_server)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice="none", seed=0,
                                  max_tokens=5)
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == len(get_template("tools").render(messages, tok, add_generation_prompt=True,
                                                                    tools=TOOLS)[0])


BAD_TOOLS = [
    # (body fields, param)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "div"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "n": 2}, "n"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "assistant", "content": "x"},
                                         {"role": "tool", "tool_call_id": "call_9", "content": "42"}]},
     "messages[2].tool_call_id"),
]


@pytest.mark.parametrize("fields,param", BAD_TOOLS, ids=[b[1] for b in BAD_TOOLS])
def test_bad_tool_fields_are_400s_naming_them(tools_server, fields, param):
    r = httpx.post(tools_server + "/v1/chat/completions", json={"messages": ASK, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert httpx.get(tools_server + "/health").status_code == 200  # it keeps serving


def test_tools_on_a_template_without_tool_tokens_are_a_400(chat_server):
    url, _ = chat_server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS},
                   headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tools" in r.json()["error"]["message"]


def test_the_openai_client_runs_the_calculator_and_gets_a_final_answer(tools_server, tools_model):
    """The whole loop as an OpenAI client drives it: a request with tools -> tool_calls -> the client runs the
    tool (decoderlab's calculator) -> a tool message -> the final answer in text."""
    from decoderlab.chat import TOOLS, calculate

    c = client(tools_server)
    calculator = [TOOLS["calculator"].definition]
    messages = [{"role": "user", "content": "What is 4821 * 377?"}]
    quote = str(tools_model[1].token_to_id['"'])  # the untrained model closes its strings at once
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=calculator, tool_choice="required",
                                  seed=0, max_tokens=60, logit_bias={quote: 100})
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "calculator" and set(json.loads(call.function.arguments)) == {"expression"}
    result = calculate(call.function.arguments)  # client-side, as an application runs its tools
    assert result == calculate(json.loads(call.function.arguments))
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    model, tok = tools_model
    no_end = {str(i): -100 for i in tok.end_of_text_ids}  # the untrained model would end its text at once
    final = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=calculator, tool_choice="none",
                                      temperature=0, max_tokens=20, logit_bias=no_end)
    choice = final.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length" and choice.message.content
    # the answer continues the conversation holding the call and its result, as the library renders it
    ids, _ = get_template("tools").render(messages, tok, add_generation_prompt=True, tools=calculator)
    assert tok.decode(ids).count(result) == 1
    ref = dl.generate(model, ids, 20, temperature=0, tokenizer=tok,
                      logit_bias={int(k): v for k, v in no_end.items()} | {tool_call_token(tok): -100})
    assert choice.message.content == tok.decode(ref, skip_special=True)


# -- a Hugging Face template that writes calls as <tool_call> blocks (chatml-tools, Qwen2.5's) ---------------------

def hermes_prompt(template, tok, messages, tools=TOOLS) -> list[int]:
    from decoderlab.chat import arguments_as_objects

    return template.render(arguments_as_objects(messages), tok, add_generation_prompt=True, tools=tools)[0]


def test_tools_on_a_template_that_writes_tool_call_blocks_answer_with_tool_calls(hermes_server):
    """The 400 is gone: "required" writes a call under the grammar, in the template's JSON, equal to the library's
    generation from the prompt and the opener the template writes ("<tool_call>\\n")."""
    from decoderlab.chat.hermes import call_json
    from decoderlab.chat.jinja import encode_with_offsets

    url, model, tok, template, _ = hermes_server
    c = client(url)
    head = hermes_prompt(template, tok, ASK) + encode_with_offsets(tok, "<tool_call>\n")[0]
    for seed in range(2):
        r = c.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                                      max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        ref = dl.generate(model, head, 120, seed=seed, tokenizer=tok,
                          grammar=ToolSet.of(TOOLS).grammar(format="hermes"))
        assert tok.decode(ref, skip_special=True) == call_json(call.function.name, call.function.arguments)


def test_auto_calls_when_the_model_opens_a_call_block_and_none_never_does(hermes_server):
    url, _, tok, _, _ = hermes_server
    c = client(url)
    opener = str(tok.token_to_id["<tool_call>"])
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, seed=1, max_tokens=80)
    r = c.chat.completions.create(**kw, logit_bias={opener: 100})  # the model opens a call at once
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    r = c.chat.completions.create(**kw, logit_bias={opener: -100})  # a model that does not: an answer in text
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content
    r = c.chat.completions.create(**kw, tool_choice="none", logit_bias={opener: 100})  # the opener is banned
    assert r.choices[0].message.tool_calls is None and "<tool_call>" not in r.choices[0].message.content


def test_a_streamed_call_block_is_the_non_streamed_call_in_openai_s_pieces(hermes_server):
    url = hermes_server[0]
    c = client(url)
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              seed=3, max_tokens=120)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls[0].function.name == "add"
    deltas, finish = [], None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "add"
    assert all(d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.function.arguments for d in deltas) == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(whole.message.tool_calls[0].function.arguments), ADD)
    assert finish == "stop"


def test_a_call_and_its_result_are_rendered_as_transformers_renders_them(hermes_server):
    """OpenAI's arguments (JSON text) reach the template as an object, as transformers wants them (and vLLM
    gives them): the prompt is transformers' apply_chat_template of the conversation."""
    url, model, tok, template, theirs = hermes_server
    c = client(url)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice="none", seed=0,
                                  max_tokens=5)
    as_objects = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        dict(call, function={"name": "add", "arguments": {"a": 17, "b": 25}})]}, messages[-1]]
    want = theirs.apply_chat_template(as_objects, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert r.usage.prompt_tokens == len(want) == len(hermes_prompt(template, tok, messages))
    assert '"arguments": {"a": 17, "b": 25}}' in tok.decode(want)


# -- SmolLM2-Instruct's own template, which writes no calls: served with chatml-tools when tools come ---------------

def test_smollm2s_template_answers_tools_with_the_calculator_call_its_model_writes(smollm2_server):
    """The 400 is gone for SmolLM2's ChatML: "auto" -- the model opens <tool_call> in its tokenizer's pieces --
    answers with the call and finish_reason "tool_calls", streamed as the same call in OpenAI's pieces; the
    client runs the calculator and sends the result back, rendered as transformers renders chatml-tools (the
    result in a user turn, Qwen2.5's layout); a request without tools is rendered by SmolLM2's own template."""
    from decoderlab.chat import TOOLS, calculate, get_template

    url, _, tok, theirs = smollm2_server
    c = client(url)
    calculator = [TOOLS["calculator"].definition]
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    kw = dict(model=MODEL_ID, messages=messages, tools=calculator, temperature=0, max_tokens=100)
    choice = c.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "12+7"})
    deltas, finish = [], None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and deltas[0].function.name == "calculator"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    result = calculate(call.function.arguments)  # client-side, as an application runs its tools
    assert result == "19"
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, tools=calculator, tool_choice="none",
                                  temperature=0, max_tokens=5)
    as_objects = messages[:1] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+7"}}}]},
        messages[-1]]
    want = theirs.apply_chat_template(as_objects, tools=calculator, add_generation_prompt=True, return_dict=False,
                                      chat_template=get_template("chatml-tools").source)  # transformers' rendering
    assert r.usage.prompt_tokens == len(want)
    assert tok.decode(want).endswith(
        "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    plain = c.chat.completions.create(model=MODEL_ID, messages=messages[:1], temperature=0, max_tokens=1)
    assert plain.usage.prompt_tokens == len(theirs.apply_chat_template(messages[:1], add_generation_prompt=True,
                                                                       return_dict=False))
    assert c.models.retrieve(MODEL_ID).model_extra["chat_template"] == "smollm2"  # the model's own, as served
