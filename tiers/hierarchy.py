"""The tier hierarchy: where each page lives and how it moves between tiers.

Invariants (DESIGN §4), each tested in ``tests/tiers/test_hierarchy.py``:

1. A published page is immutable: a key names one page's bytes and every tier holds
   exactly the bytes that were computed (raw copies; L3 checks a checksum). A page
   computed again over a copy below L1 adds only an L1 copy (``publish``).
2. A pinned page (being restored, or in use by a request) is never evicted from
   L1 or L2. An L3 restore reads inside one L3 snapshot (an LMDB read transaction
   no writer changes; for Redis, the values it read), which keeps its bytes; L3
   pages are pinned too, only so that every restored key is released alike (and a
   decoded one stays in L2 meanwhile).
3. Capacities are hard caps (see ``tiers.tier``); a page that finds no room in
   any tier is dropped and counted, never forced in.
4. A page is written to L3 at most once: a page known to be there (``in_l3``:
   restored from L3, or written by this process) or queued is never handed to the
   writer again, so such a spill adds 0 bytes to ``L2->L3``; one L3 holds unknown to
   this process is handed over (and counted on its link) but not sent: the writer
   asks first, off the caller's thread (``tiers.placement``).

Placement is inclusive, and a page is kept where the next request will find it
fastest. L1 holds pages computed on this device (a page computed over a copy in L2 or L3
too) and pages restored from below it:
a page restored from L2 or L3 into a request is also kept in L1 (``tiers.restore``),
subject to L1's cap and eviction policy like a published page (L1 makes room by
moving its victims down, never evicting a pinned page), so a process reads a hot
prefix from below L1 at most once. The join writes the request's KV along tokens,
not in a page's layout, so the L1 copy is one device copy of the page's bytes made
while they are still pinned (a page already in L1 is not copied again). A raw L3
page is read straight from LMDB's map into the request's KV (``L3->L1``) and not
kept in L2: the OS page cache already holds it, and a copy into L2 would double the
restore's work (a read ahead off the step loop, ``tiers.l3_reads``, copies it out of
the map on its reader thread, so that the loop never faults on the disk). A raw Redis
page takes the same path from the bytes its snapshot read (in a few batched round
trips, counted in ``L3->L1``'s seconds). A compressed
L3 page is decoded into an L2 slot and kept there (``L3->L2``, then ``L2->L1``):
decoding costs more than a copy. How pages move down: ``tiers.placement``.

A restore plans the longest stored prefix (pins its pages, finds its L3 records in
one snapshot, reserves L2 slots for compressed ones and decodes them), then joins all
pages in one pass straight into the mlx arrays that become the request's KV
(``tiers.join``), hashing raw L3 pages as it copies them: no staging copy, nothing
allocated beyond the request's own KV (and 4 KiB an array, to align it with L2's slots).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx

from .accounts import StoreAccounts
from .join import keep_buffers_for_restores
from .keeping import Keeping
from .l3.base import L3Store
from .l3_join import describe, join_later, open_disk
from .l3_reads import AheadRead, Readers
from .lineage import leaf_first
from .links import LinkLedger, Throttle
from .page import Namespace, PageGeometry, PageKey, Source, page_tokens
from .partials import PartialPages
from .placement import Pins, Placement
from .policy import L3Admission, PageCost, make_policy
from .quant import PageCodec, namespace_codecs, page_quantizer
from .residency import Residency
from .restore import PartialMatch, PendingRestore, RestoredPrefix, Restorer
from .snapshots import Snapshots
from .stats import L3Place, StoreStats
from .store_config import StoreConfig, StoreView, open_l3_of
from .tier import DevicePage, DeviceTier, HostTier
from .write_budget import WriteBudget

__all__ = ["PartialMatch", "PendingRestore", "RestoredPrefix", "StoreConfig", "StoreView", "TieredStore"]

log = logging.getLogger(__name__)


class TieredStore:
    """L1 (device), L2 (host arena) and L3 (LMDB or Redis) behind one lookup, restore and
    publish API: the request path, and the store's lifecycle (open, late L3 join, close).
    Its other jobs are parts of their own, sharing its lock: ``keeping``
    (``tiers.keeping``: holds, recency, flush, dropping L2) and ``accounts``
    (``tiers.accounts``: its view, checkpoints, what a flush still owes, side values)."""

    def __init__(
        self,
        geometry: PageGeometry,
        namespace: Namespace,
        config: StoreConfig,
    ) -> None:
        if namespace.encryption != (config.cipher.name if config.cipher is not None else ""):
            raise ValueError("a store with an L3 cipher needs a namespace that names it, and only then")
        if namespace.codecs != namespace_codecs(config.codec, config.l2_codec):
            raise ValueError("a store with a quantizing codec needs a namespace that names it, and only then")
        self.geometry = geometry
        self.namespace = namespace
        keep_buffers_for_restores()
        self.ns_digest = namespace.digest()
        page_bytes = config.page_bytes or geometry.nbytes
        self.l1 = DeviceTier(config.l1_bytes, page_bytes, make_policy(config.policy))
        l2_codec = PageCodec.of(geometry, config.l2_codec)
        self.l2 = HostTier(config.l2_bytes, geometry.nbytes, config.page_bytes, make_policy(config.policy), l2_codec)
        self.admission = L3Admission(config.l3_admit)
        self.disk: L3Store | None = None  # set by _join: now, or once an unreachable server answers
        self.config = config
        self.throttle = Throttle(config.throttle)
        self.ledger = LinkLedger()
        self.links = self.ledger.links  # link name -> LinkStats of this process
        self.pins = Pins()
        self.budget = (  # L3 writes under a byte rate (tiers.write_budget); None: unbudgeted
            WriteBudget(config.l3_write_budget, page_bytes, config.clock) if config.l3_write_budget else None
        )
        self.placement = Placement(
            self.l1,
            self.l2,
            None,
            self.ns_digest,
            geometry.page_size,
            self.admission,
            self.ledger,
            self.pins,
            geometry.segments,
            page_quantizer(geometry, config.codec),
        )
        self.placement.budget = self.budget
        self.placement.through = config.l3_write_through
        self.snapshots = (
            Snapshots(
                geometry,
                self.ns_digest,
                config.snapshot_l1_bytes,
                config.snapshot_l2_bytes,
                None,
                self.admission,
                config.policy,
            )
            if geometry.snapshot_nbytes
            else None
        )
        if self.snapshots is not None:  # a snapshot is written through as its pages are
            self.snapshots.placement.through = config.l3_write_through
        self.restorer = Restorer(
            geometry,
            self.ns_digest,
            self.l1,
            self.l2,
            None,
            self.placement,
            self.pins,
            self.admission,
            self.ledger,
            self.throttle,
            config.join_limits,
        )
        self._lock = threading.RLock()
        hybrid = self.snapshots is not None
        self.partials = PartialPages(self.l1, self.placement, geometry, hybrid, self._lock)
        self.residency = Residency(self._lock, self.l1, self.l2, geometry.page_size)  # who holds which page, as changes
        self.lineage = leaf_first(self.residency, self.l1, self.l2)  # which page follows which: evict leaves first
        self.placement.depth = self.lineage.depth  # the write budget ranks a shallower page first
        self.placement.parent = self.lineage.parent.get  # L3 keeps a page's parent while it stays
        # What recomputing page i of a prompt costs: set by the engine and the replay from their
        # prefill model; publishers pass it, and a page restored from L3 is given it
        self.page_cost = self.restorer.page_cost = self.partials.page_cost = PageCost()
        self._closed = False
        self._closing = threading.Event()  # ends the counter checkpoints and a late join
        self.readers = Readers(self.throttle)
        self._retrying = False  # L3 did not answer at open: a late join is being tried
        self.keeping = Keeping(self._lock, (self.l1, self.l2), self.pins, self.placement, self.snapshots)
        placements = [self.placement, *([self.snapshots.placement] if self.snapshots is not None else [])]
        self.accounts = StoreAccounts(
            self._lock,
            (self.l1, self.l2),
            self.pins,
            placements,
            self.snapshots,
            self.readers,
            self.stats,
            lambda: self.disk,
            lambda: self._closed,
            lambda: self._retrying,
            self._closing,
        )
        if config.shared_l3 is not None:  # one open L3 shared by stores of this process
            self._join(config.shared_l3)
        if config.store_dir is None or config.shared_l3 is not None:
            return
        opener = partial(open_l3_of, config)
        disk, retry = open_disk(opener)
        if disk is not None:
            self._join(disk)
        elif retry:
            self._retrying = True
            join_later(opener, self._closing, self._join)

    def _join(self, disk: L3Store) -> bool:
        """Start using ``disk`` as L3 (at open, or late: ``tiers.l3_join``); False once closing."""
        with self._lock:
            if self._closing.is_set():
                return False
            snapshots = self.snapshots.ns_digest if self.snapshots is not None else None
            describe(disk, self.namespace, self.geometry, self.config.label, snapshots)
            if self.snapshots is not None:
                self.snapshots.disk = self.snapshots.placement.disk = disk
            self.placement.disk = self.restorer.disk = disk
            self.accounts.attach(disk)
            self.disk = disk
            return True

    # -- queries -------------------------------------------------------------

    def locate(self, keys: Sequence[PageKey], tokens: Sequence[int], read: AheadRead | None = None) -> list[Source]:
        """Tier of each page of the longest prefix of ``keys`` that is stored (L3 is asked
        once, for the pages L1 and L2 lack; with ``read``, L3 is not asked: its pages are
        those the read found)."""
        with self._lock:
            absent = [key for key in keys if key not in self.l1 and key not in self.l2]
            if read is not None:
                in_l3 = set(read.found)
            else:
                in_l3 = set(absent[: self.disk.stored_prefix(absent)]) if self.disk is not None else set()
            found = []
            for i, key in enumerate(keys):
                source = self._where(key, page_tokens(tokens, i, self.geometry.page_size), in_l3)
                if source is None:
                    break
                found.append(source)
            return found

    def _where(self, key: PageKey, own: tuple[int, ...], in_l3: set[PageKey]) -> Source | None:
        for tier, source in ((self.l1, Source.L1), (self.l2, Source.L2)):
            entry = tier.entries.get(key)
            if entry is not None:
                return source if entry.tokens == own else None
        return Source.L3 if key in in_l3 else None

    # -- restore -------------------------------------------------------------

    def restore(
        self,
        keys: Sequence[PageKey],
        tokens: Sequence[int],
        first: int = 0,
        then: PartialMatch | None = None,
        parents: Sequence[bytes] | None = None,
        read: AheadRead | None = None,
    ) -> RestoredPrefix:
        """Pin and load the longest loadable run of pages ``first..`` of ``keys`` as
        per-layer device arrays (``begin`` then ``finish``; ``then``: see ``finish``;
        ``parents``: the chain's, ``KeyChain.parents``, None for the namespace's plain chain;
        ``read``: see ``begin``).

        A page that vanished or failed its check since ``locate`` ends the run; the
        caller recomputes from there.
        """
        return self.finish(self.begin(keys, tokens, first, parents=parents, read=read), then, read)

    def begin(
        self,
        keys: Sequence[PageKey],
        tokens: Sequence[int],
        first: int = 0,
        ahead: bool = False,
        parents: Sequence[bytes] | None = None,
        read: AheadRead | None = None,
    ) -> PendingRestore:
        """:meth:`Restorer.begin` under the store's lock: safe on another thread while
        the model runs. With ``read`` (``read_ahead``, done), L3 pages come from what it
        read, and L3 is asked nothing (its snapshot ends with ``readers.end``)."""
        with self._lock:
            self.lineage.learn(keys)
            return self.restorer.begin(keys, tokens, first, ahead, parents, read)

    # -- reads ahead (off the step loop: tiers.l3_reads) -----------------------------

    def read_ahead(
        self,
        keys: Sequence[PageKey],
        deadline: float,
        done: Callable[[], None] = lambda: None,
        states: Sequence[PageKey] = (),
        first: int = 0,
    ) -> AheadRead | None:
        """Start reading the L3 records of ``keys`` on a reader thread (``done()`` once it
        completes), and of a hybrid model's snapshots after the pages ``states`` that L1
        and L2 lack; None without L3, or with nothing to read. A restore given the read
        once it is done asks L3 nothing (``restore_points`` and ``finish`` neither);
        ``deadline`` (perf_counter): when its caller stops waiting (``readers.abandon``,
        counted in ``reads_abandoned``; else ``readers.end``). ``first``: the index of
        ``keys[0]`` in its prompt's pages: of a sliding-window model's records, only those
        the restore of the run found reads whole (``PageGeometry.window_pages``) are read
        whole, the others' global rows alone."""
        disk = self.disk
        with self._lock:
            below = self.snapshots.below(states) if self.snapshots is not None else []
        if disk is None or self._closing.is_set() or not (keys or below):
            return None
        nbytes, window_pages = self.geometry.snapshot_nbytes, self.geometry.window_pages

        def whole(found: int) -> list[int]:
            return [i - first for i in window_pages(first + found) if i >= first]

        window = whole if self.geometry.window is not None else None
        return self.readers.start(disk, keys, self.geometry.nbytes, deadline, done, below, nbytes, window)

    def finish(
        self, pending: PendingRestore, then: PartialMatch | None = None, read: AheadRead | None = None
    ) -> RestoredPrefix:
        """Join a begun restore's pages into per-layer device arrays and end its snapshot;
        if the join fails its pages are unpinned. A hybrid model's restore ends after
        its last page with a snapshot and holds that state, or, when the partial page
        ``then`` (with its state) follows all of its pages, ends after that page's
        tokens with its state (``Snapshots.attach``; with ``read``, L3's snapshots are
        those it read)."""
        with self._lock:
            restored = self.restorer.finish(pending)
            if self.snapshots is None or not (restored.keys or then):
                return restored
            after = pending.parents[len(restored.keys)]  # the key before the partial page ``then`` must be
            restored, cut = self.snapshots.attach(restored, [p.tokens for p in pending.pages], then, after, read)
            self.pins.release(cut)
            return restored

    def restore_points(
        self,
        keys: Sequence[PageKey],
        after: Sequence[int] = (),
        parent: bytes | None = None,
        read: AheadRead | None = None,
    ) -> list[int] | None:
        """The prefix lengths in pages (0..len(keys)) a hybrid model can restore: those
        followed by a snapshot, and ``len(keys)`` when a partial page with its state,
        all of whose tokens ``after`` (the prompt's tokens after those pages, its last
        excluded) starts with, follows them (unverified); None when every length can be.
        ``parent``: the key before that partial page (None: the plain chain's); with
        ``read``, L3 is not asked: its snapshots are those the read found."""
        with self._lock:
            if self.snapshots is None:
                return None
            points = self.snapshots.points(keys, read)
            if parent is None:
                parent = keys[-1] if keys else self.ns_digest
            if self.partials.resumes(parent, after):
                points.append(len(keys))
            return points

    def publish_snapshot(self, page: PageKey, tokens: Sequence[int], state: mx.array) -> bool:
        """Keep a hybrid model's state right after page ``page`` (``Snapshots.publish``)."""
        with self._lock:
            assert self.snapshots is not None, "a snapshot of a model without state layers"
            return self.snapshots.publish(page, tokens, state)

    def release(self, keys: Sequence[PageKey]) -> None:
        """Unpin pages taken by ``restore`` (or ``keeping.pin``)."""
        with self._lock:
            self.pins.release(keys)

    def has(self, key: PageKey) -> bool:
        """Whether some tier holds ``key`` (unverified; asks L3: for replays and tools, never
        on a request's path)."""
        with self._lock:
            return key in self.l1 or key in self.l2 or (self.disk is not None and self.disk.contains(key))

    # -- publish -------------------------------------------------------------

    def publish(
        self,
        key: PageKey,
        tokens: Sequence[int],
        kv: mx.array,
        cost: float = 1.0,
        parent: bytes | None = None,
        through: bool = True,
    ) -> bool:
        """Add a computed full page to L1; False if L1 has it, or if L1 has no room and L2
        has it (L3 is not asked: a page it holds is skipped by its writer). A page
        computed over a copy in L2 or L3 (a plan that loads only some pages, or computes
        the first ones while later ones load) is kept in L1 like a restored page: the
        next request reads it from L1, not from below again.
        ``cost``: the seconds its recompute takes, for the ``cost`` eviction policy
        (``page_cost`` of its place in its prompt);
        ``parent``: the key of the page before it (``partials.match`` finds it by that;
        leaf-first eviction keeps a page while one after it stays: ``tiers.lineage``).
        With ``StoreConfig.l3_write_through`` the page kept is also queued for L3 now
        (``Placement.write_through``), for the other engines sharing that L3, unless
        ``through`` is False: a page computed over a copy a restore found below (before the
        request's first token; that copy is written back as without write-through)."""
        with self._lock:
            self.admission.seen(key)
            self.lineage.arrives(key, parent)
            if not self.wants(key):
                return False
            page = DevicePage(tuple(tokens), kv, parent)
            if self.placement.make_room(self.l1):
                self.l1.add(key, page, cost)
            elif key in self.l2:
                return False
            else:
                self.placement.place_below_l1(key, page.tokens, kv, cost)
            if through:
                self.placement.write_through(key)  # with l3_write_through only
            return True

    def wants(self, key: PageKey) -> bool:
        """Whether ``publish`` would keep a computed page of ``key``: L1 lacks it."""
        with self._lock:
            return key not in self.l1

    # -- lifecycle and numbers -------------------------------------------------

    def settle(self) -> None:
        """Wait until L3 has committed every queued write and use (its evictions
        included): what a replay or a test reads next is then deterministic."""
        if self.disk is not None:
            self.disk.flush()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, extra_counters: dict | None = None) -> None:
        """Flush to L3, add this process's counters to the store's, close L3 (once)."""
        self._closing.set()
        self.readers.close()
        with self._lock:
            if self.disk is None or self._closed:
                return
            self.keeping.flush()
        self.accounts.checkpoint_counters(extra_counters)  # takes the lock itself (see there)
        with self._lock:
            if not self._closed:
                if self.config.shared_l3 is None:  # a shared L3: its opener closes it
                    self.disk.close()
                self._closed = True

    def stats(self) -> StoreStats:
        """Counters of this process: per tier (gauges included) and per link."""
        with self._lock:
            tiers = {t.name: t.counters for t in (self.l1, self.l2)}
            place = None
            if self.disk is not None:
                tiers["L3"] = self.disk.counters
                place = L3Place(self.disk.backend, self.disk.location)
            snapshots = self.snapshots.stats() if self.snapshots is not None else None
            return StoreStats(tiers, self.ledger.stats(), place, snapshots, reads_abandoned=self.readers.abandoned)
