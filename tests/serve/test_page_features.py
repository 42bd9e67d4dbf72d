"""The page's Features view in a real browser (Debian's chromium, headless, as test_page_glass.py): hovering a
token lists its active features, a click on one ablates it or steers with it, and the next-token
distribution shown equals decoderlab.glassbox's ``run_with_hooks`` with ``feature_ablation`` /
``feature_steering`` within 1e-6; a feature index out of range is a 400 naming the range."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("playwright.sync_api")

import httpx  # noqa: E402

import decoderlab as dl  # noqa: E402
from decoderlab.glassbox.features import feature_ablation, feature_steering, token_features  # noqa: E402
from decoderlab.glassbox.sae import SparseAutoencoder  # noqa: E402
from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .test_page import browser_context, open_page, pytestmark  # noqa: E402,F401 -- the launcher and its skip
from .test_page_glass import PROMPT, glass_model, trace_on_page  # noqa: E402

HOOK = "blocks.1.hook_resid_post"
ROWS = "els => els.map(e => [+e.dataset.id, +e.dataset.before, +e.dataset.after])"


def _sae(model) -> SparseAutoencoder:
    return SparseAutoencoder(16, 64, 6, metadata={"hook_name": HOOK}, seed=3)


def _wait_title(page, text):
    page.wait_for_function(f"document.getElementById('feat-result-title').textContent === {json.dumps(text)}")


def test_features_on_the_page_equal_the_librarys(browser_context):
    model, tok = glass_model()
    sae = _sae(model)
    ids = tok.encode(PROMPT)
    t = len(ids)
    active = token_features(model, sae, HOOK, ids, top=8)
    feature = active[t - 1][0][0]  # the strongest feature at the last position
    clean = torch.softmax(dl.glassbox.run_with_hooks(model, ids, [])[0, -1].double(), -1)
    ablated = torch.softmax(dl.glassbox.run_with_hooks(model, ids, [feature_ablation(sae, HOOK, feature)])[0, -1]
                            .double(), -1)
    steered = torch.softmax(dl.glassbox.run_with_hooks(model, ids, [feature_steering(sae, HOOK, feature, 4.0)])[0, -1]
                            .double(), -1)
    with ServerThread(create_app(model, tok, model_id="glass", template=None, sae=sae)) as url:
        page, errors = open_page(browser_context, url)
        assert not page.is_hidden("#features-section")
        assert "64 features (TopK, k = 6)" in page.text_content("#features-info")
        trace_on_page(page)
        page.wait_for_selector("#feat-tokens span")
        page.hover("#feat-tokens span[data-pos='3']")
        page.wait_for_function("document.getElementById('feat-list').dataset.pos === '3'")
        shown = page.eval_on_selector_all("#feat-list .feat", "els => els.map(e => [+e.dataset.feature, "
                                                              "+e.dataset.activation])")
        assert [f for f, _ in shown] == [f for f, _ in active[3]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(shown, active[3])) < 1e-6
        page.hover(f"#feat-tokens span[data-pos='{t - 1}']")
        page.click(f"#feat-list .feat[data-feature='{feature}']")
        _wait_title(page, f"Next token with feature {feature} ablated")
        for mode, want in (("ablate", ablated), ("steer", steered)):
            if mode == "steer":
                page.select_option("#feat-mode", "steer")
                _wait_title(page, f"Next token steered with feature {feature} (scale 4)")
            rows = page.eval_on_selector_all("#feat-result .fchange[data-id]", ROWS)
            top = set(torch.topk(clean, 10).indices.tolist()) | set(torch.topk(want, 10).indices.tolist())
            assert {i for i, _, _ in rows} == top
            for i, before, after in rows:
                assert abs(before - float(clean[i])) < 1e-6 and abs(after - float(want[i])) < 1e-6, (mode, i)
            assert max(abs(a - b) for _, b, a in rows) > 1e-4, mode  # the distribution did change
            kl = float((clean * (clean.log() - want.log())).sum())
            assert float(page.eval_on_selector("#feat-kl", "e => e.dataset.kl")) == pytest.approx(kl, rel=1e-4)
        page.click("#feat-clear")
        _wait_title(page, "Next token")
        assert errors == []
        page.close()
        bad = httpx.post(url + "/v1/decoderlab/features", json={"token_ids": ids, "feature": 64})
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["param"] == "feature"
        assert err["message"] == "feature 64 is out of range; valid features are 0 .. 63 (d_sae=64)"
        assert httpx.post(url + "/v1/decoderlab/features", json={"token_ids": ids, "feature": -1}).status_code == 400
        ok = httpx.post(url + "/v1/decoderlab/features", json={"token_ids": ids}).json()  # still serving
        assert [[a["feature"] for a in row] for row in ok["active"]] == [[f for f, _ in row] for row in active]


def test_no_sae_served_no_features_section(browser_context):
    model, tok = glass_model()
    with ServerThread(create_app(model, tok, model_id="glass", template=None)) as url:
        assert httpx.get(url + "/v1/decoderlab/features").json()["served"] is False
        assert httpx.post(url + "/v1/decoderlab/features", json={"token_ids": [1, 2]}).status_code == 404
        page, errors = open_page(browser_context, url)
        trace_on_page(page)
        assert page.is_hidden("#features-section") and errors == []
        page.close()
    with pytest.raises(ValueError, match="is not a hook point of this model"):
        create_app(model, tok, sae=SparseAutoencoder(16, 32, 4, metadata={"hook_name": "blocks.9.hook_resid_post"}))
