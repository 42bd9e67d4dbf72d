"""Tool calls written as text, the way Qwen2.5, Qwen3 and Hermes 2 Pro write them (vLLM's ``hermes`` tool parser):
an assistant turn holds each call as a JSON object between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 + 7"}}
    </tool_call>

This module is that format's text, in both directions: :data:`CHATML_TOOLS`, decoderlab's ``chatml-tools``
template (SmolLM2-Instruct's ChatML with tools, calls and results, Jinja that ``transformers`` renders);
:func:`parse_hermes_calls`, a reply's text back into its content and calls (what ``decoderlab chat --tools``, the
tool loop and the server read); :func:`writes_hermes_calls`, whether a template writes calls this way (found by
rendering one); and :func:`arguments_as_objects`, OpenAI's messages (arguments as JSON text) as Hugging Face
templates read them (arguments as objects, vLLM's rule).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

#: what opens and closes a call in the text
OPENER, CLOSER = "<tool_call>", "</tool_call>"
#: what an assistant turn writes right after the opener (and before the closer)
CALL_BREAK = "\n"
#: the name of the format (``tool_call_format`` of a template that writes calls this way)
HERMES = "hermes"
#: the name of decoderlab's template of this format
CHATML_TOOLS_NAME = "chatml-tools"

#: SmolLM2-Instruct's default system message (its chat template writes it when the conversation has none)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: ``chatml-tools``: SmolLM2-Instruct's ChatML with Qwen2.5-Instruct's tool calls -- Qwen2.5's template text
#: (Qwen/Qwen2.5-*-Instruct's ``tokenizer_config.json``) with SmolLM2's default system message, so a conversation
#: without tools renders as SmolLM2's own template renders it. With tools, the system turn lists them (one JSON
#: schema a line between <tools> and </tools>) and says how to call one; an assistant turn writes its text, then
#: each call as ``{"name": ..., "arguments": {...}}`` between <tool_call> and </tool_call>; the tool results that
#: answer one assistant turn are one user turn, each between <tool_response> and </tool_response>. Beyond Qwen2.5's:
#: arguments given as JSON text (OpenAI's form) are written as they are (Qwen2.5's would quote them), a missing or
#: null content is empty text, and an empty conversation without tools renders nothing (as SmolLM2's).
CHATML_TOOLS = r"""{#- decoderlab's chatml-tools: SmolLM2's ChatML with Qwen2.5's tool calls -#}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] if messages[0]['content'] is string else '' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = '""" + SMOLLM2_SYSTEM + r"""' %}
    {%- set turns = messages %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' + system + '\n\n# Tools\n\nYou may call one or more functions to assist with the '
        + 'user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        + '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        + '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in turns %}
    {%- set content = message['content'] if message['content'] is string else '' %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if content %}
            {{- '\n' + content }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set fn = call['function'] if call['function'] is defined else call %}
            {{- '\n<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' }}
            {%- if fn['arguments'] is string %}
                {{- fn['arguments'] if fn['arguments'] | trim else '{}' }}
            {%- elif fn['arguments'] is defined %}
                {{- fn['arguments'] | tojson }}
            {%- else %}
                {{- '{}' }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or turns[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or turns[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

#: a call's block: from an opener to its closer, or to the end of the text (a reply that ended inside it)
_BLOCK = re.compile(re.escape(OPENER) + r"(.*?)(?:" + re.escape(CLOSER) + r"|\Z)", re.DOTALL)
#: a name in text that is not JSON, to name the call that failed
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')


@dataclass(frozen=True)
class ParsedCall:
    """One call read from a reply: the function's ``name`` ("" when none could be read), its ``arguments`` as
    JSON text (``json.dumps`` of the object; the block's own text when it is not JSON) and ``error`` -- None, or
    why the call cannot run (the text is not a JSON object with a name; the arguments are not an object)."""

    name: str
    arguments: str
    error: str | None = None


def _parsed(body: str) -> ParsedCall:
    text = body.strip()
    try:
        call = json.loads(text)
    except json.JSONDecodeError as e:
        name = _NAME.search(text)
        return ParsedCall(name.group(1) if name else "", text,
                          f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {text[:200]}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ParsedCall("", text, f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                                    f"got {text[:200]}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # arguments given as JSON text: kept as they are
        return ParsedCall(call["name"], arguments)
    if not isinstance(arguments, dict):
        return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False),
                          f"the arguments of a tool call must be a JSON object, got {json.dumps(arguments)[:200]}")
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """A reply's text as ``(content, calls)``: each ``<tool_call> ... </tool_call>`` block is a call (the last
    may lack its closer: a model that ended its turn without it), ``content`` is the text outside the blocks
    (each piece stripped, joined by a line break). A block that is not a JSON object ``{"name": ...,
    "arguments": {...}}`` is a call with an ``error``, never an exception: the tool loop answers it with an error
    result and the conversation goes on.
    """
    blocks = list(_BLOCK.finditer(text))
    outside = [text[a.end() if a else 0:b.start() if b else len(text)]
               for a, b in zip([None, *blocks], [*blocks, None])]
    return "\n".join(p.strip() for p in outside if p.strip()), [_parsed(m.group(1)) for m in blocks]


def call_json(name: str, arguments: str | Mapping) -> str:
    """A call as the template writes it between the opener and the closer: ``{"name": NAME, "arguments": ARGS}``
    (arguments given as JSON text written as they are, as the ``chatml-tools`` template does)."""
    args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments), ensure_ascii=False)
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + (args.strip() or "{}") + "}"


def arguments_as_objects(messages: Sequence[Mapping]) -> list[dict]:
    """The messages with each assistant call's ``arguments`` given as JSON text (OpenAI's form) turned into the
    object it holds, as Hugging Face templates read them (``tojson`` on a text would write it quoted; vLLM turns
    them so too). Arguments that are not a JSON object stay text."""
    out = []
    for m in messages:
        if isinstance(m, Mapping) and m.get("tool_calls"):
            m = dict(m, tool_calls=[_object_call(c) for c in m["tool_calls"]])
        out.append(m)
    return out


def _object_call(call):
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        return call
    return dict(call, function=dict(fn, arguments=arguments)) if isinstance(arguments, dict) else call


#: the probe conversation that shows how a template writes a call
_PROBE_NAME, _PROBE_ARGUMENTS = "decoderlab_probe", {"probe": 1}
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "a probe",
                                                  "parameters": {"type": "object", "properties": {
                                                      "probe": {"type": "integer"}}}}}]
_PROBE = [{"role": "user", "content": "probe"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_0", "type": "function", "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "1"}]


def writes_hermes_calls(render_text: Callable[..., str]) -> bool:
    """Whether a template writes tool calls in this format: ``render_text`` (a template's
    ``render_text(messages, tools=...)``) renders a conversation with one call, and the rendering holds that
    call between ``<tool_call>`` and ``</tool_call>`` as this module reads it back. A template that raises on it
    does not."""
    try:
        text = render_text(_PROBE, tools=_PROBE_TOOLS)
    except ValueError:
        return False
    return any(c.error is None and c.name == _PROBE_NAME and _loads(c.arguments) == _PROBE_ARGUMENTS
               for c in parse_hermes_calls(text)[1])


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
