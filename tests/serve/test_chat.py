"""``/v1/chat/completions``: the messages through the chat template, continued as ``decoderlab.generate``
does, streamed or not, with logprobs."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


from decoderlab.chat import add_chat_tokens  # noqa: E402
from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, FakeTemplate, aclient, client, ref_text  # noqa: E402


def test_chat_equals_generate_through_the_template(chat_server, mt):
    url, _ = chat_server
    model, tok = mt
    messages = [{"role": "user", "content": "hi there"}]
    ids, _ = FakeTemplate().render(messages, tok, add_generation_prompt=True)
    want = ref_text(mt, ids, 20, 0.9, 5)
    c = client(url, "sekret")
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_completion_tokens=20, temperature=0.9,
                                  seed=5)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)

    async def streamed():
        ac = aclient(url, "sekret")
        s = await ac.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0.9,
                                             seed=5, stream=True)
        chunks = [ch async for ch in s]
        await ac.close()
        return chunks

    lp = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=2).choices[0]
    assert "".join(t.token for t in lp.logprobs.content) == lp.message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.logprobs.content)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL_ID, messages=messages, top_logprobs=2)
    assert e.value.param == "top_logprobs"

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_system_messages_after_the_first_are_merged_into_the_first(chat_server, mt):
    """A later system (or developer) message is merged into one system message first, texts joined by a blank
    line: the reply is the one to that merged conversation."""
    url, _ = chat_server
    _, tok = mt
    c = client(url, "sekret")
    sent = [{"role": "system", "content": "b"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "developer", "content": "p"},
            {"role": "user", "content": "ok"}]
    merged = [{"role": "system", "content": "b\n\np"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    ids, _ = FakeTemplate().render(merged, tok, add_generation_prompt=True)
    r = c.chat.completions.create(model=MODEL_ID, messages=sent, max_tokens=8, temperature=0.9, seed=3)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref_text(mt, ids, 8, 0.9, 3)
    late_only = [{"role": "user", "content": "hi"}, {"role": "system", "content": "b"}]
    r = c.chat.completions.create(model=MODEL_ID, messages=late_only, max_tokens=2)
    want = FakeTemplate().render([late_only[1], late_only[0]], tok, add_generation_prompt=True)[0]
    assert r.usage.prompt_tokens == len(want)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
          "{% if messages|length > 3 %}{{ raise_exception('at most three messages, please') }}{% endif %}")


def test_a_jinja_template_serves_and_its_error_is_a_400(mt):
    """A Hugging Face chat template (ChatML, Jinja) renders the prompt, the reply stops at its <|im_end|>; a
    template that raises is a 400 naming messages, with its message, and the server keeps serving."""
    from decoderlab.chat import JinjaChatTemplate

    template = JinjaChatTemplate(CHATML, name="chatml")
    model, tok, _ = add_chat_tokens(*mt, template)
    app = create_app(model.eval(), tok, model_id=MODEL_ID, template=template, limits=Limits(max_messages=8))
    messages = [{"role": "user", "content": "hi there"}]
    ids, _ = template.render(messages, tok, add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    with ServerThread(app) as url:
        c = client(url)
        r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0.9, seed=5)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == ref_text((model, tok), ids, 12, 0.9, 5)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL_ID, messages=messages * 4, max_tokens=2)
        assert e.value.param == "messages" and "the 'chatml' chat template raised: at most three messages" in str(
            e.value)
        assert c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2).choices
