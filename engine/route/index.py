"""What the router knows one backend holds: the page keys of its L1 and L2 (from its
event stream), and the pages of requests the router sent there that it does not hold
yet ("in flight", counted as if in its L1).

The in-flight count is prefix single flight across engines: the first request of a new
prefix is sent to one backend; the requests that follow while it is prefilled see its
pages there already, so they go there too (within the load bound) and wait for them
(the backend's own single flight) instead of computing them again elsewhere. A page
stops being in flight when the backend publishes it, or when the last request that flew
it ends: at once for a request that failed there, ``PUBLISH_GRACE_S`` after the answer
of one that was served (its pages are stored by then, and published within one batch
of the stream; a follower that comes in between still finds them).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from kvtier.tiers.page import Source

TIERS = (Source.L1, Source.L2)  # the tiers a backend's event stream lists
PUBLISH_GRACE_S = 2.0  # more than a loaded backend takes to publish what it stored


class PageIndex:
    """One backend's pages by tier, and the pages in flight to it. Keys are the raw
    ``PageKey`` bytes. Invariant: a key is in at most one of L1 and L2 (a page moving
    down is evicted from L1 and stored in L2; a stored page leaves the other tier)."""

    def __init__(self) -> None:
        self._tiers: dict[Source, set[bytes]] = {tier: set() for tier in TIERS}
        self._flights: Counter[bytes] = Counter()
        self._landing: deque[tuple[float, list[bytes]]] = deque()  # (when, keys) of served requests

    def reset(self, pages: Mapping[Source, Iterable[bytes]]) -> None:
        """Replace what the backend holds with a full snapshot (its hello)."""
        for tier in TIERS:
            self._tiers[tier] = set(pages.get(tier, ()))
        self._tiers[Source.L2] -= self._tiers[Source.L1]

    def clear(self) -> None:
        """Forget what the backend holds (a gap in its stream, or it went away). Pages in
        flight stay until their requests end: the router sent them, whatever the stream says."""
        for pages in self._tiers.values():
            pages.clear()

    def apply(self, tier: Source, stored: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        """One ``pages`` event: evictions first, so a page evicted and stored again in one
        batch stays; a page stored in one tier leaves the other, and stops being in flight."""
        held, other = self._tiers[tier], self._tiers[Source.L2 if tier is Source.L1 else Source.L1]
        held.difference_update(evicted)
        for key in stored:
            held.add(key)
            other.discard(key)
            self._flights.pop(key, None)

    def where(self, key: bytes) -> Source | None:
        """L1 for a page in L1 or in flight, L2 for one in L2, else None."""
        self._land_due()
        if key in self._tiers[Source.L1] or key in self._flights:
            return Source.L1
        return Source.L2 if key in self._tiers[Source.L2] else None

    def in_flight(self, key: bytes) -> bool:
        return key in self._flights

    def fly(self, keys: Sequence[bytes]) -> list[bytes]:
        """Count the pages of ``keys`` the backend does not hold as in flight; the keys
        counted, for :meth:`land` when the request ends."""
        flown = [key for key in keys if self.where(key) is None or key in self._flights]
        self._flights.update(flown)
        return flown

    def land(self, keys: Sequence[bytes], served: bool = False) -> None:
        """A request that flew ``keys`` ended: each one's count down by one (gone at 0;
        one the backend published already is not counted any more), ``PUBLISH_GRACE_S``
        from now for a request the backend ``served``."""
        if served:
            self._landing.append((time.monotonic() + PUBLISH_GRACE_S, list(keys)))
            return
        for key in keys:
            if key in self._flights:
                self._flights[key] -= 1
                if self._flights[key] <= 0:
                    del self._flights[key]

    def _land_due(self) -> None:
        now = time.monotonic()
        while self._landing and self._landing[0][0] <= now:
            self.land(self._landing.popleft()[1])

    def sizes(self) -> dict[str, int]:
        """Pages per tier and in flight (the router's view)."""
        self._land_due()
        return {**{tier.value: len(self._tiers[tier]) for tier in TIERS}, "in_flight": len(self._flights)}
