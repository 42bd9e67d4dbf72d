"""Tool calls as text between <tool_call> and </tool_call> (decoderlab.chat.hermes): the chatml-tools template
renders as transformers' apply_chat_template renders it (text and ids, tools offered, calls, results), is
Qwen2.5-Instruct's template text but for SmolLM2's default system message, is SmolLM2-Instruct's own text without
tools (and so stands in for SmolLM2's template where tools come in), stores and reads back as itself; a reply's
calls parse back (one, several, malformed, not an object, unclosed), as the template wrote them; which templates
write calls so."""

import json

import pytest
from hf_chat_templates import CHATML_TOKENS, LLAMA32, QWEN3, QWEN25, SMOLLM2, bpe_pair
from tiny_runs import one_thread  # noqa: F401  (an autouse fixture)

from decoderlab.chat import (CHATML_TOOLS, JINJA_TEMPLATES, TEMPLATES, JinjaChatTemplate, ParsedCall,
                             arguments_as_objects, get_template, parse_hermes_calls, template_from_meta,
                             tools_template)
from decoderlab.chat.hermes import call_json

pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
WEATHER = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ADD = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And 2 + 2 = ?"},
        {"role": "assistant", "content": "4 — naïve café 日本語"}]
CONVERSATIONS = {
    "chat": CHAT,
    "system": [{"role": "system", "content": "You are terse. Réponds en français 😀"}] + CHAT,
    "one call": [{"role": "user", "content": "What is the weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [WEATHER]},
                 {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 22 degrees"},
                 {"role": "assistant", "content": "It is sunny in Paris: 22 degrees."}],
    "text, then two calls (arguments as text and as an object)": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris, and 2 + 2?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [WEATHER, ADD]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "assistant", "content": "Sunny, and 4."}],
}


def pair(plain=()):
    """chatml-tools with SmolLM2's control tokens; ``plain``: <tool_call> and </tool_call> as ordinary added
    tokens too, as Qwen's tokenizer has them (SmolLM2's spells them in pieces)."""
    ours, theirs = bpe_pair(CHATML_TOKENS, plain, {"eos_token": "<|im_end|>"}, chat_template=CHATML_TOOLS)
    return get_template("chatml-tools"), ours, theirs


@pytest.mark.parametrize("plain", [(), ("<tool_call>", "</tool_call>")], ids=["smollm2 tokens", "qwen tokens"])
def test_chatml_tools_is_transformers_apply_chat_template(plain):
    template, ours, theirs = pair(plain)
    for what, conv in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for prompt in (False, True):
                messages = conv[:-1] if prompt else conv  # a prompt ends where the assistant answers
                args = dict(tools=tools, add_generation_prompt=prompt)
                text = theirs.apply_chat_template(messages, tokenize=False, **args)
                assert template.render_text(messages, **args) == text, (what, tools, prompt)
                ids, mask = template.render(messages, ours, **args)
                assert ids == theirs.apply_chat_template(messages, return_dict=False, **args), (what, tools, prompt)
                assert len(mask) == len(ids) and ours.decode(ids) == text


def test_what_chatml_tools_writes():
    template = get_template("chatml-tools")
    text = template.render_text(CONVERSATIONS["text, then two calls (arguments as text and as an object)"],
                                tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>" in system  # one schema a line
    assert rest == ('<|im_start|>user\nWeather in Paris, and 2 + 2?<|im_end|>\n'
                    '<|im_start|>assistant\nLet me check.\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n'  # both results: one user turn
                    '<tool_response>\n4\n</tool_response><|im_end|>\n'
                    '<|im_start|>assistant\nSunny, and 4.<|im_end|>\n')


#: the default system messages of Qwen2.5-Instruct's template and of SmolLM2-Instruct's
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_chatml_tools_is_qwen25s_template_with_smollm2s_default_system_message():
    """Qwen2.5-Instruct's real template, rendered by transformers, for every conversation (tools offered or not,
    calls, several results, the generation prompt): the same text, but for the default system message."""
    template, _, _ = pair()
    _, qwen = bpe_pair(CHATML_TOKENS, (), {"eos_token": "<|im_end|>"}, chat_template=QWEN25)
    for what, conv in CONVERSATIONS.items():
        conv = arguments_as_objects(conv)  # (Qwen2.5 quotes arguments given as text; chatml-tools writes them)
        for tools in (None, TOOLS):
            for prompt in (False, True):
                messages = conv[:-1] if prompt else conv
                args = dict(tools=tools, add_generation_prompt=prompt)
                want = qwen.apply_chat_template(messages, tokenize=False, **args)
                assert template.render_text(messages, **args) == want.replace(QWEN25_SYSTEM, SMOLLM2_SYSTEM), \
                    (what, tools, prompt)
                assert (QWEN25_SYSTEM in want) == (messages[0]["role"] != "system")  # the one difference was there


def test_without_tools_chatml_tools_is_smollm2s_own_template():
    """A SmolLM2-Instruct conversation renders to the same text, so the switch changes nothing without tools."""
    template, smollm2 = get_template("chatml-tools"), JinjaChatTemplate(SMOLLM2)
    for what in ("chat", "system"):
        for prompt in (False, True):
            conv = CONVERSATIONS[what][:-1] if prompt else CONVERSATIONS[what]
            assert (template.render_text(conv, add_generation_prompt=prompt)
                    == smollm2.render_text(conv, add_generation_prompt=prompt)), (what, prompt)


def test_chatml_tools_stands_in_for_smollm2s_template_only_where_tools_come_in():
    """SmolLM2's ChatML (as the test data writes it, and as its GGUF file does: line breaks in the text) is given
    chatml-tools; a template that writes calls keeps its own; one that writes none and that chatml-tools would
    change -- a ChatML without SmolLM2's default system message, Llama 3.2's, Gemma's, decoderlab's -- is kept,
    to be refused by name."""
    chatml_tools = get_template("chatml-tools")
    for source in (SMOLLM2, SMOLLM2.replace("\\n", "\n")):
        assert tools_template(JinjaChatTemplate(source, name="gguf:smollm2")) == chatml_tools
    plain_chatml = SMOLLM2.replace("{% if loop.first and messages[0]['role'] != 'system' %}", "{% if false %}")
    assert plain_chatml != SMOLLM2
    kept = [JinjaChatTemplate(s) for s in (QWEN25, QWEN3, LLAMA32, plain_chatml)]
    kept += [get_template("gemma"), TEMPLATES["decoderlab"], TEMPLATES["tools"], chatml_tools]
    for template in kept:
        assert tools_template(template) is template, template.name
    assert tools_template(None) is None


def test_the_mask_covers_the_calls_and_answers_not_the_results():
    template, ours, _ = pair()
    ids, mask = template.render(CONVERSATIONS["one call"], ours, tools=TOOLS)
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [False]):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [ours.decode(cur)], []
    assert runs == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                    "It is sunny in Paris: 22 degrees.<|im_end|>"]


def test_chatml_tools_is_stored_and_read_back_by_name():
    template = get_template("chatml-tools")
    assert list(JINJA_TEMPLATES) == ["chatml-tools", "gemma"] and template.name == "chatml-tools"
    assert template_from_meta({"chat_template": template.to_dict()}) == template
    with pytest.raises(ValueError, match="known templates: decoderlab, lesson, tools, chatml-tools"):
        get_template("chatml")


PARSES = [
    ("one call", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "", [ParsedCall("add", '{"a": 1, "b": 2}')]),
    ("text around several calls",
     'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\nDone.',
     "Let me see.\nDone.", [ParsedCall("add", '{"a": 1}'), ParsedCall("get_weather", '{"city": "Zürich"}')]),
    ("no arguments", '<tool_call>{"name": "now"}</tool_call>', "", [ParsedCall("now", "{}")]),
    ("arguments as text", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [ParsedCall("add", '{"a": 1}')]),
    ("no closer: the turn ended inside the block", 'ok <tool_call>\n{"name": "add", "arguments": {}}', "ok",
     [ParsedCall("add", "{}")]),
    ("malformed JSON", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "",
     [ParsedCall("add", '{"name": "add", "arguments": {"a": 1,}}',
                 "the tool call is not valid JSON (Expecting property name enclosed in double quotes at character "
                 '37): {"name": "add", "arguments": {"a": 1,}}')]),
    ("not an object with a name", "<tool_call>[1, 2]</tool_call>", "",
     [ParsedCall("", "[1, 2]", 'the tool call must be a JSON object {"name": ..., "arguments": {...}}, got [1, 2]')]),
    ("arguments not an object", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "",
     [ParsedCall("add", "[1]", "the arguments of a tool call must be a JSON object, got [1]")]),
    ("no call", "It is 4.", "It is 4.", []),
]


@pytest.mark.parametrize("text, content, calls", [p[1:] for p in PARSES], ids=[p[0] for p in PARSES])
def test_a_reply_parses_back_into_content_and_calls(text, content, calls):
    assert parse_hermes_calls(text) == (content, calls)


@pytest.mark.parametrize("source", [CHATML_TOOLS, QWEN25], ids=["chatml-tools", "qwen2.5"])
def test_what_a_template_writes_parses_back_to_the_calls(source):
    """The assistant turn as the template renders it, read back: the calls given (arguments as objects)."""
    template = JinjaChatTemplate(source)
    conv = CONVERSATIONS["text, then two calls (arguments as text and as an object)"]
    conv = arguments_as_objects(conv)  # Hugging Face templates read arguments as objects (Qwen2.5 quotes text)
    head = template.render_text(conv[:2], tools=TOOLS, add_generation_prompt=True)
    turn = template.render_text(conv[:3], tools=TOOLS)[len(head):].split("<|im_end|>")[0]
    content, calls = parse_hermes_calls(turn)
    assert content == "Let me check." and calls == [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                    ParsedCall("add", '{"a": 2, "b": 2}')]
    assert turn.endswith("\n".join("<tool_call>\n" + call_json(c.name, c.arguments) + "\n</tool_call>"
                                   for c in calls))


def test_the_templates_that_write_calls_as_text_are_found_by_rendering_one():
    found = {name: JinjaChatTemplate(s).tool_call_format
             for name, s in [("chatml-tools", CHATML_TOOLS), ("qwen2.5", QWEN25), ("qwen3", QWEN3),
                             ("smollm2", SMOLLM2), ("llama3.2", LLAMA32)]}
    assert found == {"chatml-tools": "hermes", "qwen2.5": "hermes", "qwen3": "hermes", "smollm2": None,
                     "llama3.2": None}
    assert TEMPLATES["tools"].tool_call_format == "tokens" and TEMPLATES["decoderlab"].tool_call_format is None


def test_openai_arguments_as_text_render_as_objects():
    """Qwen2.5's template writes ``arguments | tojson``: OpenAI's JSON text would be written quoted."""
    qwen = JinjaChatTemplate(QWEN25)
    as_text = CONVERSATIONS["one call"]
    as_text = [dict(m, tool_calls=[dict(WEATHER, function={"name": "get_weather", "arguments": '{"city": "Paris"}'})])
               if m.get("tool_calls") else m for m in as_text]
    assert '"arguments": "{\\"city\\"' in qwen.render_text(as_text)  # quoted, as transformers writes it
    assert qwen.render_text(arguments_as_objects(as_text)) == qwen.render_text(CONVERSATIONS["one call"])
    kept = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    assert arguments_as_objects(kept) == kept  # text that is no JSON object stays text


def test_exported_with_the_model_it_renders_in_transformers_and_its_calls_are_read(tmp_path):
    """A model with chatml-tools exported as a Hugging Face directory: tokenizer_config.json's chat_template is the
    template, AutoTokenizer renders a conversation with tools and calls to decoderlab's ids, and the directory
    loads back with a template whose calls decoderlab reads."""
    import torch
    from transformers import AutoTokenizer

    import decoderlab as dl
    from decoderlab.chat import load_model
    from decoderlab.export import to_hf

    template, tok, _ = pair(("<tool_call>", "</tool_call>"))
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2,
                                                max_len=64, d_ff=32))
    to_hf(model, tok, tmp_path / "hf", template=template)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHATML_TOOLS
    conv = CONVERSATIONS["text, then two calls (arguments as text and as an object)"]
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (auto.apply_chat_template(conv, tools=TOOLS, return_dict=False)
            == template.render(conv, tok, tools=TOOLS)[0])
    loaded = load_model(tmp_path / "hf")
    assert loaded.template.source == CHATML_TOOLS and loaded.template.tool_call_format == "hermes"
