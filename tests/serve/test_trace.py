"""``/v1/decoderlab/trace``: the glass-box numbers are ``decoderlab.trace``'s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import decoderlab as dl  # noqa: E402


def test_trace_endpoint_numbers_are_trace(server, mt):
    url, _ = server
    model, tok = mt
    r = httpx.post(url + "/v1/decoderlab/trace", json={"prompt": "abc d", "temperature": 0.5, "top_k": 3})
    assert r.status_code == 200
    d = r.json()
    tr = dl.trace(model, tok.encode("abc d"), tok)
    for lt, got in zip(tr.layers, d["layers"]):
        assert torch.allclose(lt.percents[0], torch.tensor(got["percents"]), atol=1e-6)
    probs = torch.softmax(tr.logits[0, -1], -1)
    assert abs(d["top_before"][0]["prob"] - float(probs.max())) < 1e-6
    assert len([b for b in d["top_after"] if b["prob"] > 0]) <= 3
    assert abs(sum(b["prob"] for b in d["top_after"]) - 1) < 1e-5


def test_a_prompt_longer_than_the_context_is_refused_as_by_completions(server, mt):
    """A 10,000-token prompt: the same 400 context_length_exceeded as /v1/completions, not the last 32 traced."""
    url, _ = server
    model, tok = mt
    for path, body in (("/v1/decoderlab/trace", {"prompt": "ab" * 5000}), ("/v1/completions", {"prompt": "ab" * 5000})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
        assert "32" in err["message"] and "10000" in err["message"]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"token_ids": tok.encode("a" * 33)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_generated_continuation_slides_the_window_as_generation_does(server, mt):
    """What the model generated past max_len is traced over the last max_len tokens: the window it saw."""
    url, _ = server
    model, tok = mt
    cont = "the quick brown fox jumps over the lazy dog"
    r = httpx.post(url + "/v1/decoderlab/trace", json={"prompt": "ab", "continuation": cont, "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["token_ids"] == (tok.encode("ab") + tok.encode(cont))[-32:]
    tr = dl.trace(model, d["token_ids"], tok)
    assert torch.allclose(tr.layers[1].percents[0], torch.tensor(d["layers"][1]["percents"]), atol=1e-6)
    assert d["next"]["id"] == dl.generate(model, d["token_ids"], 1, temperature=0, tokenizer=tok)[0]  # greedy


def test_a_conversation_longer_than_the_context_is_refused_but_a_long_reply_slides(chat_server, mt):
    url, _ = chat_server
    model, tok = mt
    key = {"Authorization": "Bearer sekret"}
    long_user = [{"role": "user", "content": "x" * 40}]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"messages": long_user}, headers=key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y" * 40}]
    r = httpx.post(url + "/v1/decoderlab/trace", json={"messages": reply}, headers=key)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 32


def test_trace_bad_fields_name_them(server):
    url, _ = server
    for body, param in (({"prompt": "a", "layers": [7]}, "layers"), ({"prompt": "a", "top": 51}, "top"),
                        ({"prompt": "a", "bogus": 1}, "bogus"), ({"temperature": 0}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
                        ({"prompt": "a", "temperature": -1}, "temperature")):
        r = httpx.post(url + "/v1/decoderlab/trace", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def _post(url, body, **kw):
    r = httpx.post(url + "/v1/decoderlab/trace", json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_lens_and_the_decomposition_are_the_librarys_and_add_up(server, mt):
    """The trace's logit lens and decomposition at a position are decoderlab.glassbox's, and the parts sum to
    the model's logit; the default token is the most probable one there, another can be chosen."""
    url, _ = server
    model, tok = mt
    ids = tok.encode("abc dabc d")
    _, cache = dl.glassbox.run_with_cache(model, ids)
    for position, token in ((None, None), (3, None), (-2, tok.encode("z")[0])):
        d = _post(url, {"prompt": "abc dabc d", "position": position, "token": token})
        at = (len(ids) - 1 if position is None else position) % len(ids)
        assert d["position"] == at
        lens = dl.glassbox.logit_lens(cache, at).top(k=5)
        assert [e["label"] for e in d["lens"]] == ["0_pre", "1_pre", "final_post"]
        for entry, want in zip(d["lens"], lens):
            assert [t["id"] for t in entry["top"]] == [i for i, _ in want]
            assert all(abs(t["prob"] - p) < 1e-6 for t, (_, p) in zip(entry["top"], want))
        want_token = int(cache.logits[0, at].argmax()) if token is None else token
        dec = dl.glassbox.decompose(cache, at, want_token)
        got = d["decomposition"]
        assert (got["position"], got["token"]["id"]) == (at, want_token)
        assert [p["label"] for p in got["parts"]] == dec.labels
        assert all(abs(p["value"] - v) < 1e-6 for p, v in zip(got["parts"], dec.values.tolist()))
        assert abs(got["logit"] - float(cache.logits[0, at, want_token])) < 1e-6
        assert abs(sum(p["value"] for p in got["parts"]) - got["logit"]) < 1e-5
        assert got["total"] == pytest.approx(sum(p["value"] for p in got["parts"]), abs=1e-6)
        assert d["head_scores"] is None and d["ablation"] is None  # only when asked


def test_head_scores_on_the_text_and_on_the_probe_are_the_detectors(server, mt):
    url, _ = server
    model, tok = mt
    ids = tok.encode("abcabcabc")
    text = _post(url, {"prompt": "abcabcabc", "scores": "text"})["head_scores"]
    probe = _post(url, {"prompt": "a b", "scores": "probe"})["head_scores"]
    want_text = dl.glassbox.all_head_scores(model, ids)
    want_probe = dl.glassbox.all_head_scores(model, dl.glassbox.watching.probe_tokens(model))
    for got, want, on in ((text, want_text, "text"), (probe, want_probe, "probe")):
        assert got["on"] == on and set(got["scores"]) == set(dl.glassbox.KINDS)
        for kind in dl.glassbox.KINDS:
            assert torch.allclose(torch.tensor(got["scores"][kind], dtype=torch.float64), want[kind], atol=1e-6)
    assert _post(url, {"prompt": "a", "scores": "text"})["head_scores"] is None  # one token: nothing to score


def test_ablating_heads_gives_the_librarys_distribution(server, mt):
    """The ablation's next-token probabilities are run_with_hooks with zero_ablation of each head's hook_z."""
    url, _ = server
    model, tok = mt
    ids = tok.encode("the cat sat")
    heads = [{"layer": 1, "head": 0}, {"layer": 0, "head": 1}]
    d = _post(url, {"prompt": "the cat sat", "ablate": heads, "top": 5})
    hooks = [dl.glassbox.zero_ablation(model, f"blocks.{h['layer']}.attn.hook_z", head=h["head"]) for h in heads]
    after = torch.softmax(dl.glassbox.run_with_hooks(model, ids, hooks)[0, -1].double(), -1)
    with torch.no_grad():
        clean = model(torch.tensor(ids))[-1]
    before = torch.softmax(clean.double(), -1)
    a = d["ablation"]
    assert a["heads"] == heads
    assert [t["id"] for t in a["top"]] == torch.topk(after, 5).indices.tolist()
    assert {c["id"] for c in a["changes"]} == set(torch.topk(after, 5).indices.tolist()) | set(
        torch.topk(before, 5).indices.tolist())
    for c in a["changes"]:
        assert abs(c["after"] - float(after[c["id"]])) < 1e-6 and abs(c["before"] - float(before[c["id"]])) < 1e-6
    assert max(abs(c["after"] - c["before"]) for c in a["changes"]) > 1e-4  # the ablation changed something
    assert [abs(c["after"] - c["before"]) for c in a["changes"]] == sorted(
        (abs(c["after"] - c["before"]) for c in a["changes"]), reverse=True)
    assert a["kl"] == pytest.approx(float((before * (before.log() - after.log())).sum()), rel=1e-4, abs=1e-9)
    assert d["decomposition"]["logit"] == pytest.approx(float(clean.max()), abs=1e-6)  # the clean pass's


def test_a_chat_reply_so_far_is_a_continuation_of_the_generation_prompt(chat_server, mt):
    """messages + continuation: the reply so far after the generation prompt (not closed by an end of turn);
    a finished reply (a last assistant message) is closed, and the trace says it ended."""
    url, app = chat_server
    model, tok = mt
    key = {"Authorization": "Bearer sekret"}
    template = app.state.decoderlab.template
    user = [{"role": "user", "content": "hi"}]
    asked, _ = template.render(user, tok, add_generation_prompt=True)
    d = _post(url, {"messages": user, "continuation": "yo"}, headers=key)
    assert d["token_ids"] == asked + tok.encode("yo") and d["ended"] is False
    assert _post(url, {"messages": user, "continuation": ""}, headers=key)["token_ids"] == asked
    done = _post(url, {"messages": user + [{"role": "assistant", "content": "yo"}]}, headers=key)
    assert done["token_ids"][-1] == template.end_of_turn_id(tok) and done["ended"] is True
    assert d["next"]["ends_text"] is (d["next"]["id"] in tok.end_of_text_ids)


def test_the_next_token_says_when_it_ends_the_text(server, mt):
    """next.ends_text: the token is one of the tokenizer's end-of-text ids (where generation stops)."""
    from tiny_models import end_of_turn_model

    from decoderlab.serve import ServerThread, create_app

    tok, model, ids = end_of_turn_model()
    with ServerThread(create_app(model, tok, model_id="eot", template=None)) as url:
        d = _post(url, {"prompt": "ab", "temperature": 0})
        assert (d["next"]["token"], d["next"]["ends_text"]) == ("c", False)
        d = _post(url, {"prompt": "abc", "temperature": 0})
        assert (d["next"]["id"], d["next"]["ends_text"]) == (ids["end"], True)


def test_bad_glass_fields_name_them(server, chat_server):
    url, _ = server
    for body, param in (({"prompt": "abc", "position": 3}, "position"), ({"prompt": "abc", "position": -4}, "position"),
                        ({"prompt": "a", "token": 10_000}, "token"), ({"prompt": "a", "token": -1}, "token"),
                        ({"prompt": "a", "scores": "all"}, "scores"),
                        ({"prompt": "a", "ablate": [{"layer": 2, "head": 0}]}, "ablate[0]"),
                        ({"prompt": "a", "ablate": [{"layer": 0, "head": 0}, {"layer": 0, "head": 2}]}, "ablate[1]"),
                        ({"prompt": "a", "ablate": [{"layer": 0}]}, "ablate[0].head"),
                        ({"token_ids": [1, 2], "continuation": "a"}, "continuation")):
        r = httpx.post(url + "/v1/decoderlab/trace", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    url, _ = chat_server
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "continuation": "more"}
    r = httpx.post(url + "/v1/decoderlab/trace", json=body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continuation", r.text
