"""The glass-box page in a real browser: Debian's chromium, headless, driven by Playwright's Python package.

Playwright's own browser download does not work here; ``make test`` (its ``browsers`` step, as root) installs
``chromium`` from Debian, and these tests are skipped, saying so, only when /usr/bin/chromium is absent.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")

import decoderlab as dl  # noqa: E402
from decoderlab.serve import ServerThread, create_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is missing: run `make browsers` (apt-get install chromium) as root")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]


@pytest.fixture(scope="module")
def browser_context():
    with sync_api.sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                                                    viewport={"width": 1400, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()


def open_page(ctx, url):
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=15000)
    return page, errors


def tiny():
    torch.manual_seed(0)
    tok = dl.CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.:")
    cfg = dl.preset("baby-shakespeare", n_layer=2, n_head=2, d_model=16, max_len=32, num_tokens=tok.vocab_size)
    cfg.lm_head_bias = True
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():
        model.fc_layer.bias.zero_()
        model.fc_layer.bias[tok.eos_id] = -30.0  # no <EOS>: the streamed reply is never empty
    return model.eval(), tok


def cells(page):
    """(q, k) -> value of every heatmap cell, and the set of masked cells."""
    data = page.eval_on_selector_all(
        "#heatmap rect.cell", "els => els.map(e => [+e.dataset.q, +e.dataset.k, +e.dataset.value, "
                              "e.classList.contains('masked')])")
    return {(q, k): v for q, k, v, _ in data}, {(q, k) for q, k, _, m in data if m}


def test_page_heatmap_is_trace_and_steps_add_rows(browser_context):
    model, tok = tiny()
    with ServerThread(create_app(model, tok, model_id="tiny", template=None)) as url:
        page, errors = open_page(browser_context, url)
        page.fill("#prompt", "abc d")
        page.click("#trace-btn")
        page.wait_for_selector("#heatmap rect.cell")
        page.click("#grid canvas[data-layer='1'][data-head='1']")  # choose layer 1, head 1 from the grid
        got, masked = cells(page)
        tr = dl.trace(model, tok.encode("abc d"), tok)
        want = tr.layer(1).percents[0, 1]
        t = want.size(0)
        assert len(got) == t * t
        for (q, k), v in got.items():
            assert abs(v - float(want[q, k])) < 1e-6
        assert masked == {(q, k) for q in range(t) for k in range(t) if k > q}  # the causal mask, drawn apart
        for i in range(5):
            page.click("#step")
            page.wait_for_function(f"document.querySelectorAll('#tokens span').length === {t + i + 1}")
        rows = page.eval_on_selector_all("#heatmap rect.cell", "els => new Set(els.map(e => e.dataset.q)).size")
        assert rows == t + 5
        assert page.eval_on_selector_all("#bars-before .bar", "els => els.length") == 10
        page.fill("#temperature", "0.8")
        page.click("#send")  # a streamed completion
        page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=20000)
        assert len(page.text_content("#output")) > 0
        assert errors == []
        page.close()


def test_trained_lesson_model_shows_awesome_on_top(browser_context):
    from decoderlab.training import train_pairs

    model, tok = train_pairs(preset_name="statquest", max_epochs=30, seed=42)
    with ServerThread(create_app(model, tok, model_id="statquest", template=None)) as url:
        page, errors = open_page(browser_context, url)
        page.fill("#prompt", "what is statquest <EOS>")
        page.click("#trace-btn")
        page.wait_for_selector("#bars-before .bar")
        top = page.eval_on_selector("#bars-before .bar", "e => e.dataset.token")
        assert top == "awesome"
        assert float(page.eval_on_selector("#bars-before .bar", "e => e.dataset.prob")) > 0.9
        assert errors == []
        page.close()


class _Template:
    """A stand-in with the duck-typed methods of ``decoderlab.chat.ChatTemplate`` (render, end_of_turn_id)."""

    name = "test"

    def render(self, messages, tokenizer, *, add_generation_prompt=False):
        ids = []
        for m in messages:
            ids += tokenizer.encode(f"{m['role'][0]}:{m['content']}") + [tokenizer.eos_id]
        if add_generation_prompt:
            ids += tokenizer.encode("a:")
        return ids, [False] * len(ids)

    def end_of_turn_id(self, tokenizer):
        return tokenizer.eos_id


def test_chat_mode_streams_a_reply_and_traces_the_conversation(browser_context):
    model, tok = tiny()
    # the reference first: the page traces the conversation on the server's thread after the reply is done, and
    # a forward pass of the same model on this thread meanwhile would run inside the trace's hooks
    ids, _ = _Template().render([{"role": "user", "content": "hi"}], tok, add_generation_prompt=True)
    want = tok.decode(dl.generate(model, ids, 8, temperature=0, stop=[tok.eos_id]))
    app = create_app(model, tok, model_id="tiny-chat", template=_Template())
    with ServerThread(app) as url:
        page, errors = open_page(browser_context, url)
        assert page.is_visible("#chat-log") and not page.is_visible("#out-section")
        page.fill("#prompt", "hi")
        page.fill("#max_tokens", "8")
        page.click("#send")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=20000)
        reply = page.text_content("#chat-log .msg:last-child span")
        assert reply == want  # greedy (the page's default temperature 0)
        page.wait_for_selector("#heatmap rect.cell")
        assert errors == []
        page.close()
