"""What a server is made with (``ServerConfig``); re-exported by ``engine.serve.app``,
where callers find it."""

from __future__ import annotations

from dataclasses import dataclass

from .events import QUEUE_CHANGES


@dataclass
class ServerConfig:
    model_name: str  # the id clients send as ``model`` and ``/v1/models`` lists
    max_waiting: int = 64  # requests queued for a batch slot; past it, 429
    default_max_tokens: int = 512  # when a request names none (capped by the context)
    max_body_bytes: int = 8 << 20  # larger bodies answer 413
    body_timeout_s: float = 60.0  # a body not all received by then answers 408 (a trickling client)
    tool_warm_s: float = 120.0  # an answer that ends in a tool call is held this long (0: not held)
    events_queue: int = QUEUE_CHANGES  # page changes an events stream may have unsent before it is closed
