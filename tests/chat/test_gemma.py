"""Gemma's chat format (decoderlab.chat.gemma, the built-in ``gemma`` template): rendered by decoderlab's Jinja
renderer it gives the ids of transformers' ``apply_chat_template`` with the same template on a Gemma tokenizer
(system folded into the first user turn, ``model`` turns, the generation prompt), and a Gemma 3 Hugging Face
directory carrying it loads with it as its template."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import decoderlab as dl  # noqa: E402
from decoderlab.chat import get_template  # noqa: E402
from decoderlab.chat.gemma import GEMMA_CHAT  # noqa: E402

from hf.families import chat_directory, gemma_tokenizer  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "  To be, or not to be?  "}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "1234 东京"},
     {"role": "assistant", "content": "the question\n"}, {"role": "user", "content": "and then?"}],
]


@pytest.mark.parametrize("prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_gemma_template_renders_transformers_ids(tmp_path, messages, prompt):
    auto = gemma_tokenizer()
    auto.chat_template = GEMMA_CHAT
    auto.save_pretrained(tmp_path)
    ours = dl.hf.read_tokenizer(tmp_path, len(auto))
    want = auto.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)
    ids, mask = get_template("gemma").render(messages, ours, add_generation_prompt=prompt)
    assert ids == list(want) and ids[:2] == [2, auto.convert_tokens_to_ids("<start_of_turn>")]
    text = get_template("gemma").render_text(messages, add_generation_prompt=prompt)
    assert text.endswith("<start_of_turn>model\n") == prompt and "<start_of_turn>system" not in text


def test_a_gemma_directory_with_its_template_chats_in_its_format(tmp_path):
    chat_directory(tmp_path, "gemma3", GEMMA_CHAT)
    loaded = dl.load(tmp_path)
    assert loaded.template is not None and loaded.template.source == GEMMA_CHAT
    ids, _ = loaded.template.render(CONVERSATIONS[1], loaded.tokenizer, add_generation_prompt=True)
    assert loaded.tokenizer.decode(ids).endswith("<end_of_turn>\n<start_of_turn>model\n")
    with torch.no_grad():
        assert loaded.model(torch.tensor([ids])).shape == (1, len(ids), loaded.model.config.num_tokens)


def test_the_gemma_template_refuses_roles_out_of_turn():
    with pytest.raises(Exception, match="alternate"):
        get_template("gemma").render_text([{"role": "assistant", "content": "hi"}])


def test_the_gemma_template_is_stored_and_read_back_by_name():
    from decoderlab.chat.templates import template_from_meta

    template = get_template("gemma")
    assert template.name == "gemma" and template.tokens == {"bos_token": "<bos>"}
    assert template_from_meta({"chat_template": template.to_dict()}) == template
