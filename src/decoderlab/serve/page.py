"""``GET /`` (and ``/index.html``): the glass-box page, one self-contained HTML file (``static/index.html``:
plain JS and SVG, nothing fetched from elsewhere); it needs no API key (it asks for one when the API does)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["page"])


def page_html() -> str:
    """The glass-box page (``static/index.html`` shipped with the package)."""
    return resources.files("decoderlab").joinpath("static/index.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse)
@router.get("/index.html", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    """The glass-box page."""
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})
