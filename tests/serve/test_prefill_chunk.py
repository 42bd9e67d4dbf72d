"""The server with chunked prefill (``Limits(prefill_chunk=C)``, ``decoderlab serve --prefill-chunk C``): a long
prompt read C tokens per decode step while short requests decode gives the library's text; a chunk below 1 is
refused before anything is served."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, aclient, ref_text  # noqa: E402


def test_a_long_prompt_read_in_chunks_gives_the_librarys_text(mt):
    """Two long prompts (29 and 31 tokens: 8 chunks of 4 each) sent together with two short ones (read whole):
    every reply, greedy and seeded, is ``generate``'s text for its prompt, and the long ones were chunked."""
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None, limits=Limits(prefill_chunk=4))
    prompts = ["the long prompt, with words: ok", "ab", "another long prompt, to read.", "x y"]
    settings = [(0, None), (0.9, 3), (0.9, 5), (0, None)]

    async def ask(url):
        c = aclient(url)
        return await asyncio.gather(*(c.completions.create(model=MODEL_ID, prompt=p, max_tokens=20, temperature=t,
                                                           seed=s) for p, (t, s) in zip(prompts, settings)))

    with ServerThread(app) as url:
        replies = asyncio.run(ask(url))
        stats = app.state.decoderlab.stats()
    assert stats["prefill_chunks"] >= 8 + 8
    for p, (t, s), r in zip(prompts, settings, replies):
        assert r.choices[0].text == ref_text(mt, tok.encode(p), 20, t, s), p


@pytest.mark.parametrize("bad", [0, -3])
def test_a_chunk_below_one_is_refused_by_the_library(mt, bad):
    model, tok = mt
    with pytest.raises(ValueError, match=f"prefill_chunk must be an integer >= 1, got {bad}"):
        create_app(model, tok, limits=Limits(prefill_chunk=bad))
