"""Where pages stay outside a request's restore and publish (``TieredStore.keeping``):
holds (pins that a server keeps past a request), recency marks, a flush of every page
down to L3, and dropping L2's copies.

Invariants: everything here runs under the store's lock; a hold never forces a page in
(it pins only what L1 or L2 holds, up to a limit); a flush writes each page to L3 at most
once (``tiers.placement``); dropping L2 frees slots and leaves L1 and L3 as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .page import PageKey
from .placement import Pins, Placement
from .snapshots import Snapshots
from .tier import DeviceTier, HostTier


class Keeping:
    """Pins, recency and flushes of one store's pages, under that store's lock."""

    def __init__(
        self,
        lock: threading.RLock,
        tiers: tuple[DeviceTier, HostTier],
        pins: Pins,
        placement: Placement,
        snapshots: Snapshots | None,
    ) -> None:
        self._lock = lock
        self.l1, self.l2 = tiers
        self.pins = pins
        self.placement = placement
        self.snapshots = snapshots

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark ``keys``' L1 pages recently used (a waiting request will want them);
        pins nothing and loads nothing."""
        with self._lock:
            for key in keys:
                if key in self.l1:
                    self.l1.get(key)

    def pin(self, keys: Sequence[PageKey], limit: int) -> int:
        """Pin the leading run of ``keys`` that L1 or L2 holds, so that neither evicts them
        until ``TieredStore.release``; no new page is pinned once ``limit`` pages are
        pinned in all (a hold that does not fit is cut short, never forced in). The count
        pinned: the first n of ``keys``."""
        with self._lock:
            return self.pins.pin_leading(keys, limit, lambda key: key in self.l1 or key in self.l2)

    def pinned(self, key: PageKey) -> bool:
        return key in self.pins

    def drop_l2(self) -> None:
        """Forget L2's copies, of pages and snapshots (calibration: the next restore reads
        L3); freed slots stay warm."""
        with self._lock:
            for tier in (self.l2, *(() if self.snapshots is None else (self.snapshots.l2,))):
                for key in list(tier):
                    tier.pop(key)

    def flush(self) -> None:
        """Write every page that lives only in L1 or L2 down to L3 and wait for it."""
        with self._lock:
            if self.snapshots is not None:
                self.snapshots.flush()
            self.placement.flush()
