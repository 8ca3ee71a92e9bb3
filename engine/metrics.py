"""Windowed rates (DESIGN §5): e.g. cached tokens per second over the last 30 s."""

from __future__ import annotations

import threading
import time
from collections import deque


class RateWindow:
    """Amounts recorded in the last ``window_s`` seconds, as a per-second rate.

    Holds only the events of the last window: older ones are dropped as new ones
    arrive (and when the rate is read), so a long-running engine stays flat.
    """

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, amount))
            self._prune(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            return sum(amount for _, amount in self._events) / self.window_s

    def held(self) -> int:
        """Events kept now (at most a window's worth: what keeps a long run flat)."""
        with self._lock:
            return len(self._events)

    def _prune(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
