"""Forwarding one request: to the backend the policy chose, again to another when that
one fails before its answer started, and never past the deadline.

An answer has started when its first body byte came from the backend: only then does
the client get the status and headers (with ``x-kvtier-backend`` naming the backend),
then every byte as the backend sent it. Until then a failure is retried on a backend
not tried yet: a connection refused or broken, a backend the health checks take out
while it is waited on (a hung one), or a 429/503 (the backend was full or stopping and
did nothing; the last one is passed on when no other backend is left). After it, a
broken stream ends with an error event in the endpoint's style; a plain answer ends
where it broke. No client waits past ``deadline_s`` for an answer to start (504), and
one no backend can take is a 503 at once; both OpenAI- or Anthropic-style errors.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..serve.api import APIError
from ..serve.responses import AnthropicShape, OpenAIShape
from . import health
from .placement import Placer, Ticket

log = logging.getLogger(__name__)

BACKEND_HEADER = "x-kvtier-backend"
RETRIED_STATUSES = (429, 503)
# Hop-by-hop headers, and those the client or uvicorn sets itself.
REQUEST_DROPPED = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
RESPONSE_DROPPED = {"connection", "keep-alive", "transfer-encoding", "date", "server"}
WATCH_S = 0.1  # how often a wait for an answer looks at the backend's health


@dataclass(frozen=True)
class Outgoing:
    """What goes to a backend: the client's method, path and query, headers and body."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    anthropic: bool  # errors in Anthropic's style


class Gone(Exception):
    """The attempt failed before the answer started (``refused``: nothing listens there)."""

    def __init__(self, why: str, refused: bool = False) -> None:
        super().__init__(why)
        self.refused = refused


@dataclass
class Started:
    response: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes]


class Proxy:
    def __init__(self, client: httpx.AsyncClient, placer: Placer, deadline_s: float) -> None:
        self.client, self.placer, self.deadline_s = client, placer, deadline_s
        self.retries = 0
        self.timeouts = 0

    async def forward(self, out: Outgoing, tokens: list[int] | None) -> Response:
        tried: set[str] = set()
        held: tuple[Ticket, httpx.Response, bytes] | None = None  # a 429/503 kept for when nothing is left
        ticket: Ticket | None = None
        started: Started | None = None
        with anyio.move_on_after(self.deadline_s) as waited:
            while (ticket := await self.placer.place(tokens, tried)) is not None:
                tried.add(ticket.backend.name)
                try:
                    started = await self._start(ticket, out)
                except Gone as err:
                    ticket.end()
                    health.mark(ticket.backend, False, refused=err.refused)
                    log.warning("%s failed before answering (%s): retried elsewhere", ticket.backend.name, err)
                    self.retries += 1
                    continue
                if started.response.status_code not in RETRIED_STATUSES:
                    break
                body = started.first + b"".join([chunk async for chunk in started.chunks])
                await started.response.aclose()
                ticket.end()
                held, started = (ticket, started.response, body), None
                self.retries += 1
        if waited.cancelled_caught:
            if started is not None:
                await started.response.aclose()
            if ticket is not None:
                ticket.end()
            self.timeouts += 1
            return self._error(
                APIError(504, f"no backend answered within {self.deadline_s:g} s", "timeout_error", code="deadline"),
                out,
            )
        if started is not None and ticket is not None:
            return self._relay(ticket, started, out)
        if held is not None:
            done, response, body = held
            return Response(body, response.status_code, _response_headers(response, done))
        why = "no backend is available" if not tried else f"no backend could take the request ({len(tried)} tried)"
        return self._error(APIError(503, why, "overloaded_error", code="no_backend"), out)

    async def _start(self, ticket: Ticket, out: Outgoing) -> Started:
        """Send and wait for the first body byte, or Gone (the backend failed or was taken out)."""
        backend = ticket.backend
        request = self.client.build_request(
            out.method, backend.url + out.path, headers=_request_headers(out.headers), content=out.body
        )
        outcome: list[Started | Gone] = []

        async def send(scope: anyio.CancelScope) -> None:
            response = None
            try:
                response = await self.client.send(request, stream=True)
                chunks = response.aiter_raw()
                outcome.append(Started(response, await anext(chunks, b""), chunks))
            except httpx.HTTPError as err:
                outcome.append(Gone(type(err).__name__, refused=isinstance(err, httpx.ConnectError)))
            finally:
                if response is not None and (not outcome or isinstance(outcome[0], Gone)):
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            while backend.healthy:
                await anyio.sleep(WATCH_S)
            scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(send, group.cancel_scope)
            group.start_soon(watch, group.cancel_scope)
        if not outcome:
            raise Gone("taken out by the health checks")
        if isinstance(outcome[0], Gone):
            raise outcome[0]
        ticket.answering()
        return outcome[0]

    def _relay(self, ticket: Ticket, started: Started, out: Outgoing) -> Response:
        response = started.response
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            try:
                yield started.first
                async for chunk in started.chunks:
                    yield chunk
            except httpx.HTTPError as err:
                log.warning("%s broke off an answer (%s)", ticket.backend.name, type(err).__name__)
                if streaming:
                    failed = APIError(502, f"the backend {ticket.backend.name} broke off the answer", "api_error")
                    events = AnthropicShape.error_events(failed) if out.anthropic else OpenAIShape.error_chunks(failed)
                    yield "".join(events).encode()
            finally:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
                ticket.end()

        return StreamingResponse(body(), response.status_code, _response_headers(response, ticket))

    def _error(self, err: APIError, out: Outgoing) -> Response:
        return JSONResponse(err.body(anthropic=out.anthropic), err.status)

    def view(self) -> dict:
        return {"retries": self.retries, "deadline_timeouts": self.timeouts, "deadline_s": self.deadline_s}


def _request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in REQUEST_DROPPED}


def _response_headers(response: httpx.Response, ticket: Ticket) -> dict[str, str]:
    kept = {name: value for name, value in response.headers.items() if name.lower() not in RESPONSE_DROPPED}
    return {**kept, BACKEND_HEADER: ticket.backend.name}
