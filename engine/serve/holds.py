"""Pages held in the fast tiers for a while (DESIGN §8a): the prefix up to an Anthropic
``cache_control`` breakpoint for its TTL (5 minutes, or an hour), and a conversation
whose answer ended in a tool call until the tool's result is likely back
(``--tool-warm``), so that other traffic does not evict what the next turn restores.

A hold is a store pin (``TieredStore.keeping.pin``): its pages stay in L1 or L2, wherever they
are, and pins never exceed ``limit`` pages in all (half of L1 by default), so held
pages can never fill the fast tiers: a hold that does not fit is cut short and the
usage says how much was held. Holding the same pages again renews the deadline, as a
cache hit renews Anthropic's TTL. A tool wait that does not fit releases older tool
waits first, oldest first (the newest answer's tool is the one whose result comes
next; an older conversation's wait, or an earlier turn's whose prompt has changed
since, would otherwise keep the cap until its time is up); ``cache_control`` holds,
which a client asked for, are never released early. Expired holds are released every second
(``sweep_every``) and whenever a request is submitted, so a hold ends on time. The
hold of an answer that ended in a tool call includes its last partial page
(``Request.ended_in``), so the next turn resumes where the answer ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.tiers.checkpoints import repeat
from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import PageKey

TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control ttl values, in seconds
TOOL_WAIT = "tool_wait"  # the kind of an answer's hold while its tool runs


@dataclass
class Hold:
    keys: list[PageKey]
    until: float


class Holds:
    def __init__(self, store: TieredStore | None, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.limit, self.clock = store, limit, clock
        self._holds: dict[tuple[str, PageKey], Hold] = {}
        self._lock = threading.Lock()

    def hold(self, kind: str, keys: list[PageKey], ttl_s: float) -> int:
        """Hold the leading pages of ``keys`` for ``ttl_s`` seconds; the number held."""
        self.sweep()
        if self.store is None or not keys:
            return 0
        ident = (kind, keys[-1])
        with self._lock:
            held = self.store.keeping.pin(
                keys, self.limit
            )  # before the old hold goes: its pages never unpinned between
            while kind == TOOL_WAIT and held < len(keys):  # the newest tool wait wins over older ones
                older = next((i for i in self._holds if i[0] == TOOL_WAIT and i != ident), None)
                if older is None:
                    break
                self.store.release(self._holds.pop(older).keys)
                self.store.release(keys[:held])
                held = self.store.keeping.pin(keys, self.limit)
            old = self._holds.pop(ident, None)
            if old is not None:
                self.store.release(old.keys)
            if held:
                self._holds[ident] = Hold(keys[:held], self.clock() + ttl_s)
        return held

    def sweep(self) -> None:
        """Release the holds whose time is up."""
        if self.store is None:
            return
        now = self.clock()
        with self._lock:
            for ident in [i for i, h in self._holds.items() if h.until <= now]:
                self.store.release(self._holds.pop(ident).keys)

    def sweep_every(self, seconds: float, stop: threading.Event) -> None:
        """``sweep`` every ``seconds`` until ``stop`` is set (a daemon thread)."""
        repeat(seconds, stop, self.sweep, "hold release")

    def pages(self) -> int:
        """Pages held now (a page in two holds counts twice)."""
        with self._lock:
            return sum(len(h.keys) for h in self._holds.values())
