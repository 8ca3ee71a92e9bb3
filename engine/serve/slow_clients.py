"""Clients that hold a connection without sending a request: closed after a deadline.

uvicorn closes an idle keep-alive connection ``timeout_keep_alive`` seconds after its
last response, but has no deadline for a request's head: a connection that never
sends one, or trickles it a byte at a time (slowloris), stays open for ever, and
enough of them exhaust the server's file descriptors. :class:`HeadTimeoutProtocol`
gives every request head ``head_timeout`` seconds from its first byte (from the
connection's start for the first request); past it the connection is closed. A body
that arrives too slowly is the app's to refuse (``ServerConfig.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import functools
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # a request line and headers, from the first byte (or the connection)
KEEP_ALIVE_S = 5  # an idle connection between requests, whole seconds (uvicorn's own default)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request head.

    Invariant: while the connection waits for a head (h11's client state is IDLE)
    after bytes of it arrived or since the connection opened, a timer is armed; it is
    cancelled once the head is complete (the client state moves on), and when it fires
    the connection is closed. Between requests uvicorn's keep-alive timer is the one
    that runs."""

    def __init__(self, *args, head_timeout: float = HEAD_TIMEOUT_S, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, head_timeout: float):
        """The protocol factory uvicorn's ``Config(http=...)`` takes."""
        return functools.partial(cls, head_timeout=head_timeout)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self._head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request head in %.0f s", self._head_timeout)
            self.transport.close()
