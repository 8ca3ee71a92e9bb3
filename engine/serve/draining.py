"""Graceful shutdown of ``kvtier serve``: uvicorn stops accepting, the requests in flight
run for the drain timeout, then those left are cancelled, so each ends as the API says
(an error event, a 503) before the engine closes and flushes L1 and L2 to L3.
"""

from __future__ import annotations

import math
import threading

import uvicorn

from .app import KVTierServer
from .slow_clients import HEAD_TIMEOUT_S, KEEP_ALIVE_S, HeadTimeoutProtocol

# After the drain timeout the answers left end at once (``Serving.cancel_live``; the engine
# ends their requests at its next step); uvicorn kills what is still open this much later
# (it logs each as a traceback).
# uvicorn takes whole seconds: its backstop is rounded up, never earlier than this.
_DRAIN_GRACE_S = 10.0


class DrainingServer(uvicorn.Server):
    """uvicorn serving ``server.app``, whose graceful shutdown ends the requests itself.

    On the first SIGTERM / SIGINT uvicorn stops accepting and waits for the requests in
    flight; ``drain_timeout`` seconds later those left are cancelled (:meth:`Serving.cancel_live`),
    so every response ends as the API says (an error event, a 503) instead of being cut
    by uvicorn, whose own timeout comes ``_DRAIN_GRACE_S`` later as a backstop. A
    second Ctrl-C is uvicorn's forced exit. A connection closes ``keep_alive`` seconds
    after its last response, or ``head_timeout`` seconds into a request head that has
    not all arrived.
    """

    def __init__(
        self,
        server: KVTierServer,
        drain_timeout: float,
        log_level: str,
        head_timeout: float = HEAD_TIMEOUT_S,
        keep_alive: int = KEEP_ALIVE_S,
    ) -> None:
        super().__init__(
            uvicorn.Config(
                server.app,
                lifespan="on",
                log_level=log_level,
                timeout_graceful_shutdown=math.ceil(drain_timeout + _DRAIN_GRACE_S),
                # Connections that send no request are closed (``slow_clients``).
                http=HeadTimeoutProtocol.with_timeout(head_timeout),
                timeout_keep_alive=keep_alive,
            )
        )
        self._cancel_later = threading.Timer(drain_timeout, server.serving.cancel_live)
        self._cancel_later.daemon = True
        self._events = server.events

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:  # the first stop signal starts the drain clock
            self._cancel_later.start()
            self._events.close()  # an events stream never ends by itself: end it, so it holds up nothing
        super().handle_exit(sig, frame)
