"""The chat page: static files shipped inside the package (ds4py/server/static/), no build step, no CDN.

`GET /` answers the page to a browser (an Accept header that prefers text/html) and the JSON index to every
other client; `GET /chat` is the page whatever the Accept header. The page and its files load without the API
key (they hold no data): the page asks for the key and sends it on its API calls.
"""

from __future__ import annotations

import re
from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE = "chat.html"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png",
         ".svg": "image/svg+xml"}
_NAME = re.compile(r"^[a-z][a-z0-9_-]*\.(js|css|png|svg)$")      # no folders, no dot files: no path traversal

# The page builds its DOM from text nodes; this policy makes sure that even a renderer bug cannot run a script
# that came from the model (no inline script, nothing from another origin).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


def _q(params: list[str]) -> float:
    for p in params:
        k, _, v = p.strip().partition("=")
        if k.strip().lower() == "q":
            try:
                return float(v)
            except ValueError:
                return 0.0
    return 1.0


def prefers_html(accept: str | None) -> bool:
    """True when the Accept header ranks text/html above application/json (a browser navigating to `/`);
    `*/*` alone (curl, SDKs, probes) is not a preference for HTML."""
    if not accept:
        return False
    html = json = 0.0
    for item in accept.split(","):
        media, *params = item.split(";")
        media = media.strip().lower()
        q = _q(params)
        if media == "text/html":
            html = max(html, q)
        elif media in ("application/json", "application/*"):
            json = max(json, q)
    return html > 0 and html > json


def is_public(request: web.Request) -> bool:
    """The page and its static files: served without the API key."""
    if request.method not in ("GET", "HEAD"):
        return False
    path = request.path
    return path == "/chat" or path.startswith("/static/") or (path == "/" and
                                                              prefers_html(request.headers.get("Accept")))


def _file(name: str) -> web.Response:
    path = STATIC_DIR / name
    if not path.is_file():
        raise web.HTTPNotFound()
    return web.Response(body=path.read_bytes(), headers={**HEADERS, "Content-Type": TYPES[path.suffix] +
                                                         ("; charset=utf-8" if path.suffix != ".png" else "")})


def page_response() -> web.Response:
    return _file(PAGE)


async def chat(request: web.Request) -> web.Response:
    return page_response()


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not _NAME.match(name):
        raise web.HTTPNotFound()
    return _file(name)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/chat", chat)
    router.add_get("/static/{name}", static)
