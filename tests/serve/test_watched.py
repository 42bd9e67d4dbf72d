"""``GET /v1/decoderlab/head_scores`` (decoderlab.serve.watched): a served run's recorded head scores, as
decoderlab.glassbox.watching reads them, and when each head formed."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from decoderlab.glassbox.watching import FORMED_AT, append_record, formation_steps, read_records  # noqa: E402
from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .helpers import tiny_model  # noqa: E402


def test_a_served_runs_head_scores_and_when_each_head_formed(tmp_path):
    model, tok = tiny_model()
    for step, score in ((0, 0.05), (5, 0.2), (10, 0.35)):
        table = [[0.01, score], [0.02, 0.03]]
        append_record(tmp_path, {"step": step, "loss": None if step == 0 else 3.0 - step / 10,
                                 "scores": {"previous_token": table, "duplicate_token": table, "induction": table}})
    with ServerThread(create_app(model, tok, model_id="tiny", template=None, run_dir=tmp_path)) as url:
        d = httpx.get(url + "/v1/decoderlab/head_scores").json()
    records = read_records(tmp_path)
    assert d["records"] == records and d["threshold"] == FORMED_AT
    want = {f"L{layer}H{head}": step for (layer, head), step in formation_steps(records, "induction").items()}
    assert d["formed"]["induction"] == want and want["L0H1"] == 10 and want["L1H0"] is None
    with ServerThread(create_app(model, tok, model_id="tiny", template=None, run_dir=tmp_path / "none")) as url:
        assert httpx.get(url + "/v1/decoderlab/head_scores").json() == {"records": [], "threshold": FORMED_AT,
                                                                        "formed": {}}
