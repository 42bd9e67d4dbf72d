"""``/v1/chat/completions``: the messages through the chat template, continued as ``decoderlab.generate``
does, streamed or not, with logprobs."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


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
