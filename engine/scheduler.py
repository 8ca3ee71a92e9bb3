"""Who waits and who is admitted next: the waiting queue, held followers, admission.

Thread-safe: ``submit`` may come from any thread; the step loop takes admissions.
Every call into the flight coordinator (``engine.flights``, not thread-safe) is made
under this scheduler's one lock, so joining a flight and releasing it never
interleave; likewise ``engine.prefix_flights``. Followers held by single flight
(exact or prefix) join the front of the queue when released, so they are admitted
before later arrivals.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from itertools import chain, islice

from kvtier.tiers.page import PageKey

from .flights import FlightCoordinator
from .prefix_flights import PrefixFlights
from .request import Request


class Scheduler:
    def __init__(self, flights: FlightCoordinator, max_running: int, refresh_window: int) -> None:
        self.flights = flights
        self.prefix = PrefixFlights()
        self.max_running = max_running
        self.refresh_window = refresh_window
        self._waiting: deque[Request] = deque()
        self._held: dict[int, Request] = {}
        self._lock = threading.RLock()  # the serving loop waits on ``arrived`` and asks ``pending``
        self.arrived = threading.Condition(self._lock)

    def add(self, request: Request, flight_key: bytes) -> None:
        """Queue a request, or hold it behind an identical in-flight one."""
        with self._lock:
            if self.flights.join(request.rid, flight_key):
                self._held[request.rid] = request
            else:
                self._waiting.append(request)
            self.arrived.notify_all()

    def admit(self, running: int) -> list[Request]:
        """Requests to admit now, oldest first, keeping at most ``max_running`` running."""
        with self._lock:
            count = min(len(self._waiting), max(self.max_running - running, 0))
            return [self._waiting.popleft() for _ in range(count)]

    def refresh_candidates(self) -> list[Request]:
        """The first ``refresh_window`` waiting requests, in reverse queue order (DESIGN §7),
        so the LRU ends with the head of the queue most recently used."""
        with self._lock:
            return list(islice(self._waiting, self.refresh_window))[::-1]

    def cancelled(self) -> list[Request]:
        """Waiting or held requests whose cancellation was asked for."""
        with self._lock:
            return [r for r in chain(self._waiting, self._held.values()) if r.cancelled]

    def queued(self) -> list[Request]:
        """Every request not yet admitted, held ones included."""
        with self._lock:
            return [*self._waiting, *self._held.values()]

    def is_leader(self, rid: int) -> bool:
        """Whether requests wait for ``rid``'s prompt (exact) or pages (prefix)."""
        with self._lock:
            return self.flights.is_leader(rid) or self.prefix.is_leader(rid)

    def in_flight(self, keys: list[PageKey], start: int) -> tuple[int | None, int]:
        """(leader, count): the run of ``keys[start:]`` a running request is computing."""
        with self._lock:
            return self.prefix.in_flight(keys, start)

    def computing(self, rid: int, keys: list[PageKey]) -> None:
        """An admitted request will compute (and publish) ``keys``."""
        with self._lock:
            self.prefix.computing(rid, keys)

    def hold_for_prefix(self, request: Request, leader: int, awaited: PageKey, deadline: float) -> None:
        """Hold an admitted-to-be request until ``leader`` publishes ``awaited``, it ends,
        or ``deadline`` (perf_counter) passes."""
        with self._lock:
            self._held[request.rid] = request
            self.prefix.hold(request.rid, leader, awaited, deadline)

    def park(self, request: Request) -> None:
        """Hold a request leaving admission while its L3 pages are read (``engine.l3_wait``)."""
        with self._lock:
            self._held[request.rid] = request

    def unpark(self, request: Request) -> None:
        """Send a parked request back to the front of the queue."""
        with self._lock:
            self._waiting.appendleft(self._held.pop(request.rid))

    def published(self, rid: int, keys: Sequence[PageKey]) -> None:
        """A request published ``keys`` (may release prefix followers)."""
        with self._lock:
            self._release(self.prefix.published(rid, keys))

    def expire(self, now: float) -> None:
        """Release prefix followers whose deadline has passed."""
        with self._lock:
            self._release(self.prefix.expired(now))

    def prefilled(self, rid: int) -> None:
        """A request published its prompt pages (may release its followers)."""
        with self._lock:
            self._release(self.flights.prefilled(rid) + self.prefix.ended(rid))

    def finished(self, rid: int) -> None:
        """A request finished (may release its followers)."""
        with self._lock:
            self._release(self.flights.terminate(rid) + self.prefix.ended(rid))

    def withdraw(self, request: Request) -> None:
        """A request ended without finishing (cancelled, failed), admitted or not: it
        leaves the queue and its flight (a follower may take over as leader)."""
        with self._lock:
            if self._held.pop(request.rid, None) is None and request in self._waiting:
                self._waiting.remove(request)
            self.prefix.withdraw(request.rid)
            self._release(self.flights.withdraw(request.rid) + self.prefix.ended(request.rid))

    def _release(self, rids: list[int]) -> None:
        for rid in reversed(rids):
            self._waiting.appendleft(self._held.pop(rid))

    def pending(self) -> int:
        """Requests not yet admitted, held ones included."""
        with self._lock:
            return len(self._waiting) + len(self._held)
