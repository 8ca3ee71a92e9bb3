"""``kvtier serve``: OpenAI- and Anthropic-compatible HTTP on one :class:`Engine` (DESIGN §8a).

The engine keeps mlx on its one serving thread (``Engine.start``); handlers only
tokenize, submit, read ``Request.stream`` and cancel. Blocking calls (submission
takes the store's lock, a stream waits for the next token) run in worker threads,
so the event loop never waits on the engine.

A request's life here: its API key checked (``tenancy.Authenticate``: 401, or 403 for
the server's own numbers without an admin key), read the body (413 past the limit),
check it (``api``: 400 or 404), render and tokenize the prompt, find where its keys
start (its tenant's root, ``tenancy``), check it against the context, refuse it
with 429 if the waiting queue is full, submit, then stream or collect the text, cut at
the first stop string. A client that goes away cancels its request (batch slot and
pins released). On shutdown (``draining.DrainingServer``) the server stops accepting, lets
the requests in flight run for the drain timeout, then cancels those left, whose
streams end with an error event; then the engine closes, which flushes L1 and L2 to L3.

The server is a thin app over parts with one job each: ``serving.Serving`` (the steps
every generation endpoint shares, and the requests in flight), ``openai_routes`` and
``anthropic_routes`` (one API family each), ``admin``, ``dashboard`` and ``events``; this
module wires them, runs the lifecycle and the server's own endpoints (health, metrics,
stats), and turns every error into its API's error shape.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import Engine
from ..limits import TextLimit
from .admin import Admin, Pins
from .anthropic_routes import ANTHROPIC_PATHS, AnthropicRoutes
from .api import APIError
from .dashboard import Dashboard
from .events import EventStream
from .holds import Holds
from .openai_routes import OpenAIRoutes
from .recent import RecentRequests
from .server_config import ServerConfig
from .serving import Serving
from .tenancy import Authenticate, Tenancy

__all__ = ["DEFAULT_MODEL_ID", "KVTierServer", "ServerConfig"]

log = logging.getLogger(__name__)

# The id of a server started without --model or --served-model-name: the same whichever
# default model is installed (SmolLM2-135M-Instruct or kvtier-tiny), so the README's
# examples and a client's settings work on either.
DEFAULT_MODEL_ID = "kvtier-default"


class KVTierServer:
    """The ASGI app and what it shares: the engine, its metrics, the requests in flight
    (``serving``), the holds, the events stream."""

    def __init__(self, engine: Engine, config: ServerConfig, tenancy: Tenancy | None = None) -> None:
        self.engine = engine
        self.config = config
        # without one: no keys, and a secret of this process's for cache_salt roots
        self.tenancy = tenancy or Tenancy({}, os.urandom(32), engine.root, engine.config.page_size)
        self.tokenizer = engine.loaded.tokenizer
        self._closing = threading.Event()  # ends the holds' sweeper
        store = engine.store
        self.holds = Holds(store, store.accounts.view().l1.max_pages // 2 if store is not None else 0)
        recent = RecentRequests()  # the dashboard's last requests
        self.serving = Serving(engine, config, self.holds, recent)
        self.metrics = self.serving.metrics
        text_limit = TextLimit.measure(self.tokenizer, self.serving.context)  # refuses huge prompts untokenized
        pins = Pins(store, self.holds.limit)
        dashboard = Dashboard(engine, config.model_name, recent, self.serving.gauges, pins.listing)
        self.events = EventStream(engine, config.events_queue)  # a fleet router's view (DESIGN §11)
        self.app = Starlette(
            routes=[
                *OpenAIRoutes(self.serving, self.tenancy, text_limit, int(time.time())).routes(),
                *AnthropicRoutes(self.serving, self.tenancy, text_limit).routes(),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/kvtier/stats", self.stats, methods=["GET"]),
                self.events.route(),
                *dashboard.routes(),
                Admin(engine, recent, pins, self.tokenizer).mount(),  # every admin action: /v1/kvtier/admin/...
            ],
            # Starlette types every handler as taking any Exception although it dispatches by
            # class (Kludex/starlette#2417), so a handler of one class is a dict-item error.
            exception_handlers={
                APIError: self._api_error,  # type: ignore[dict-item]
                HTTPException: self._http_error,  # type: ignore[dict-item]
                Exception: self._internal_error,
            },
            middleware=[Middleware(Authenticate, tenancy=self.tenancy, anthropic_paths=ANTHROPIC_PATHS)],
            lifespan=self._lifespan,
        )

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.holds.sweep_every(1.0, self._closing)

    def close(self) -> None:
        """Cancel what is still running, stop the engine and flush the store to L3 (idempotent)."""
        self._closing.set()
        self.events.close()
        self.engine.stop(cancel=True)
        self.engine.close()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette):
        # Every live stream holds a worker thread while it waits for a token.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, self.config.max_waiting + self.engine.config.max_running + 8)
        yield

    # -- the server's own endpoints ---------------------------------------------------

    async def health(self, http: HTTPRequest) -> Response:
        """200 while the engine serves; "degraded", naming the tiers, while one of the
        store's answers slowly or not at all (requests recompute what it holds)."""
        store = self.engine.store
        degraded = store.accounts.degraded() if store is not None else []
        body = {"status": "degraded" if degraded else "ok", "model": self.config.model_name}
        return JSONResponse({**body, "degraded": degraded} if degraded else body)

    async def prometheus(self, http: HTTPRequest) -> Response:
        text = await anyio.to_thread.run_sync(self.metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats(self, http: HTTPRequest) -> Response:
        stats = await anyio.to_thread.run_sync(self.engine.stats)
        return JSONResponse({**stats.to_json(), "server": self.serving.gauges()})

    # -- errors ---------------------------------------------------------------------

    async def _api_error(self, http: HTTPRequest, err: APIError) -> Response:
        return JSONResponse(
            err.body(anthropic=http.url.path in ANTHROPIC_PATHS), status_code=err.status, headers=err.headers
        )

    async def _http_error(self, http: HTTPRequest, err: HTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return await self._api_error(
            http, APIError(err.status_code, f"{http.method} {http.url.path}: {err.detail}", kind)
        )

    async def _internal_error(self, http: HTTPRequest, err: Exception) -> Response:
        log.exception("request to %s failed", http.url.path)
        return await self._api_error(http, APIError(500, f"internal error: {type(err).__name__}", "server_error"))
