"""The page's glass-box parts in a real browser (Debian's chromium, headless, as in test_page.py): the logit
lens, the decomposition bars, the detectors' scores on the head grid, a click that ablates a head, and the
chat's requests, log and end of turn. Every number read off the page is compared with decoderlab.glassbox's
own, computed here before the server starts (the server's thread owns the model while it serves)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("playwright.sync_api")

import decoderlab as dl  # noqa: E402
from decoderlab.glassbox.watching import probe_tokens  # noqa: E402
from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .test_page import browser_context, open_page, pytestmark  # noqa: E402,F401 -- the launcher and its skip

PROMPT = "abc dabc d"
TITLE = "document.getElementById('decomp-title').textContent"
BARS = "els => els.map(e => [+e.dataset.id, +e.dataset.prob])"


def glass_model():
    """3 layers of 4 heads: 12 heads, so the decomposition has more parts than the page draws one by one."""
    torch.manual_seed(1)
    tok = dl.CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.:")
    cfg = dl.preset("baby-shakespeare", n_layer=3, n_head=4, d_model=16, max_len=32, num_tokens=tok.vocab_size)
    cfg.lm_head_bias = True
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():
        model.fc_layer.weight.mul_(12.0)
        for block in model.blocks:  # heads that write a lot: removing one moves the next token's distribution
            block.attention.proj.weight.mul_(30.0)
        model.fc_layer.bias.zero_()
        model.fc_layer.bias[tok.eos_id] = -30.0
    return model.eval(), tok


def trace_on_page(page, prompt=PROMPT):
    page.fill("#prompt", prompt)
    page.click("#trace-btn")
    page.wait_for_selector("#decomp .part")


def decomp_rows(page):
    return page.eval_on_selector_all("#decomp .part", "els => els.map(e => [e.dataset.label, +e.dataset.value])")


def logit_shown(page):
    return float(page.eval_on_selector("#decomp-sum", "e => e.dataset.logit")), page.text_content("#decomp-sum")


def test_decomposition_bars_sum_to_the_logit_shown(browser_context):
    model, tok = glass_model()
    ids = tok.encode(PROMPT)
    _, cache = dl.glassbox.run_with_cache(model, ids)
    t = len(ids)
    top2 = torch.topk(cache.logits[0, -1], 2).indices.tolist()
    want = {tid: dl.glassbox.decompose(cache, t - 1, tid) for tid in top2}
    want_at2 = dl.glassbox.decompose(cache, 2, int(cache.logits[0, 2].argmax()))
    with ServerThread(create_app(model, tok, model_id="glass", template=None)) as url:
        page, errors = open_page(browser_context, url)
        trace_on_page(page)
        for tid, clicked in ((top2[0], None), (top2[1], f"#bars-before .bar[data-id='{top2[1]}']"), (None, "pos")):
            if clicked == "pos":
                page.click("#tokens span[data-pos='2']")
                page.wait_for_function(f"{TITLE}.includes('after position 2,')")
                d = want_at2
            else:
                if clicked:
                    page.click(clicked)
                    page.wait_for_function(f"{TITLE}.includes('(id {tid})')")
                d = want[tid]
            rows = decomp_rows(page)
            logit, text = logit_shown(page)
            assert abs(logit - float(d.logit)) < 1e-5  # the model's logit, shown
            assert f"the model's logit {float(d.logit):+.4f}" in text
            assert abs(sum(v for _, v in rows) - logit) < 1e-4  # the bars add up to it
            # the page draws the 16 largest parts one by one and the rest as one bar: the library's parts
            parts = sorted(d.as_dict().items(), key=lambda kv: -abs(kv[1]))
            assert len(parts) > 16 and len(rows) == 17
            for (label, value), (want_label, want_value) in zip(rows[:16], parts[:16]):
                assert label == want_label and abs(value - want_value) < 1e-5
            assert rows[16][0] == f"{len(parts) - 16} more"
            assert abs(rows[16][1] - sum(v for _, v in parts[16:])) < 1e-5
        assert errors == []
        page.close()


def test_the_lens_table_and_the_head_scores_are_the_librarys(browser_context):
    model, tok = glass_model()
    ids = tok.encode(PROMPT)
    _, cache = dl.glassbox.run_with_cache(model, ids)
    lens = dl.glassbox.logit_lens(cache)
    on_probe = dl.glassbox.all_head_scores(model, probe_tokens(model))
    on_text = dl.glassbox.all_head_scores(model, ids)
    with ServerThread(create_app(model, tok, model_id="glass", template=None)) as url:
        page, errors = open_page(browser_context, url)
        trace_on_page(page)
        for at in (len(ids) - 1, 4):
            if at != len(ids) - 1:
                page.click(f"#tokens span[data-pos='{at}']")
                page.wait_for_function(f"document.getElementById('lens-title').textContent.includes('position {at} ')")
            table = page.eval_on_selector_all(
                "#lens-table tr[data-label]", "rows => rows.map(r => [r.dataset.label, "
                "[...r.querySelectorAll('td')].map(c => [+c.dataset.id, +c.dataset.prob])])")
            assert [label for label, _ in table] == lens.labels == ["0_pre", "1_pre", "2_pre", "final_post"]
            for (_, cells), want in zip(table, lens.top(position=at, k=5)):
                assert [i for i, _ in cells] == [i for i, _ in want]
                assert all(abs(p - q) < 1e-6 for (_, p), (_, q) in zip(cells, want))

        def grid_scores():
            return page.eval_on_selector_all("#grid .head", "els => els.map(e => [+e.dataset.layer, +e.dataset.head, "
                                                            "+e.querySelector('.score').dataset.value])")

        for kind, on, want in (("induction", "probe", on_probe), ("previous_token", "probe", on_probe),
                               ("duplicate_token", "text", on_text), ("induction", "text", on_text)):
            page.select_option("#score-kind", kind)
            if page.input_value("#score-on") != on:
                page.select_option("#score-on", on)
                page.wait_for_function("document.querySelector('#grid .head .score').title.includes('this text')")
            got = grid_scores()
            assert len(got) == 12
            for layer, head, value in got:
                assert abs(value - float(want[kind][layer, head])) < 1e-6, (kind, on, layer, head)
        assert errors == []
        page.close()


def test_a_click_on_a_head_ablates_it_as_the_library_does(browser_context):
    model, tok = glass_model()
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        clean = torch.softmax(model(torch.tensor(ids))[-1].double(), -1)

    def ablated(heads):
        hooks = [dl.glassbox.zero_ablation(model, f"blocks.{layer}.attn.hook_z", head=h) for layer, h in heads]
        return torch.softmax(dl.glassbox.run_with_hooks(model, ids, hooks)[0, -1].double(), -1)

    steps = [[(1, 0)], [(1, 0), (0, 3)], [(0, 3)]]  # click L1H0, then L0H3, then L1H0 again (un-ablates it)
    want = [ablated(heads) for heads in steps]
    with ServerThread(create_app(model, tok, model_id="glass", template=None)) as url:
        page, errors = open_page(browser_context, url)
        trace_on_page(page)
        clean_bars = page.eval_on_selector_all("#bars-before .bar", BARS)
        assert page.eval_on_selector_all("#ablation .change", "els => els.length") == 0  # nothing ablated yet
        page.check("#click-ablate")
        for (layer, head), heads, after in zip([(1, 0), (0, 3), (1, 0)], steps, want):
            page.click(f"#grid canvas[data-layer='{layer}'][data-head='{head}']")
            names = ", ".join(f"L{lh[0]}H{lh[1]}" for lh in heads)
            page.wait_for_function(f"document.getElementById('ablation-title').textContent === "
                                   f"{json.dumps('Next token with ' + names + ' ablated')}")
            rows = page.eval_on_selector_all("#ablation .change[data-id]", "els => els.map(e => "
                                             "[+e.dataset.id, +e.dataset.before, +e.dataset.after])")
            top = set(torch.topk(clean, 10).indices.tolist()) | set(torch.topk(after, 10).indices.tolist())
            assert {i for i, _, _ in rows} == top
            for i, before, got in rows:
                assert abs(before - float(clean[i])) < 1e-6 and abs(got - float(after[i])) < 1e-6, (heads, i)
            assert max(abs(got - before) for _, before, got in rows) > 1e-3  # the distribution did change
            kl = float((clean * (clean.log() - after.log())).sum())
            assert float(page.eval_on_selector("#ablation-kl", "e => e.dataset.kl")) == pytest.approx(kl, rel=1e-3)
            marked = page.eval_on_selector_all("#grid .head.ablated", "els => els.map(e => [+e.dataset.layer, "
                                                                      "+e.dataset.head])")
            assert sorted(map(tuple, marked)) == sorted(heads)
            # the clean distribution is still the one drawn as the next token
            now = page.eval_on_selector_all("#bars-before .bar", BARS)
            assert now == clean_bars
        page.click("#clear-ablation")
        page.wait_for_function("document.getElementById('ablation-title').textContent === 'Ablation'")
        assert page.eval_on_selector_all("#grid .head.ablated", "els => els.length") == 0
        assert errors == []
        page.close()


def test_chat_requests_are_valid_the_log_shows_both_sides_and_stepping_stops_at_end_of_turn(browser_context):
    """A chat checkpoint's page: every trace request is accepted (the reply so far goes as the continuation,
    never as an empty assistant message), the log shows the user's lines and the replies, and "Step +1 token"
    stops where the reply ended (the model's next token is its end of turn)."""
    from tiny_models import end_of_turn_model

    from decoderlab.chat import TEMPLATES

    tok, model, _ = end_of_turn_model()  # replies "abc", then <|end|>
    app = create_app(model, tok, model_id="eot-chat", template=TEMPLATES["decoderlab"])
    with ServerThread(app) as url:
        page, errors = open_page(browser_context, url)
        finished = []
        page.on("requestfinished", lambda r: finished.append(r))
        for turn, text in enumerate(["ab", "ca"]):
            page.fill("#prompt", text)
            page.click("#send")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=20000)
            assert page.text_content("#status") == "done (stop)"
            log = page.eval_on_selector_all("#chat-log .msg", "els => els.map(e => e.textContent)")
            assert log == [line for i in range(turn + 1) for line in (f"user: {['ab', 'ca'][i]}", "assistant: abc")]
            tokens = page.eval_on_selector_all("#tokens span", "els => els.length")
            page.click("#step")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('the text has ended')")
            assert page.eval_on_selector_all("#tokens span", "els => els.length") == tokens  # nothing appended
        traced = [(r.response().status, json.loads(r.post_data)) for r in finished
                  if r.url.endswith("/v1/decoderlab/trace")]
        assert traced and all(status == 200 for status, _ in traced), traced
        for _, body in traced:
            assert all(m["role"] != "assistant" or m["content"] for m in body["messages"]), body
        last = traced[-1][1]  # the final trace of the turn comes last: after any live one still in flight
        assert last["messages"][-1] == {"role": "user", "content": "ca"} and last["continuation"] == "abc"
        assert page.eval_on_selector_all("#tokens span", "els => els.map(e => e.textContent)")[-3:] == ["a", "b", "c"]
        assert errors == []
        page.close()


def test_a_watched_runs_head_scores_are_drawn_beside_the_loss(browser_context, tmp_path):
    """A run trained with --watch-heads: the page draws its loss and every head's scores as recorded, and names
    when each head formed (decoderlab.glassbox.watching.formation_steps)."""
    from decoderlab.glassbox.watching import append_record, formation_steps, read_records

    model, tok = glass_model()
    for step in range(0, 50, 10):
        scores = {kind: [[round(0.01 * (layer + 1) * (head + 1) + (0.1 * step / 10 if (layer, head, kind) == (
            2, 1, "induction") else 0), 4) for head in range(4)] for layer in range(3)] for kind in dl.glassbox.KINDS}
        append_record(tmp_path, {"step": step, "loss": None if step == 0 else 4.0 - step / 20, "scores": scores})
    records = read_records(tmp_path)
    with ServerThread(create_app(model, tok, model_id="glass", template=None, run_dir=tmp_path)) as url:
        page, errors = open_page(browser_context, url)
        assert page.is_visible("#watch-section")
        loss = json.loads(page.get_attribute("#watch-chart .loss-line", "data-values"))
        assert loss == [r["loss"] for r in records if r["loss"] is not None]
        for kind in ("induction", "previous_token"):
            page.select_option("#watch-kind", kind)
            lines = page.eval_on_selector_all("#watch-chart .head-line", "els => els.map(e => [e.dataset.head, "
                                                                        "JSON.parse(e.dataset.values)])")
            assert len(lines) == 12
            for name, values in lines:
                layer, head = map(int, name[1:].split("H"))
                assert values == [r["scores"][kind][layer][head] for r in records]
            formed = {f"L{layer}H{head}": step for (layer, head), step in formation_steps(records, kind).items()
                      if step is not None}
            assert json.loads(page.get_attribute("#watch-formed", "data-formed")) == formed
        assert formed == {} and "no head reached" in page.text_content("#watch-formed")
        page.select_option("#watch-kind", "induction")
        assert page.text_content("#watch-formed").endswith("L2H1 at step 30")  # 0.02 * 3 ... + 0.3 at step 30
        assert errors == []
        page.close()
    with ServerThread(create_app(model, tok, model_id="glass", template=None)) as url:  # no run: no chart
        page, errors = open_page(browser_context, url)
        assert not page.is_visible("#watch-section") and errors == []
        page.close()
