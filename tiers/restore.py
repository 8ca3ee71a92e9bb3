"""A restore run: find the longest stored run of pages, pin it, bring its bytes to the
host (decode compressed L3 pages into L2 slots, hash raw ones), join every page in one
pass into the request's KV, cut at the first page that fails its check, and keep the
pages that came from below L1 in L1 (``tiers.hierarchy``: placement).

Invariants:
- every page of a run is pinned before any L2 slot is reserved, so making room never
  evicts a page of this run; on any error nothing stays pinned;
- a raw L3 page is served only once the xxh3 of the bytes it was joined from (hashed
  ahead, or as they were copied) matches its record; the first that does not ends the
  run and is rejected, and the pages after it are unpinned;
- ``begin`` touches no mlx array (an L1 page is read by ``finish``): it may run on
  another thread while the model runs.

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from xxhash import xxh3_64_intdigest

from .join import Joined, JoinLimits, in_parallel, join_pages, shares
from .l3.base import L3Store, Snapshot
from .l3.record import CorruptRecord, StoredRecord
from .l3_reads import AheadRead
from .links import LinkLedger, Throttle
from .page import PageGeometry, PageKey, Source, page_tokens
from .placement import Pins, Placement
from .policy import L3Admission, PageCost
from .tier import DevicePage, DeviceTier, HostTier, kv_to_host


@dataclass
class RestoredPrefix:
    """Pages restored for one request, pinned until ``TieredStore.release``."""

    keys: list[PageKey]
    sources: list[Source]
    layers: list[tuple[mx.array, mx.array]]  # per layer K, V: (1, kv_heads, tokens, head_dim)
    state: mx.array | None = None  # a hybrid model's state after the last page (``tiers.snapshots``)
    partial_tokens: int = 0  # a hybrid model's: tokens of an L1 partial page after the pages, in ``layers``

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class PartialMatch:
    """The start of an L1 page that a prompt shares (``TieredStore.partials``)."""

    key: PageKey
    kv: mx.array  # the shared tokens only, in a page's layout (``tiers.page_rows``)
    num_tokens: int
    parent: bytes | None = None  # the key of the page before it
    state: mx.array | None = None  # a hybrid model's state after them (the whole page is shared)


@dataclass
class _Page:
    """One page of a restore being planned: where it is and a host view of its bytes."""

    key: PageKey
    tokens: tuple[int, ...]
    source: Source
    data: np.ndarray | None = None  # geometry.shape; None until an L3 page is verified (an L1 page: joined)
    kv: mx.array | None = None  # an L1 page's device array: read on the joining thread
    record: StoredRecord | None = None  # an L3 page's record, in the restore's snapshot
    slot: int | None = None  # the L2 slot a compressed L3 page is decoded into
    parent: bytes | None = None  # the key of the page before it
    index: int = 0  # its place in its prompt (0: the first page): its recompute cost's depth

    @property
    def host(self) -> np.ndarray:
        """Its bytes on the host, which every page of a run has by its join."""
        assert self.data is not None, "a page read before its bytes were on the host"
        return self.data

    @property
    def compressed(self) -> bool:
        return self.record is not None and self.record.compressed

    @property
    def raw_l3(self) -> bool:
        """Joined from the record as stored (LMDB's map, or the bytes Redis sent): its
        checksum is taken from those bytes as they are copied."""
        return self.record is not None and not self.record.compressed

    @property
    def stored(self) -> int:
        return self.record.stored if self.record is not None else 0

    def stored_in(self, codec: str) -> memoryview | None:
        """Its L3 payload when that is the page in ``codec``, in the clear (an L2 of that
        codec keeps it as it is); else None."""
        record = self.record
        if record is None or record.header.codec != codec or record.header.nonce:
            return None
        return record.payload

    @property
    def codec(self) -> str:
        """How the page is stored where it was found (``tiers.links.links_crossed``): an
        encrypted raw page is decoded (decrypted) into L2 like a compressed one."""
        if self.record is None:
            return "raw"
        return (
            "encrypted" if self.record.header.nonce and self.record.header.codec == "raw" else self.record.header.codec
        )


@dataclass
class PendingRestore:
    """A restore between its host work (``TieredStore.begin``) and its join (``finish``)."""

    pages: list[_Page]  # pinned
    digests: list[int | None]  # xxh3 of raw L3 pages checked ahead, else None
    find_s: float  # finding and pinning the pages
    host_s: float  # decoding and checking L3 pages, waiting out an L3 throttle
    snapshot: ExitStack  # holds the L3 snapshot open until finish
    parents: list[bytes]  # the key before each page of the run, and after its last
    l3: Snapshot | None = None  # that snapshot, when the run asked L3


class Restorer:
    """Runs restores against one store's tiers (``begin``, then ``finish``)."""

    def __init__(
        self,
        geometry: PageGeometry,
        ns_digest: bytes,
        l1: DeviceTier,
        l2: HostTier,
        disk: L3Store | None,
        placement: Placement,
        pins: Pins,
        admission: L3Admission,
        ledger: LinkLedger,
        throttle: Throttle,
        limits: JoinLimits,
    ) -> None:
        self.geometry = geometry
        self.limits = limits  # how its copies are cut up
        self.ns_digest = ns_digest
        self.l1, self.l2, self.disk = l1, l2, disk
        self.placement = placement
        self.pins = pins
        self.admission = admission
        self.ledger = ledger
        self.throttle = throttle
        self.page_cost = PageCost()  # the store's (``TieredStore.page_cost``): an L3 page's cost

    def begin(
        self,
        keys: Sequence[PageKey],
        tokens: Sequence[int],
        first: int = 0,
        ahead: bool = False,
        parents: Sequence[bytes] | None = None,
        read: AheadRead | None = None,
    ) -> PendingRestore:
        """The host side of a restore: find and pin the pages (L3 records in a snapshot
        held until ``finish``, opened at the first page that L1 and L2 lack: a restore
        they serve alone opens none), decode compressed L3 pages, wait out an L3 throttle.
        With ``ahead`` the raw L3 pages are also checked now, so ``finish`` only
        copies; without, the join hashes them as it copies them. Touches no mlx
        array (an L1 page is read by ``finish``): safe on another thread while the
        model runs. On an error nothing stays pinned. ``parents``: the key before each
        page and after the last (``KeyChain.parents``; None: the namespace's plain chain).
        With ``read`` (done), its snapshot is used (and left open: the read's owner ends
        it) and L3 is asked nothing."""
        parents = list(parents) if parents is not None else [self.ns_digest, *keys]
        with ExitStack() as stack:
            t0 = time.perf_counter()
            opened: list[Snapshot | None] = [read.snapshot] if read is not None else []

            def snapshot() -> Snapshot | None:
                if not opened:
                    opened.append(stack.enter_context(self._snapshot()))
                return opened[0]

            pages = self._plan(keys, tokens, snapshot, parents, first)
            snap = opened[0] if opened else None
            try:
                if snap is not None and self.geometry.window is not None:  # their window rows are joined
                    snap.complete([pages[i].key for i in self.geometry.window_pages(len(pages)) if pages[i].raw_l3])
                t1 = time.perf_counter()
                read_s = snap.read_s if snap is not None else 0.0  # a remote L3's round trips, inside _plan
                pages = self.decode_compressed(pages)
                digests: list[int | None] = self._hash_raw_l3(pages) if ahead else [None] * len(pages)
                l3_bytes = sum(p.stored for p in pages)
                before = read_s + (snap.ahead_s if snap is not None else 0.0)  # a read ahead waited its throttle
                host_s = self.throttle.wait("L3", l3_bytes, before + time.perf_counter() - t1) if l3_bytes else 0.0
            except BaseException:
                self.pins.release([p.key for p in pages])
                raise
            return PendingRestore(pages, digests, t1 - t0 - read_s, host_s, stack.pop_all(), parents[first:], snap)

    def finish(self, pending: PendingRestore) -> RestoredPrefix:
        """Join a begun restore's pages into per-layer device arrays and end its snapshot;
        if the join fails its pages are unpinned."""
        with pending.snapshot:
            pages = pending.pages
            if not pages:
                return RestoredPrefix([], [], [])
            t0 = time.perf_counter()
            try:
                joined = self.join(pending)
            except BaseException:
                self.pins.release([p.key for p in pages])
                raise
            digests = [a if a is not None else b for a, b in zip(pending.digests, joined.digests)]
            bad = self._first_bad(pages, digests)
            if bad < len(pages) and self.geometry.window is not None:
                good, layers = self._window_prefix(pages, joined.layers, bad, pending.l3)
            else:
                good = self._cut(pages, bad)
                kept = len(good) * self.geometry.page_size
                layers = (
                    joined.layers
                    if len(good) == len(pages)
                    else [(k[:, :, :kept], v[:, :, :kept]) for k, v in joined.layers]
                )
            window = set(self.geometry.window_pages(len(good)))
            self.ledger.record_restore(
                [(p.source, p.codec, *self._read(p, i in window)) for i, p in enumerate(good)],
                pending.host_s,
                pending.find_s + time.perf_counter() - t0,
                self.throttle,
            )
            self._keep_in_l1([p for i, p in enumerate(good) if i in window or not p.raw_l3])
            return RestoredPrefix([p.key for p in good], [p.source for p in good], layers)

    def _window_prefix(
        self, pages: list[_Page], layers: list, bad: int, l3: Snapshot | None
    ) -> tuple[list[_Page], list]:
        """A window model's restore cut short at page ``bad``: the pages before it, with
        the window rows that shorter prefix's window sees, joined now (the restore
        joined the last pages' only; ``l3`` reads those a read ahead left out) and
        checked where a raw L3 page's were not read; one failing its check cuts the
        prefix again, before it."""
        g, split = self.geometry, self.geometry.global_rows
        read = set(g.window_pages(len(pages)))  # window rows joined, and checked, already
        window_blocks = g.segment_blocks(1)
        n = bad
        while n:
            seen = g.window_pages(n)
            if l3 is not None:
                l3.complete([pages[i].key for i in seen if pages[i].raw_l3])
            hash_now = [pages[i].raw_l3 and i not in read for i in seen]
            window = join_pages([pages[i].host for i in seen], g, hash_now, self.limits, window_blocks)
            failed = [i for i, d in zip(seen, window.digests) if d is not None and not self._window_ok(pages[i], d)]
            if not failed:
                kept = n * g.page_size
                return self._cut(pages, n), [
                    (k[:, :, :kept], v[:, :, :kept]) for k, v in layers[:split]
                ] + window.layers
            n = failed[0]
        return self._cut(pages, 0), []

    def _window_ok(self, page: _Page, digest: int | tuple[int | None, ...]) -> bool:
        """Whether a raw L3 page's window rows, hashed as they were joined, match their
        checksum; a mismatch rejects the record (its global rows were counted a hit)."""
        assert isinstance(digest, int), "window rows alone are joined as one segment"
        disk, record = self._l3(page)
        try:
            ok = digest == record.segment_checksum(1)
        except CorruptRecord:
            ok = False
        if not ok:
            disk.check.reject(record.key, record.value, "window rows: checksum mismatch")
        return ok

    def _read(self, page: _Page, whole: bool) -> tuple[int, int]:
        """(bytes read where the page was found, raw bytes joined) of a restored page:
        without its window rows (``whole`` False) a raw L3 record is read in part, and
        only its global rows are joined."""
        if whole or self.geometry.window is None:
            return page.stored, self.geometry.nbytes
        unread = self.geometry.segments[1]
        return (page.stored - unread if page.raw_l3 else page.stored), self.geometry.nbytes - unread

    def _keep_in_l1(self, pages: list[_Page]) -> None:
        """Copy the restored pages that came from below L1 into L1 (module docstring:
        placement), while they are pinned and an L3 page's map view is valid."""
        for page in pages:
            if page.source is Source.L1 or page.key in self.l1 or not self.placement.make_room(self.l1):
                continue  # no room when every L1 page is pinned: the page stays where it was
            kv = mx.array(page.host)
            kv = kv.view(mx.bfloat16) if self.geometry.dtype == "bfloat16" else kv
            below = self.l2.entries.get(page.key)
            cost = self.l2.policy.cost_of(page.key) if below is not None else self.page_cost(page.index)
            in_l3 = page.source is Source.L3 or (below is not None and below.in_l3)  # evicted again: not rewritten
            self.l1.add(page.key, DevicePage(page.tokens, kv, page.parent, in_l3=in_l3), cost)

    def join(self, pending: PendingRestore) -> Joined:
        """The pages joined (L1 pages read from the device here), raw L3 pages not
        checked ahead hashed on the way."""
        for page in pending.pages:
            if page.kv is not None:
                page.data = self._shaped(kv_to_host(page.kv))
        hash_now = [p.raw_l3 and d is None for p, d in zip(pending.pages, pending.digests)]
        if self.geometry.window is None:
            return join_pages([p.host for p in pending.pages], self.geometry, hash_now, self.limits)
        return self._join_segments([p.host for p in pending.pages], hash_now)

    def _join_segments(self, hosts: list[np.ndarray], hash_now: list[bool]) -> Joined:
        """A window model's join: the global rows of every page, the window rows of the
        pages its window sees (``PageGeometry.window_pages``), each segment hashed apart;
        a page's digest is then a pair (global, window or None when not read)."""
        g = self.geometry
        seen = g.window_pages(len(hosts))
        parts = [
            join_pages([hosts[i] for i in which], g, [hash_now[i] for i in which], self.limits, g.segment_blocks(s))
            for s, which in enumerate((range(len(hosts)), seen))
        ]
        window_digest = dict(zip(seen, parts[1].digests))
        digests: list[int | tuple[int | None, int | None] | None] = [
            None if not hash_now[i] else (_whole(parts[0].digests[i]), _whole(window_digest.get(i)))
            for i in range(len(hosts))
        ]
        return Joined(parts[0].layers + parts[1].layers, digests)

    def _snapshot(self) -> AbstractContextManager[Snapshot | None]:
        return self.disk.snapshot() if self.disk is not None else nullcontext()

    def _plan(
        self,
        keys: Sequence[PageKey],
        tokens: Sequence[int],
        snapshot: Callable[[], Snapshot | None],
        parents: Sequence[bytes],
        first: int = 0,
    ) -> list[_Page]:
        """The longest stored run from page ``first``, every page pinned: L1 pages with
        their device array (not read here), L2 pages with host views of their bytes,
        L3 pages with their record (header checked) and a view of the map (raw) or an
        L2 slot reserved to decode into (compressed; None when L2 has no room).
        ``snapshot()`` (L3's; None without one) is taken at the first page that
        neither L1 nor L2 holds, and told the keys it will be asked for from there.

        Pages are pinned before any slot is reserved, so making room in L2 never
        evicts a page of this run. Lookups and hits count here for L1 and L2 (added
        once a restore), in the snapshot for L3.
        """
        pages: list[_Page] = []
        snap: Snapshot | None = None
        asked = False
        size, nbytes = self.geometry.page_size, self.geometry.nbytes
        for i in range(first, len(keys)):
            key = keys[i]
            own = page_tokens(tokens, i, size)
            page = self._pin_resident(key, own)
            if page is None and not asked:
                asked, snap = True, snapshot()
                if snap is not None:
                    snap.expect([k for k in keys[i:] if k not in self.l1 and k not in self.l2], nbytes)
            if page is None and snap is not None:
                record = snap.find(key, self.ns_digest, own, nbytes)
                if record is not None:
                    data = None if record.compressed else self._shaped(record.payload)
                    page = _Page(key, own, Source.L3, record=record, data=data)
                    self.pins.pin(key)
            if page is None:
                break
            self.admission.seen(key)
            page.parent, page.index = parents[i], i
            pages.append(page)
        self._count_lookups(pages, tried=min(len(pages) + 1, max(0, len(keys) - first)))
        for page in pages:
            if page.compressed and self.placement.make_room(self.l2):
                page.slot = self.l2.take_slot()
        return pages

    def _count_lookups(self, pages: list[_Page], tried: int) -> None:
        """Count a plan's lookups and hits in L1 and L2: each of the ``tried`` pages was
        looked up in L1, and in L2 unless L1 had it."""
        in_l1 = sum(p.source is Source.L1 for p in pages)
        in_l2 = sum(p.source is Source.L2 for p in pages)
        size = self.geometry.page_size
        for tier, lookups, hits in ((self.l1, tried, in_l1), (self.l2, tried - in_l1, in_l2)):
            if lookups:
                tier.counters = tier.counters.plus(lookups=lookups, hit_pages=hits, hit_tokens=hits * size)

    def _pin_resident(self, key: PageKey, own: tuple[int, ...]) -> _Page | None:
        """The page pinned where L1 or L2 holds it (its tokens checked), else None."""
        for tier in (self.l1, self.l2):
            entry = tier.get(key)
            if entry is None or entry.tokens != own:
                continue
            self.pins.pin(key)
            if isinstance(entry, DevicePage):  # L1: its bytes are read at the join, on the joining thread
                return _Page(key, own, Source.L1, kv=entry.kv)
            return _Page(key, own, Source.L2, self._shaped(self.l2.read(key)))
        return None

    def decode_compressed(self, pages: list[_Page]) -> list[_Page]:
        """Decode the compressed L3 pages into their L2 slots (on a few threads), checking
        their checksums; they stay in L2. Returns the prefix up to the first failure."""
        reads = [p for p in pages if p.compressed]
        if not reads:
            return pages
        in_parallel(self._decode_pages, shares(reads, len(reads) * self.geometry.nbytes, self.limits))
        for page in reads:  # a page decoded whole is kept in L2, even past the cut
            if page.slot is not None:
                if page.data is not None:
                    stored = page.stored_in(self.l2.codec.name) if self.l2.codec is not None else None
                    quantized = page.data if self.l2.codec is not None and stored is None else None  # else in place
                    cost = self.page_cost(page.index)
                    self.l2.fill(page.key, page.tokens, page.slot, cost, in_l3=True, raw=quantized, stored=stored)
                else:
                    self.l2.give_back(page.slot)
        return self._cut(pages, next((i for i, p in enumerate(pages) if p.compressed and p.data is None), len(pages)))

    def _decode_pages(self, pages: Sequence[_Page]) -> None:
        """One thread's share of the decodes, in order; stops at its first failure."""
        for page in pages:
            out = None if page.slot is None else self.l2.raw_slot(page.slot)
            disk, record = self._l3(page)
            raw = disk.check.verified(record, out)
            if raw is None:
                return
            page.data = self._shaped(raw)

    def _hash_raw_l3(self, pages: list[_Page]) -> list[int | None]:
        """xxh3 of each raw L3 page's bytes in the map (on a few threads), else None."""
        digests: list[int | None] = [None] * len(pages)
        raw = [i for i, p in enumerate(pages) if p.raw_l3]

        def hash_share(share: Sequence[int]) -> None:
            for i in share:
                digests[i] = xxh3_64_intdigest(pages[i].host.data)  # .data: tiers.join says why

        in_parallel(hash_share, shares(raw, len(raw) * self.geometry.nbytes, self.limits))
        return digests

    def _first_bad(self, pages: list[_Page], digests: list) -> int:
        """Index of the first raw L3 page whose bytes (hashed ahead, or as they were
        joined) fail its checksum (that record is rejected), else len(pages)."""
        for i, (page, digest) in enumerate(zip(pages, digests)):
            if digest is None:
                continue
            disk, record = self._l3(page)
            if not disk.check.accept(record, digest):
                return i
        return len(pages)

    def _l3(self, page: _Page) -> tuple[L3Store, StoredRecord]:
        """The store an L3 page came from, and its record (a run holds L3 pages only with an L3)."""
        assert self.disk is not None and page.record is not None, "an L3 page without an L3 or a record"
        return self.disk, page.record

    def _cut(self, pages: list[_Page], n: int) -> list[_Page]:
        """``pages[:n]``; the pages after it are unpinned."""
        self.pins.release([p.key for p in pages[n:]])
        return pages[:n]

    def _shaped(self, data: np.ndarray | bytes | memoryview) -> np.ndarray:
        return np.frombuffer(data, self.geometry.storage_dtype).reshape(self.geometry.shape)


def _whole(digest: int | tuple[int | None, int | None] | None) -> int | None:
    """A digest of one segment's join (hashed whole: an int, or None when not hashed)."""
    return digest if isinstance(digest, int) else None
