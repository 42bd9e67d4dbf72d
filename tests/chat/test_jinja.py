"""Hugging Face chat templates: real templates (SmolLM2's and Qwen2.5's ChatML, Qwen3's tools and <think>
blocks, Llama 3's and Llama 3.2's headers and dates, one with {% generation %} blocks) rendered to the text and ids
transformers' apply_chat_template makes, the loss mask on the assistant's text, the sandbox and its globals,
errors named, and the stored and read-back template."""

import json
from datetime import datetime

import pytest
from hf_chat_templates import CHATML_GENERATION, CHATML_TOKENS, LLAMA32, MODELS, QWEN3, SMOLLM2, bpe_pair
from tiny_runs import one_thread  # noqa: F401  (an autouse fixture)

from decoderlab.chat import JinjaChatTemplate, get_template, read_chat_template, template_from_meta
from decoderlab.checkpoint import CHAT_TEMPLATE_KEY
from decoderlab.tokenizers import CharTokenizer

pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "a city, e.g. Paris"}},
                                               "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "You are terse. Réponds en français 😀"},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "  Paris.  "},
        {"role": "user", "content": "And 2 + 2 = ?\nThink step by step."},
        {"role": "assistant", "content": "4 — naïve café 日本語"}]
TOOL_CHAT = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_0", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 22 degrees"},
             {"role": "assistant", "content": "It is sunny in Paris: 22 degrees."}]
THINKING = [{"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "3 + 3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "add them again"}]
#: Llama 3.2 writes today's date unless given one (tested apart: test_strftime_now_is_todays_date)
VARIABLES = {"llama3.2": {"date_string": "26 Jul 2024"}}


def pair(model):
    source, specials, plain, tokens = MODELS[model]
    ours, theirs = bpe_pair(specials, plain, tokens, chat_template=source)
    return JinjaChatTemplate(source, name=model, tokens=tokens), ours, theirs


def conversations(model):
    yield "chat", CHAT, None
    yield "no system", CHAT[1:], None
    yield "tools", TOOL_CHAT, TOOLS
    yield "tools offered, not called", CHAT[1:], TOOLS
    if model == "qwen3":
        yield "thinking", THINKING, None


@pytest.mark.parametrize("model", list(MODELS))
def test_text_and_ids_are_transformers_apply_chat_template(model):
    template, ours, theirs = pair(model)
    variables = VARIABLES.get(model, {})
    for what, conv, tools in conversations(model):
        for prompt in (False, True):
            messages = conv[:-1] if prompt else conv  # a prompt ends where the assistant answers
            args = dict(tools=tools, add_generation_prompt=prompt, **variables)
            text = theirs.apply_chat_template(messages, tokenize=False, **args)
            assert template.render_text(messages, **args) == text, (what, prompt)
            ids, mask = template.render(messages, ours, **args)
            assert ids == theirs.apply_chat_template(messages, return_dict=False, **args), (what, prompt)
            assert len(mask) == len(ids) and ours.decode(ids) == text


def test_qwen3_thinking_switch_and_reasoning_field_as_transformers():
    template, ours, theirs = pair("qwen3")
    for variables in ({"enable_thinking": False}, {"enable_thinking": True}):
        args = dict(add_generation_prompt=True, **variables)
        assert template.render_text(THINKING[:-1], **args) == theirs.apply_chat_template(THINKING[:-1],
                                                                                          tokenize=False, **args)
    text = template.render_text(THINKING)
    assert "<think>\nadd them again\n</think>\n\n6<|im_end|>" in text  # the last turn keeps its reasoning
    assert "<think>\nadd them\n</think>" not in text  # an earlier one drops it


def runs(ids, mask, tokenizer):
    """The supervised runs of a mask, decoded."""
    out, cur = [], []
    for i, m in zip(ids + [None], mask + [False]):
        if m:
            cur.append(i)
        elif cur:
            out.append(tokenizer.decode(cur))
            cur = []
    return out


@pytest.mark.parametrize("model, eot, expected", [
    ("smollm2", "<|im_end|>", ["  Paris.  <|im_end|>", "4 — naïve café 日本語<|im_end|>"]),
    ("qwen2.5", "<|im_end|>", ["  Paris.  <|im_end|>", "4 — naïve café 日本語<|im_end|>"]),
    ("qwen3", "<|im_end|>", ["  Paris.  <|im_end|>", "<think>\n\n</think>\n\n4 — naïve café 日本語<|im_end|>"]),
    ("llama3", "<|eot_id|>", ["Paris.<|eot_id|>", "4 — naïve café 日本語<|eot_id|>"]),
    ("llama3.2", "<|eot_id|>", ["Paris.<|eot_id|>", "4 — naïve café 日本語<|eot_id|>"]),
])
def test_the_mask_is_each_assistant_turn_and_its_end_of_turn(model, eot, expected):
    template, ours, _ = pair(model)
    assert template.end_of_turn(ours) == eot and template.end_of_turn_id(ours) == ours.token_to_id[eot]
    ids, mask = template.render(CHAT, ours, **VARIABLES.get(model, {}))
    assert runs(ids, mask, ours) == expected


@pytest.mark.parametrize("model, expected", [
    ("qwen2.5", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                 "It is sunny in Paris: 22 degrees.<|im_end|>"]),
    ("llama3.2", ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                  "It is sunny in Paris: 22 degrees.<|eot_id|>"]),
])
def test_the_mask_covers_tool_calls_not_tool_results(model, expected):
    template, ours, _ = pair(model)
    ids, mask = template.render(TOOL_CHAT, ours, tools=TOOLS, **VARIABLES.get(model, {}))
    assert runs(ids, mask, ours) == expected


def test_generation_blocks_give_transformers_assistant_mask():
    template, ours, theirs = pair("generation")
    assert template.has_generation_blocks
    for conv in (CHAT, CHAT[1:], CHAT[:-1]):
        ids, mask = template.render(conv, ours)
        out = theirs.apply_chat_template(conv, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"] and [int(m) for m in mask] == out["assistant_masks"]
        assert any(mask) == (conv[-1]["role"] == "assistant" or len(conv) > 3)


def test_continue_final_message_is_transformers():
    template, ours, theirs = pair("smollm2")
    prefill = CHAT[:-1] + [{"role": "assistant", "content": "The answer is "}]
    text = theirs.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert template.render_text(prefill, continue_final_message=True) == text
    ids, mask = template.render(prefill, ours, continue_final_message=True)
    assert ids == theirs.apply_chat_template(prefill, continue_final_message=True, return_dict=False)
    assert not any(mask) and text.endswith("The answer is ")
    with pytest.raises(ValueError, match="cannot be combined"):
        template.render_text(prefill, continue_final_message=True, add_generation_prompt=True)


def test_strftime_now_is_todays_date():
    template, _, theirs = pair("llama3.2")
    before = datetime.now().strftime("%d %b %Y")
    text = template.render_text(CHAT[1:2])
    assert f"Today Date: {before}\n" in text or f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text


def test_the_helpers_are_transformers(tmp_path):
    source = ("{{ messages|tojson }}|{{ tools|tojson(indent=2) }}|{{ {'b': 1, 'a': '<é>'}|tojson(sort_keys=true) }}|"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(x=1)|tojson }}|{{ bos_token }}{{ eos_token }}|"
              "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.role }}{% endfor %}\n"
              "{% for m in messages %}\n    {% if m.role == 'system' %}\n{{ m.content }}\n    {% endif %}\n"
              "{% endfor %}\n"
              "{% for d in documents %}{{ d.title }}: {{ d.text }}{% endfor %}|{{ strftime_now('%Y') }}")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    ours, theirs = bpe_pair(["<s>", "</s>"], tokens=tokens, chat_template=source)
    template = JinjaChatTemplate(source, tokens=tokens)
    args = dict(tools=TOOLS, documents=[{"title": "Paris", "text": "the capital"}], add_generation_prompt=False)
    assert template.render_text(CHAT, **args) == theirs.apply_chat_template(CHAT, tokenize=False, **args)


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "the 'jinja' chat template raised: Conversation roles must alternate user/assistant"),
    ("{{ messages[0].content + none }}", "the 'jinja' chat template failed: TypeError"),
    ("{{ ''.__class__.__mro__ }}", "the 'jinja' chat template raised: access to attribute '__class__'"),
    ("{% set ns = namespace(_x=1) %}", "the 'jinja' chat template raised: chat templates cannot store "
                                       "underscore-prefixed attributes"),
    ("{{ messages.append(1) }}", "the 'jinja' chat template raised: access to attribute 'append'"),
])
def test_a_template_that_raises_is_one_value_error_naming_it(source, message):
    tok = CharTokenizer.from_text("abc")
    template = JinjaChatTemplate(source)
    with pytest.raises(ValueError) as e:
        template.render([{"role": "user", "content": "a"}], tok)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_bad_jinja_and_missing_tokens_are_said():
    with pytest.raises(ValueError, match=r"the 'mine' chat template is not valid Jinja: .*\(line 2\)"):
        JinjaChatTemplate("{% for m in messages %}\n{{ m.content }", name="mine")
    template = JinjaChatTemplate(SMOLLM2, name="smollm2")
    chars = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz<|>_ \n")
    with pytest.raises(ValueError, match=r"the tokenizer has no '<\|im_start\|>', '<\|im_end\|>' tokens, which the "
                                         r"'smollm2' chat template writes"):
        template.render([{"role": "user", "content": "a"}], chars)
    with pytest.raises(ValueError, match="no '<\\|im_start\\|>'"):
        template.end_of_turn_id(chars)
    with pytest.raises(ValueError, match="the 'smollm2' chat template has no tool-call token .* it writes tool "
                                         "calls as text \\(none decoderlab reads\\)"):
        template.tool_call_id(chars)
    with pytest.raises(ValueError, match="ends an assistant turn with no control token"):
        JinjaChatTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}").end_of_turn(chars)


def test_special_tokens_and_text_characters_of_a_template():
    template = JinjaChatTemplate(LLAMA32, tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    assert template.special_tokens == ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                       "<|eot_id|>"]
    assert set("Cutting Knowledge Date") <= set(template.text_characters) and "|" not in template.text_characters
    # a fresh character tokenizer given the template's tokens renders it
    chars = CharTokenizer.from_text(JinjaChatTemplate(SMOLLM2).text_characters + "a").add_special_tokens(
        JinjaChatTemplate(SMOLLM2).special_tokens)
    ids, mask = JinjaChatTemplate(SMOLLM2).render([{"role": "user", "content": "a"},
                                                   {"role": "assistant", "content": "a"}], chars)
    assert runs(ids, mask, chars) == ["a<|im_end|>"]


def test_stored_in_meta_and_read_back(tmp_path):
    template, ours, theirs = pair("qwen3")
    stored = json.loads(json.dumps({CHAT_TEMPLATE_KEY: template.to_dict()}))
    assert template_from_meta(stored) == template
    with pytest.raises(ValueError, match="fields name, jinja and tokens"):
        template_from_meta({CHAT_TEMPLATE_KEY: {"jinja": "x", "colour": 1}})
    # a directory transformers wrote: chat_template.jinja beside tokenizer_config.json's named tokens
    theirs.save_pretrained(tmp_path / "hf")
    read = read_chat_template(tmp_path / "hf")
    assert read.source == QWEN3 and read.tokens["eos_token"] == "<|im_end|>" and read.name == "jinja:hf"
    assert read.render(THINKING, ours) == template.render(THINKING, ours)
    assert read_chat_template(tmp_path) is None
    (tmp_path / "t.jinja").write_text(SMOLLM2, encoding="utf-8")
    assert get_template(str(tmp_path / "t.jinja")) == JinjaChatTemplate(SMOLLM2, name="jinja:t.jinja")


def test_named_templates_choose_tool_use_when_tools_are_given(tmp_path):
    config = {"chat_template": [{"name": "default", "template": "plain{{ messages|length }}"},
                                {"name": "tool_use", "template": "tools{{ tools|length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    template = read_chat_template(tmp_path)
    assert template.render_text(CHAT) == "plain5" and template.render_text(CHAT, tools=TOOLS) == "tools1"
    assert JinjaChatTemplate.from_dict(template.to_dict()) == template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template must be a text or a list"):
        read_chat_template(tmp_path)


def test_generation_template_marks_only_its_blocks():
    ours, _ = bpe_pair(CHATML_TOKENS)
    template = JinjaChatTemplate(CHATML_GENERATION)
    ids, mask = template.render(CHAT, ours)
    assert runs(ids, mask, ours) == ["  Paris.  <|im_end|>", "4 — naïve café 日本語<|im_end|>"]
