"""Which pages L1 and L2 hold, as a stream of changes (DESIGN §11): what a fleet router
indexes to send a request where its pages are.

A tier reports each page it indexes and each it drops (``Tier.add`` and ``Tier.pop``:
the only places a page enters or leaves L1 or L2, so a page moving L1 -> L2 is a drop
from L1 and an add to L2). ``Residency`` passes them to its watchers. Only whole pages
are reported (a request's last, partial page in L1 has a key no other prompt's chain
holds); a hybrid model's state snapshots live in tiers of their own and are not.

Invariant: a watcher registered by ``watch`` sees every change after the snapshot it
was given and none before, because both happen under the store's lock, the lock every
tier change is made under. Watchers are called under that lock, on whatever thread
changed the tier (the engine's step loop, a restore, a spill): one must only note the
change (never block, never call into the store).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .page import PageKey
from .tier import Tier


@dataclass(frozen=True)
class Change:
    """A page entered (``stored``) or left tier ``tier`` ("L1" or "L2")."""

    tier: str
    key: PageKey
    stored: bool


Watcher = Callable[[Change], None]


@dataclass(frozen=True)
class Holdings:
    """The whole pages L1 and L2 held at one moment, in each tier's order."""

    l1: tuple[PageKey, ...]
    l2: tuple[PageKey, ...]


class Residency:
    """The residency changes of a store's L1 and L2, fanned out to watchers."""

    def __init__(self, lock: threading.RLock, l1: Tier[Any], l2: Tier[Any], page_size: int) -> None:
        self._lock, self._tiers, self._page_size = lock, (l1, l2), page_size
        self._watchers: list[Watcher] = []
        for tier in self._tiers:
            tier.on_change = self._changed

    def watch(self, watcher: Watcher) -> Holdings:
        """Register ``watcher`` and return what L1 and L2 hold now: the snapshot its
        changes start from."""
        with self._lock:
            self._watchers.append(watcher)
            return Holdings(*(self._whole(tier) for tier in self._tiers))

    def unwatch(self, watcher: Watcher) -> None:
        """Stop calling ``watcher`` (nothing if it was not watching)."""
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _whole(self, tier: Tier[Any]) -> tuple[PageKey, ...]:
        return tuple(key for key, entry in tier.entries.items() if len(entry.tokens) == self._page_size)

    def _changed(self, tier: str, key: PageKey, tokens: int, stored: bool) -> None:
        if tokens != self._page_size:
            return
        change = Change(tier, key, stored)
        for watcher in list(self._watchers):
            watcher(change)
