"""What a store shows and keeps of itself, beside its pages (``TieredStore.accounts``):
its read-only view, the tiers that answer slowly, its counter checkpoints, what a flush
still owes L3, and the values L3 keeps beside the pages.

Invariants: the view and the counters are read under the store's lock; a checkpoint
writes to L3 outside it (a slow L3 never holds up the step loop), one at a time; the
checkpointing lock is taken before the store's lock, never after. Nothing here moves a
page.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import MappingProxyType

from .checkpoints import CounterCheckpoints, repeat
from .counters import add_into
from .l3.base import L3Store, ReadThrough
from .l3_reads import Readers, degraded
from .page import PageKey
from .placement import Pins, Placement
from .snapshots import Snapshots
from .stats import StoreStats
from .store_config import StoreView
from .tier import DeviceTier, HostTier


class StoreAccounts:
    """A store's views, checkpoints and side values. L3 is whatever the store has joined
    (``disk()``: None until it has; ``closed()`` once the store closed it; ``retrying()``
    while a late join is tried: L3 did not answer at open)."""

    def __init__(
        self,
        lock: threading.RLock,
        tiers: tuple[DeviceTier, HostTier],
        pins: Pins,
        placements: Sequence[Placement],
        snapshots: Snapshots | None,
        readers: Readers,
        stats: Callable[[], StoreStats],
        disk: Callable[[], L3Store | None],
        closed: Callable[[], bool],
        retrying: Callable[[], bool],
        closing: threading.Event,
    ) -> None:
        self._lock = lock
        self.l1, self.l2 = tiers
        self.pins = pins
        self.placements = list(placements)  # the pages', then a hybrid model's snapshots'
        self.snapshots = snapshots
        self.readers = readers
        self._stats, self._disk, self._closed, self._retrying = stats, disk, closed, retrying
        self._closing = closing  # set as the store starts closing: ends the checkpoints
        self._checkpoints: CounterCheckpoints | None = None  # once L3 is joined
        self._checkpointing = threading.Lock()  # taken before the store's lock, never after

    def attach(self, disk: L3Store) -> None:
        """Checkpoint into ``disk``'s tables from now on (the store joined it)."""
        self._checkpoints = CounterCheckpoints(disk.tables)

    def view(self) -> StoreView:
        with self._lock:
            return StoreView(
                self.l1.view(),
                self.l2.view(),
                MappingProxyType(self.pins.held()),
                self._disk() is not None and not self._closed(),
                self.snapshots.views() if self.snapshots is not None else None,
            )

    def degraded(self) -> list[str]:
        """The tiers that answer slowly or not at all now (``tiers.l3_reads.degraded``)."""
        return degraded(self.readers, self._disk(), self._retrying() and not self._closing.is_set())

    def checkpoint_counters(self, extra_counters: dict | None = None) -> None:
        """Add what this process counted since its last checkpoint (and ``extra_counters``,
        cumulative for the process, e.g. the engine's) to the store's counters. The
        counters are read under the store's lock, written to L3 outside it (a slow L3
        never holds up the step loop); one checkpoint at a time."""
        with self._checkpointing:
            with self._lock:
                if self._checkpoints is None or self._closed():
                    return
                now = self._stats().cumulative()
            add_into(now, extra_counters or {})
            self._checkpoints.write(now)

    def checkpoint_every(self, seconds: float, extra_counters: Callable[[], dict]) -> None:
        """``checkpoint_counters(extra_counters())`` every ``seconds`` until the store
        closes (``tiers.checkpoints``: a killed process loses at most that window)."""
        if self._checkpoints is not None:
            repeat(seconds, self._closing, lambda: self.checkpoint_counters(extra_counters()))

    def unflushed(self) -> Callable[[], int]:
        """From now on: how many pages a flush has yet to get into L3 (those it will hand
        to the writer, and those queued or being committed), read without the store's
        lock (a close that holds it may be stuck on a frozen L3: ``Engine.close``)."""
        with self._lock:
            disk = self._disk()
            if disk is None or self._closed():
                return lambda: 0
            owed = sum(placement.unflushed() for placement in self.placements)
            queued, _ = disk.writer.progress()
        return lambda: max(0, owed + queued - disk.writer.progress()[1])

    def get_meta(self, name: str) -> object | None:
        """A value the store keeps beside its pages (a cost profile, the last run); None
        without L3."""
        disk = self._disk()
        return disk.tables.get_meta(name) if disk is not None else None

    def put_meta(self, name: str, value: object) -> None:
        """Keep ``value`` in L3 under ``name``; nothing without L3 (no run outlives it)."""
        disk = self._disk()
        if disk is not None:
            disk.tables.put_meta(name, value)

    def read_through_l3(self, keys: Sequence[PageKey]) -> ReadThrough:
        """Read and hash L3's records of ``keys``, keeping nothing: the floor under a
        restore that benchmarks compare against (nothing read without L3)."""
        disk = self._disk()
        return disk.read_through(keys) if disk is not None else ReadThrough()
