"""Where pages go when they move down: making room in a tier, the spill cascade
L1 -> L2 -> L3, and the L3 writes of a flush.

Invariants (``tiers.hierarchy`` lists them all):
- a pinned page is never a victim (``Pins``); a tier that has only pinned pages
  refuses (``make_room`` is False), it never overflows its cap;
- a page leaving L1 is copied to L2 only if L2 lacks it, and goes straight to L3
  (``L1->L3``) when L2 has no room; a page leaving L2 is queued for L3 unless it is
  known to be there (``in_l3`` on its entry: restored from L3, or queued by this
  process) or queued already, and only if L3's admission lets it in, and the write budget
  (``tiers.write_budget``) when there is one; a page that finds no place is dropped and
  counted;
- nothing here asks L3 anything: queueing a page costs no round trip on the caller's
  thread. The writer finds out whether L3 holds it already (Redis: one pipelined
  ``EXISTS`` per batch, LMDB: in its write transaction) and sends only the pages it
  lacks. ``L1->L3`` and ``L2->L3`` count a page when it is handed to the writer (the
  copy the caller makes); one the writer then finds stored is not sent and not counted
  again, nor as an L3 insert;
- a partial page (fewer tokens than a page) lives in L1 only: evicted, it is dropped,
  and a flush never writes it;
- write-through (``through``, ``StoreConfig.l3_write_through``): a full page that
  publish keeps is queued for L3 at once (``write_through``), by ``write_l3`` as a spill
  is (admission, queue bound, link ledger; never with a write budget), and every copy in
  L1 and L2 is marked in L3, so its later spill or flush writes nothing; one refused (a
  full queue) stays unmarked and is written when it spills, as without write-through.

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import mlx.core as mx
import numpy as np

from .l3.base import L3Store
from .l3.record import Quantize
from .links import Link, LinkLedger
from .page import PageKey
from .policy import L3Admission
from .tier import DeviceTier, HostTier, Tier, kv_to_host
from .write_budget import WriteBudget


class Pins:
    """How many holders pin each page (a restore, a request using it)."""

    def __init__(self) -> None:
        self._count: Counter[PageKey] = Counter()

    def pin(self, key: PageKey) -> None:
        self._count[key] += 1

    def release(self, keys: Iterable[PageKey]) -> None:
        for key in keys:
            self._count[key] -= 1
            if self._count[key] <= 0:
                del self._count[key]

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def pin_leading(self, keys: Iterable[PageKey], limit: int, resident: Callable[[PageKey], bool]) -> int:
        """Pin the leading run of ``keys`` that are ``resident``; no new page is pinned once
        ``limit`` pages are pinned in all (a hold that does not fit is cut short, never
        forced in). The count pinned: the first n of ``keys``."""
        pinned, n = len(self._count), 0
        for key in keys:
            if not resident(key) or (key not in self._count and pinned >= limit):
                break
            pinned += key not in self._count
            self.pin(key)
            n += 1
        return n

    def held(self) -> Mapping[PageKey, int]:
        """A copy: pinned page -> pins held."""
        return dict(self._count)


class Placement:
    """Moves pages down the tiers to make room, and writes them to L3."""

    def __init__(
        self,
        l1: DeviceTier,
        l2: HostTier,
        disk: L3Store | None,
        ns_digest: bytes,
        page_size: int,
        admission: L3Admission,
        ledger: LinkLedger,
        pins: Pins,
        segments: tuple[int, ...] = (),
        quantize: Quantize | None = None,
    ) -> None:
        self.l1, self.l2, self.disk = l1, l2, disk
        self.segments = segments  # byte lengths of a page's separately checked segments (PageGeometry)
        self.quantize = quantize  # how a quantizing L3 codec encodes a page (tiers.quant); None: none can
        self.ns_digest = ns_digest
        self.page_size = page_size
        self.admission = admission
        self.ledger = ledger
        self.pins = pins
        self.budget: WriteBudget | None = None  # the store's L3 write budget (``StoreConfig.l3_write_budget``)
        self.depth: Callable[[PageKey], int] = lambda key: 0  # pages before a page (the store's ``lineage.depth``)
        self.parent: Callable[[PageKey], bytes | None] = lambda key: None  # the page before it (``lineage.parent``)
        self.through = False  # write-through: queue each published page for L3 at once (``write_through``)

    def make_room(self, tier: Tier) -> bool:
        """Evict the policy's unpinned victims from ``tier`` until one page fits."""
        while not tier.has_room():
            victim = tier.victim(self.pins.__contains__)
            if victim is None:
                return False
            tier.counters = tier.counters.plus(evictions=1)
            saving = tier.policy.saving(victim)
            if tier is self.l1:
                cost = self.l1.policy.cost_of(victim)
                page = self.l1.pop(victim)
                if len(page.tokens) >= self.page_size:  # a partial page is dropped
                    self.place_below_l1(victim, page.tokens, page.kv, cost, page.in_l3, saving)
            else:
                entry = self.l2.entries[victim]
                data = self.l2.read(victim)
                self.write_l3(victim, entry.tokens, data, Link.L2_L3, in_l3=entry.in_l3, saving=saving)
                self.l2.pop(victim)
        return True

    def place_below_l1(
        self,
        key: PageKey,
        page_tokens: tuple[int, ...],
        kv: mx.array,
        cost: float,
        in_l3: bool = False,
        saving: float | None = None,
    ) -> None:
        """Give a page leaving (or refused by) L1 a place in L2, else L3, else drop it
        (``in_l3``: L3 is known to hold it; ``saving``: what keeping it saves, for the
        write budget, by default its ``cost``: a page just computed)."""
        if key in self.l2:
            return
        t0 = time.perf_counter()
        data = kv_to_host(kv)
        if self.make_room(self.l2):
            self.l2.write(key, page_tokens, data, cost, in_l3)
            self.ledger.record(Link.L1_L2, len(data), time.perf_counter() - t0)
        elif not self.write_l3(key, page_tokens, data, Link.L1_L3, in_l3=in_l3, saving=saving or cost):
            self.l2.counters = self.l2.counters.plus(writes_dropped=1)

    def write_l3(
        self,
        key: PageKey,
        page_tokens: tuple[int, ...],
        data: np.ndarray,
        link: Link,
        wait: bool = False,
        in_l3: bool = False,
        saving: float | None = None,
    ) -> bool:
        """Queue a page for L3 unless it is known to be there (``in_l3``) or queued; True
        if L3 has or will have it (the writer skips a page it finds stored). Asks L3
        nothing (module docstring). A spilled page (``saving``: what keeping it saves)
        also needs the write budget's leave (``tiers.write_budget``), a flushed one not."""
        if self.disk is None:
            return False
        if in_l3 or self.disk.writer.queued(key):
            return True
        if saving is not None and self.budget is not None and self.admission.would_admit(key):
            if not self.budget.admits(self.budget.worth(self.depth(key), saving)):
                source = self.l2 if link is Link.L2_L3 else self.l1
                source.counters = source.counters.plus(writes_over_budget=1)
                return False
        if not self.admission.admits(key):
            return False
        t0 = time.perf_counter()
        queued = self.disk.put(
            key,
            self.ns_digest,
            page_tokens,
            data.data,  # the page's bytes, no copy
            wait=wait,
            segments=self.segments,
            quantize=self.quantize,
            parent=self.parent(key),  # L3 keeps the page before it while it stays (leaf-first)
        )
        if queued:
            self.ledger.record(link, len(data), time.perf_counter() - t0)
        return queued

    def write_through(self, key: PageKey) -> None:
        """With ``through``, queue a page publish just kept for L3 now: from L2's host
        bytes where L2 holds it (``L2->L3``), else from L1 (``L1->L3``: the device->host
        copy is made here, on the publisher's thread). Once queued, every in-process copy
        is marked in L3, so none of them is written again. Nothing when L3 is known to hold
        it, or when admission would refuse it now (a refusal is counted once, when the
        page spills). Not with a write budget, which ranks pages as they spill
        (``StoreConfig`` refuses the two together)."""
        if not self.through or self.disk is None or not self.admission.would_admit(key):
            return
        copies = [tier for tier in (self.l1, self.l2) if key in tier]
        known = any(tier.entries[key].in_l3 for tier in copies)
        if key in self.l2:
            tokens, data, link = self.l2.entries[key].tokens, self.l2.read(key), Link.L2_L3
        elif key in self.l1:
            page = self.l1.entries[key]
            tokens, data, link = page.tokens, kv_to_host(page.kv), Link.L1_L3
        else:
            return
        if self.write_l3(key, tokens, data, link, in_l3=known):
            for tier in copies:
                tier.mark_in_l3(key)

    def flush(self) -> None:
        """Write every full page that lives only in L1 or L2 down to L3 and wait for it."""
        if self.disk is None:
            return
        for key in self._flushed_from_l1():
            page = self.l1.entries[key]
            if self.write_l3(key, page.tokens, kv_to_host(page.kv), Link.L1_L3, wait=True, in_l3=page.in_l3):
                self.l1.mark_in_l3(key)
        for key in self.l2:
            entry = self.l2.entries[key]
            if self.write_l3(key, entry.tokens, self.l2.read(key), Link.L2_L3, wait=True, in_l3=entry.in_l3):
                self.l2.mark_in_l3(key)
        self.disk.flush()

    def unflushed(self) -> int:
        """The pages ``flush`` would hand to the writer now (neither known to be in L3
        nor queued; admitted)."""
        if self.disk is None:
            return 0
        disk, admits = self.disk, self.admission.would_admit
        l1 = [(k, self.l1.entries[k].in_l3) for k in self._flushed_from_l1()]
        l2 = [(k, self.l2.entries[k].in_l3) for k in self.l2]
        return sum(not in_l3 and not disk.writer.queued(k) and admits(k) for k, in_l3 in l1 + l2)

    def _flushed_from_l1(self) -> list[PageKey]:
        """L1's full pages that L2 lacks: the L1 pages a flush writes."""
        return [k for k in self.l1 if k not in self.l2 and len(self.l1.entries[k].tokens) >= self.page_size]
