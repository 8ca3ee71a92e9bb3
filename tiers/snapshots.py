"""Recurrent-state snapshots in every tier (DESIGN §3a).

A hybrid model's state layers (``PageGeometry.state_layers``) keep no KV per token:
their state right after a page is a snapshot of ``geometry.snapshot_nbytes`` bytes,
keyed by ``snapshot_key`` of that page's key. Snapshots live in tiers of their own (an
L1 of device arrays, an L2 arena of snapshot-sized slots, each with its own cap) and in
the store's L3 under a namespace digest of their own (``snapshot_key`` of the pages'),
as records of the one record format: checksummed, written once, evicted and counted
like pages, moved down by the pages' rules (``tiers.placement``).

Invariant: a snapshot leaves the store only inside a ``RestoredPrefix`` whose pages
end where it was taken (``attach``, called by ``TieredStore.finish`` on every
restore); pages restored without the state their model needs are cut back to the
last page that has one, or to nothing. So attention KV is never restored without its
state, and a state never without the KV before it.

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from .l3.base import L3Store
from .l3_reads import AheadRead
from .links import Link, LinkLedger
from .page import PageGeometry, PageKey, Source, snapshot_key
from .page_rows import rows as page_rows
from .placement import Pins, Placement
from .policy import L3Admission, make_policy
from .restore import PartialMatch, RestoredPrefix
from .stats import SnapshotStats
from .tier import DevicePage, DeviceTier, HostTier, TierView

_ORDER = {Source.L1: 0, Source.L2: 1, Source.L3: 2}


def slowest(a: Source, b: Source) -> Source:
    """The slower of two tiers a token's parts came from (its label, DESIGN §5)."""
    return a if _ORDER[a] >= _ORDER[b] else b


class Snapshots:
    """The snapshots of one namespace: their L1 and L2, and their records in L3."""

    def __init__(
        self,
        geometry: PageGeometry,
        ns_digest: bytes,
        l1_bytes: int,
        l2_bytes: int,
        disk: L3Store | None,
        admission: L3Admission,
        policy: str,
    ) -> None:
        self.geometry = geometry
        self.nbytes = geometry.snapshot_nbytes
        self.ns_digest = snapshot_key(ns_digest)  # L3 records of snapshots: a namespace of their own
        self.l1 = DeviceTier(l1_bytes, self.nbytes, make_policy(policy))
        self.l2 = HostTier(l2_bytes, self.nbytes, policy=make_policy(policy))
        self.disk = disk
        self.ledger = LinkLedger()  # bytes of snapshots per link, apart from the pages'
        self.placement = Placement(
            self.l1, self.l2, disk, self.ns_digest, geometry.page_size, admission, self.ledger, Pins()
        )  # a snapshot is copied out when found, so none stays pinned

    def publish(self, page: PageKey, tokens: Sequence[int], state: mx.array) -> bool:
        """Keep the state taken right after page ``page`` (flat uint8, ``nbytes`` long);
        False when a tier already has it (write-once)."""
        key = snapshot_key(page)
        if key in self.l1 or key in self.l2:
            return False
        entry = DevicePage(tuple(tokens), state)
        if self.placement.make_room(self.l1):
            self.l1.add(key, entry)
        else:
            self.placement.place_below_l1(key, entry.tokens, state, 1.0)
        self.placement.write_through(key)  # with write-through: a page's restore needs its snapshot
        return True

    def below(self, pages: Sequence[PageKey]) -> list[PageKey]:
        """The snapshot keys after ``pages`` that neither L1 nor L2 holds (only L3 may)."""
        wanted = [snapshot_key(page) for page in pages]
        return [k for k in wanted if k not in self.l1 and k not in self.l2]

    def points(self, keys: Sequence[PageKey], read: AheadRead | None = None) -> list[int]:
        """The page counts ``j`` (1..len(keys)) after which some tier holds a snapshot
        (unverified: ``attach`` checks it); with ``read`` (a read ahead, done), L3 is not
        asked: its snapshots are those the read found."""
        below = self.below(keys)
        in_l3: set[PageKey] = set()
        if read is not None:
            in_l3 = set(read.found_states.intersection(below))
        elif self.disk is not None and below:
            in_l3 = {k for k, n in zip(below, self.disk.present(below)) if n}
        wanted = [snapshot_key(page) for page in keys]
        return [j for j, key in enumerate(wanted, 1) if key in self.l1 or key in self.l2 or key in in_l3]

    def fetch(
        self, page: PageKey, tokens: Sequence[int], read: AheadRead | None = None
    ) -> tuple[mx.array, Source] | None:
        """The snapshot after page ``page`` (whose tokens are ``tokens``) and the tier it
        came from, kept in L1 when it came from below; None when no tier has a good one.
        With ``read``, L3's is the one the read found (L3 is asked nothing)."""
        key, own = snapshot_key(page), tuple(tokens)
        self.l1.counters = self.l1.counters.plus(lookups=1)
        resident = self.l1.get(key)
        if resident is not None and resident.tokens == own:
            self.l1.counters = self.l1.counters.plus(hit_pages=1)
            return resident.kv, Source.L1
        self.l2.counters = self.l2.counters.plus(lookups=1)
        host = self.l2.get(key)
        if host is not None and host.tokens == own:
            self.l2.counters = self.l2.counters.plus(hit_pages=1)
            t0 = time.perf_counter()
            state = mx.array(self.l2.read(key))
            self.ledger.record(Link.L2_L1, self.nbytes, time.perf_counter() - t0)
            return self._keep(key, own, state), Source.L2
        if self.disk is None or (read is not None and read.snapshot is None):
            return None
        t0 = time.perf_counter()
        snapshot = read.snapshot if read is not None else None
        found = self.disk.get(key, self.ns_digest, own, self.nbytes, snapshot=snapshot)  # checks its checksum
        if found is None:
            return None
        raw, stored = found
        state = mx.array(np.frombuffer(raw, np.uint8))
        self.ledger.record(Link.L3_L1, stored, time.perf_counter() - t0)
        return self._keep(key, own, state, in_l3=True), Source.L3

    def _keep(self, key: PageKey, tokens: tuple[int, ...], state: mx.array, in_l3: bool = False) -> mx.array:
        if key not in self.l1 and self.placement.make_room(self.l1):
            self.l1.add(key, DevicePage(tokens, state, in_l3=in_l3))
        return state

    def attach(
        self,
        restored: RestoredPrefix,
        tokens: Sequence[Sequence[int]],
        then: PartialMatch | None,
        after: bytes,
        read: AheadRead | None = None,
    ) -> tuple[RestoredPrefix, list]:
        """``restored`` with the state after it: the partial page ``then`` appended with
        its state when it follows the last restored page (its parent is ``after``, the
        key before the page after them); else cut back to its longest
        prefix after which a good snapshot is found, with that state; and the keys cut
        off (the caller unpins them). ``tokens``: each restored page's token ids;
        ``read``: the restore's read ahead, whose snapshots L3 holds (see ``points``). A
        window model's restore read only its last pages' window rows, so it is kept
        whole or not at all."""
        n = len(restored.keys)
        if then is not None and then.state is not None and then.parent == after:
            rows = page_rows(then.kv, self.geometry)
            layers = (
                [
                    (mx.concatenate([k, pk], axis=2), mx.concatenate([v, pv], axis=2))
                    for (k, v), (pk, pv) in zip(restored.layers, rows)
                ]
                if n
                else rows
            )
            return replace(restored, layers=layers, state=then.state, partial_tokens=then.num_tokens), []
        for j in reversed(self.points(restored.keys, read)):
            if j < n and self.geometry.window is not None:
                break
            found = self.fetch(restored.keys[j - 1], tokens[j - 1], read)
            if found is not None:
                state, source = found
                sources = [*restored.sources[: j - 1], slowest(restored.sources[j - 1], source)]
                size = j * self.geometry.page_size
                layers = restored.layers if j == n else [(k[:, :, :size], v[:, :, :size]) for k, v in restored.layers]
                return replace(restored, keys=restored.keys[:j], sources=sources, layers=layers, state=state), [
                    *restored.keys[j:]
                ]
        return RestoredPrefix([], [], []), list(restored.keys)

    def flush(self) -> None:
        self.placement.flush()

    def views(self) -> tuple[TierView, TierView]:
        return self.l1.view(), self.l2.view()

    def stats(self) -> SnapshotStats:
        """Counts and bytes of snapshots per tier (L1, L2) and per link."""
        return SnapshotStats({t.name: t.counters for t in (self.l1, self.l2)}, self.ledger.stats())
