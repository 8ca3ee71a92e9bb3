"""Windowed rates (DESIGN §5): e.g. cached tokens per second over the last 30 s."""

from __future__ import annotations

import threading
import time
from collections import deque


class RateWindow:
    """Amounts recorded in the last ``window_s`` seconds, as a per-second rate."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, amount: float, now: float | None = None) -> None:
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, amount))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(amount for _, amount in self._events) / self.window_s
