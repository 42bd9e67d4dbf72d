"""``GET /v1/decoderlab/head_scores``: the head scores a run recorded while it trained (``decoderlab train
--watch-heads N``: ``head_scores.jsonl`` in the run directory served), for the page to draw beside the loss --
``decoderlab.glassbox.watching``'s records as they are, and when each head formed."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from ..glassbox.watching import FORMED_AT, WATCH_FILE, formation_steps, read_records
from .body import JSONRoute
from .errors import ERROR_RESPONSES
from .trace_protocol import HeadScoreRecord, HeadScoresResponse

router = APIRouter(route_class=JSONRoute, tags=["glass box"])


def watched_records(run_dir: str | Path | None) -> HeadScoresResponse:
    """The records of ``run_dir`` (none without a run directory or a records file)."""
    path = None if run_dir is None else Path(run_dir) / WATCH_FILE
    if path is None or not path.is_file():
        return HeadScoresResponse(records=[], threshold=FORMED_AT, formed={})
    records = read_records(path)
    kinds = records[0]["scores"].keys() if records else ()
    formed = {kind: {f"L{layer}H{head}": step for (layer, head), step in formation_steps(records, kind).items()}
              for kind in kinds}
    return HeadScoresResponse(records=records, threshold=FORMED_AT, formed=formed)


@router.get("/v1/decoderlab/head_scores", response_model=HeadScoresResponse, responses=ERROR_RESPONSES)
async def head_scores_endpoint(request: Request) -> HeadScoresResponse:
    """Every head's detector scores and the loss as the served run recorded them while it trained."""
    return watched_records(getattr(request.app.state, "run_dir", None))
