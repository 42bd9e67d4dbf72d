"""``/metrics``: Prometheus's text format (read back with prometheus-client's own parser) counting requests,
tokens in and out, the queue and the running rows, with the latency histograms."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID  # noqa: E402


def samples(url) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_requests_tokens_and_latencies(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None)  # its own app: its own counts
    with ServerThread(app) as url:
        for n in (3, 5):
            assert httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": n}).status_code == 200
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4,
                                                                 "stream": True}) as r:
            list(r.iter_lines())
        assert httpx.post(url + "/v1/completions", json={"prompt": "abc", "top_p": 0}).status_code == 400
        got = samples(url)
    assert got[("decoderlab_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 3
    assert got[("decoderlab_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert got[("decoderlab_prompt_tokens_total", ())] == 3 + 3 + 2
    assert got[("decoderlab_completion_tokens_total", ())] == 3 + 5 + 4
    assert got[("decoderlab_time_to_first_token_seconds_count", ())] == 3
    assert got[("decoderlab_time_per_output_token_seconds_count", ())] == 3
    assert got[("decoderlab_time_to_first_token_seconds_sum", ())] > 0
    assert got[("decoderlab_queue_length", ())] == 0 and got[("decoderlab_running_rows", ())] == 0
