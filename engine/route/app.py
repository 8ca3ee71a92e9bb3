"""The router's ASGI app: the endpoints of ``kvtier serve`` (DESIGN §8a), each request
placed (``placement``) and forwarded (``proxy``), and the router's own view.

A request's life here: read the body, parse and render it as the backend will (the
same ``api`` models and ``prompt`` rendering: a body that does not parse or render is
forwarded all the same, placed by load, and the backend's own error goes back), place
it, forward it. Nothing of a prompt is logged or shown: the view counts pages and
requests. Each backend's event stream and health checks run for the app's lifetime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..serve import api
from ..serve.anthropic_routes import ANTHROPIC_PATHS
from ..serve.api import APIError
from ..serve.prompt import anthropic_prompt, chat_prompt
from . import health, stream
from .backend import Backend
from .l3 import SharedL3
from .placement import Placer
from .proxy import Outgoing, Proxy

log = logging.getLogger(__name__)


VIEW_PATH = "/v1/kvtier/route"
CONNECT_TIMEOUT_S = 5.0
_Body = TypeVar("_Body", api.ChatCompletionRequest, api.CompletionRequest, api.MessagesRequest)


class RouterApp:
    """The app and what it shares: the backends, the placer, the proxy, the tokenizer."""

    def __init__(
        self,
        tokenizer,
        backends: Sequence[Backend],
        placer: Placer,
        deadline_s: float,
        api_key: str | None = None,
        l3: SharedL3 | None = None,
    ) -> None:
        self.tokenizer, self.backends, self.placer, self.l3 = tokenizer, list(backends), placer, l3
        self._admin = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The answers: as many at once as clients send (no pool limit), and no read timeout:
        # an answer may take long to start (a plain one starts when it is done); the deadline bounds it.
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        )
        self._watch = httpx.AsyncClient()  # streams and health checks, apart from the answers' pool
        self.proxy = Proxy(self._client, placer, deadline_s)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.passed, methods=["POST"]),
                Route("/v1/models", self.passed, methods=["GET"]),
                Route("/v1/models/{model:path}", self.passed, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route(VIEW_PATH, self.view, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},  # type: ignore[dict-item]
            lifespan=self._lifespan,
        )

    @asynccontextmanager
    async def _lifespan(self, app: Starlette):
        async with anyio.create_task_group() as group:
            for backend in self.backends:
                group.start_soon(health.watch, self._watch, backend)
                group.start_soon(stream.follow, self._watch, backend, self._admin)
            try:
                yield
            finally:
                group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self._client.aclose()
                    await self._watch.aclose()
                    if self.l3 is not None:
                        self.l3.close()

    # -- the API ---------------------------------------------------------------------

    async def chat_completions(self, http: Request) -> Response:
        body = await http.body()
        tokens = await self._tokens(body, api.ChatCompletionRequest, lambda b: chat_prompt(self.tokenizer, b).tokens)
        return await self._forward(http, body, tokens)

    async def completions(self, http: Request) -> Response:
        body = await http.body()

        def encode(request: api.CompletionRequest) -> list[int]:
            prompt = request.prompt
            return list(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)

        return await self._forward(http, body, await self._tokens(body, api.CompletionRequest, encode))

    async def messages(self, http: Request) -> Response:
        body = await http.body()
        tokens = await self._tokens(body, api.MessagesRequest, lambda b: anthropic_prompt(self.tokenizer, b).tokens)
        return await self._forward(http, body, tokens)

    async def passed(self, http: Request) -> Response:
        """Forwarded as it is, to the least loaded backend."""
        return await self._forward(http, await http.body(), None)

    async def _tokens(self, raw: bytes, model: type[_Body], render: Callable[[_Body], list[int]]) -> list[int] | None:
        """The prompt's tokens as the backend will render them; None for a body it will refuse."""
        try:
            body = api.parse_body(raw, model)
            return await anyio.to_thread.run_sync(render, body)
        except APIError:
            return None

    async def _forward(self, http: Request, body: bytes, tokens: list[int] | None) -> Response:
        path = http.url.path + (f"?{http.url.query}" if http.url.query else "")
        out = Outgoing(http.method, path, dict(http.headers), body, http.url.path in ANTHROPIC_PATHS)
        return await self.proxy.forward(out, tokens)

    # -- the router's own --------------------------------------------------------------

    async def health(self, http: Request) -> Response:
        """200 while a backend answers, else 503."""
        up = sum(b.healthy for b in self.backends)
        body = {"status": "ok" if up else "unavailable", "backends": len(self.backends), "healthy": up}
        return JSONResponse(body, 200 if up else 503)

    async def view(self, http: Request) -> Response:
        """The router's view: each backend's health, index sizes and load, and the counts
        of placements (by backend, by reason), retries and timeouts. No prompt, no key."""
        return JSONResponse(
            {
                **self.placer.view(),
                **self.proxy.view(),
                "l3": None if self.l3 is None else {"location": self.l3.location, "lookups": self.l3.lookups},
                "backends": [b.view() for b in self.backends],
            }
        )

    async def _http_error(self, http: Request, err: HTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        failed = APIError(err.status_code, f"{http.method} {http.url.path}: {err.detail}", kind)
        return JSONResponse(failed.body(anthropic=http.url.path in ANTHROPIC_PATHS), err.status_code)
