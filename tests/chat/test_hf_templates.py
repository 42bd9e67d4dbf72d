"""decoderlab's own templates written as Jinja (what an exported model carries): rendered by decoderlab's Jinja
renderer and by transformers, they give the built-in renderer's ids and mask, for character, BPE and word
vocabularies, with system messages, tools offered, tool calls and results, and the generation prompt; read back
from a directory they are the built-in template again."""

import json

import pytest
from tiny_runs import one_thread  # noqa: F401  (an autouse fixture)

from decoderlab.chat import TEMPLATES, JinjaChatTemplate, chat_template_jinja, read_chat_template
from decoderlab.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}},
         {"name": "now", "parameters": {"type": "object", "properties": {}}}]
CALL = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CONVS = {
    "chat": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is up ?"},
             {"role": "assistant", "content": "all good"}, {"role": "user", "content": "and you ?"},
             {"role": "assistant", "content": "fine too"}],
    "no system": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
}
TOOL_CONVS = {
    "calls": [{"role": "system", "content": "use tools"}, {"role": "user", "content": "1 plus 2 ?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "c0", "content": "3"}, {"role": "assistant", "content": "it is 3"}],
    "text arguments": [{"role": "user", "content": "1 plus 2 ?"},
                       {"role": "assistant", "content": "let me see", "tool_calls": [
                           dict(CALL, function={"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}),
                           dict(CALL, id="c1", function={"name": "now", "arguments": " "})]},
                       {"role": "tool", "tool_call_id": "c0", "content": "3"},
                       {"role": "tool", "tool_call_id": "c1", "content": "noon"},
                       {"role": "assistant", "content": "3 at noon"}],
}
TEXT = " ".join(m["content"] or "" for c in [*CONVS.values(), *TOOL_CONVS.values()] for m in c) + json.dumps(TOOLS)


def tokenizer(kind, template):
    base = {"char": lambda: CharTokenizer.from_text(TEXT + template.text_characters + "é"),
            "bpe": lambda: BPETokenizer.train([TEXT * 5 + ' {"a": 1, "b": 2} []'], 300),
            "word": lambda: WordTokenizer.from_texts([TEXT], unk=True)}[kind]()
    return base.add_special_tokens(template.special_tokens)


def cases(name):
    for what, conv in CONVS.items():
        yield what, conv, None
    if name == "tools":
        yield "tools offered", CONVS["chat"], TOOLS
        for what, conv in TOOL_CONVS.items():
            yield what, conv, TOOLS


@pytest.mark.filterwarnings("ignore:the BPE vocabulary has")
@pytest.mark.parametrize("kind", ["char", "bpe", "word"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_jinja_text_renders_the_built_in_ids_and_mask(name, kind):
    builtin = TEMPLATES[name]
    tok = tokenizer(kind, builtin)
    jinja = JinjaChatTemplate(chat_template_jinja(builtin, tok))
    assert jinja.end_of_turn_id(tok) == builtin.end_of_turn_id(tok)
    for what, conv, tools in cases(name):
        for prompt in (False, True):
            messages = conv[:-1] if prompt else conv
            want = builtin.render(messages, tok, add_generation_prompt=prompt, tools=tools)
            assert jinja.render(messages, tok, add_generation_prompt=prompt, tools=tools) == want, (what, prompt)


@pytest.mark.filterwarnings("ignore:the BPE vocabulary has")
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_transformers_renders_the_exported_text_to_the_built_in_ids(name):
    """What an exported model's tokenizer_config.json holds, through transformers' apply_chat_template."""
    from transformers import PreTrainedTokenizerFast

    builtin = TEMPLATES[name]
    tok = tokenizer("bpe", builtin)
    theirs = PreTrainedTokenizerFast(tokenizer_object=tok.hf_tokenizer, chat_template=chat_template_jinja(builtin))
    for what, conv, tools in cases(name):
        for prompt in (False, True):
            messages = conv[:-1] if prompt else conv
            ids, mask = builtin.render(messages, tok, add_generation_prompt=prompt, tools=tools)
            assert theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                              return_dict=False) == ids, (what, prompt)


def test_what_the_built_in_template_refuses_the_jinja_text_refuses():
    jinja = JinjaChatTemplate(chat_template_jinja(TEMPLATES["decoderlab"]))
    with pytest.raises(ValueError, match="the 'decoderlab' chat template cannot render tools or tool calls"):
        jinja.render_text(CONVS["chat"], tools=TOOLS)
    with pytest.raises(ValueError, match="the 'decoderlab' chat template has no role tool"):
        jinja.render_text([{"role": "tool", "content": "3"}])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_exported_text_reads_back_as_the_built_in_template(name, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template_jinja(TEMPLATES[name]), "eos_token": "<EOS>"}), encoding="utf-8")
    assert read_chat_template(tmp_path) is TEMPLATES[name]
    words = WordTokenizer.from_texts(["a b"])
    (tmp_path / "chat_template.jinja").write_text(chat_template_jinja(TEMPLATES[name], words), encoding="utf-8")
    assert read_chat_template(tmp_path) is TEMPLATES[name]  # chat_template.jinja wins, as in transformers
    source = "{{ messages[0]['content'] }}"
    (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    assert read_chat_template(tmp_path) == JinjaChatTemplate(source, name=f"jinja:{tmp_path.name}",
                                                             tokens={"eos_token": "<EOS>"})


def test_a_jinja_template_gives_its_own_text():
    assert chat_template_jinja(JinjaChatTemplate("{{ 1 }}")) == "{{ 1 }}"
    with pytest.raises(TypeError, match="needs a ChatTemplate or a JinjaChatTemplate"):
        chat_template_jinja("decoderlab")
