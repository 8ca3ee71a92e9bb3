"""The dashboard of ``kvtier serve`` (DESIGN §8a): ``GET /dashboard`` (``/`` redirects
to it), its static files, and the JSON feed it and ``kvtier top`` poll once a second.

The page is served from the package's ``static/`` folder and fetches nothing from
anywhere else: its charts are Chart.js (MIT), shipped there as the npm package's
minified file. The feed (``GET /v1/kvtier/dashboard``) is one snapshot: ``stats`` is
exactly what ``/v1/kvtier/stats`` answers at that moment (``Engine.stats().to_json()``
with the server's waiting and running requests), beside the latency percentiles and
the last requests from ``recent``, the L3 namespaces (what ``kvtier store ls`` reads)
and the operator's pins. The page keeps the history it draws; the server keeps only
the bounded ring, so an idle dashboard costs one stats read a second.

Actions live under ``admin`` (one route prefix), so that an auth check covers them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib.resources import files
from typing import Any

import anyio
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from ..engine import Engine
from .api import APIError
from .recent import RecentRequests

FEED_PATH = "/v1/kvtier/dashboard"
STATIC_PREFIX = "/dashboard/static/"
FEED_REQUESTS = 20  # requests the feed shows, newest first
# The page's files and their media types: nothing else under static/ is served.
STATIC = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "chart.umd.min.js": "text/javascript; charset=utf-8",
}
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def static_text(name: str) -> str:
    """A file of the page, read from the installed package."""
    return files("kvtier.engine.serve").joinpath("static").joinpath(name).read_text(encoding="utf-8")


class Dashboard:
    """The page's routes and its feed, over the server's engine and request ring."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        recent: RecentRequests,
        gauges: Callable[[], dict[str, int]],
        pins: Callable[[], list[dict]],
    ) -> None:
        self.engine, self.model, self.recent = engine, model, recent
        self.gauges, self.pins = gauges, pins

    def routes(self) -> list[Route]:
        return [
            Route("/", self.root, methods=["GET"]),
            Route("/dashboard", self.page, methods=["GET"]),
            Route(STATIC_PREFIX + "{name}", self.static, methods=["GET"]),
            Route(FEED_PATH, self.feed_route, methods=["GET"]),
        ]

    async def root(self, http: HTTPRequest) -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    async def page(self, http: HTTPRequest) -> Response:
        return Response(static_text("dashboard.html"), media_type="text/html; charset=utf-8", headers=_headers())

    async def static(self, http: HTTPRequest) -> Response:
        name = http.path_params["name"]
        if name not in STATIC:
            raise APIError(404, f"no dashboard file {name!r}", "not_found_error", code="not_found")
        return Response(static_text(name), media_type=STATIC[name], headers=_headers())

    async def feed_route(self, http: HTTPRequest) -> Response:
        return JSONResponse(await anyio.to_thread.run_sync(self.feed), headers={"Cache-Control": "no-store"})

    def feed(self) -> dict[str, Any]:
        now = time.time()
        return {
            "time": now,
            "model": self.model,
            "stats": {**self.engine.stats().to_json(), "server": self.gauges()},
            "latency": self.recent.latency(now),
            "requests": [r.to_json() for r in self.recent.records()[:FEED_REQUESTS]],
            "namespaces": namespaces(self.engine),
            "pins": self.pins(),
        }


def namespaces(engine: Engine) -> list[dict]:
    """The L3 namespaces that hold pages, last used first: digest (hex), what it is
    (model, page size, dtype), pages, tokens, bytes, last use (Unix time)."""
    store = engine.store
    if store is None or store.disk is None:
        return []
    disk = store.disk
    rows = []
    for digest, row in disk.tables.namespaces().items():
        if row.get("pages"):
            about = row.get("about", {})
            rows.append(
                {
                    "namespace": digest.hex(),
                    "model": about.get("model", "?"),
                    "page_size": about.get("page_size", "?"),
                    "dtype": about.get("dtype", "?"),
                    "pages": row["pages"],
                    "tokens": row.get("tokens", 0),
                    "bytes": row.get("bytes", 0),
                    "last_use": row.get("last_use", 0),
                    "current": digest == store.ns_digest,
                }
            )
    return sorted(rows, key=lambda r: -r["last_use"])


def _headers() -> dict[str, str]:
    """The page may load only its own files and talk only to its own server."""
    return {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
