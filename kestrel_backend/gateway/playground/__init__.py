"""The playground page (/playground): three static files shipped in the package, served with a strict content
policy (this origin only: no CDN, nothing inline), so the page works offline and a hostile answer cannot run."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

FOLDER = Path(__file__).parent
FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
         "playground.css": "text/css; charset=utf-8"}
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
          "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")


async def page(request: Request) -> Response:
    name = request.path_params.get("name", "index.html")
    if name not in FILES:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response((FOLDER / name).read_bytes(), media_type=FILES[name],
                    headers={"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache"})


async def to_page(request: Request) -> Response:
    return RedirectResponse("/playground/")
