"""The plan viewer: ``GET /`` and its files under ``/static``.

One static page shipped in the package (``web/static/``: HTML, CSS and
vanilla JavaScript as ES modules; no build step, nothing from a CDN). It talks
to the public API only (``/models``, ``/samplers``, ``/plan`` with
``breakdown`` and ``/advise``), so it is also a living example of the contract.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "router", "static_files"]

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def viewer_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def static_files() -> StaticFiles:
    """What the app mounts at ``/static``: the page's script and style."""
    return StaticFiles(directory=STATIC_DIR)
