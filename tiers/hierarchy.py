"""The tier hierarchy: where each page lives and how it moves between tiers.

Invariants (DESIGN §4), each tested in ``tests/tiers/test_hierarchy.py``:

1. A published page is immutable: a key is published once and every tier holds
   exactly the bytes that were computed (raw copies; L3 checks a checksum).
2. A pinned page (being restored, or in use by a request) is never evicted from
   L1 or L2. L3 reads are single LMDB read transactions, so they need no pin.
3. Capacities are hard caps (see ``tiers.tier``); a page that finds no room in
   any tier is dropped and counted, never forced in.
4. A page is written to L3 at most once: a page already there (or already
   queued) is never sent again, so such a spill adds 0 bytes to ``L2->L3``.

Placement is inclusive. L1 holds pages computed on this device. A restore copies
pages into the request's own KV, so a page restored from L2 is not copied into L1
as well (that would double device memory); an L3 hit is kept in L2. A page leaving
L1 is copied to L2 only if L2 lacks it; a page leaving L2 is queued for L3 only if
L3 lacks it. When L2 has no room (every page pinned) an L1 page goes straight to L3
(``L1->L3``).

A restore plans the longest stored prefix (pins its L1/L2 pages, reserves an L2 slot
for each L3 page), reads the L3 pages into their slots on a few threads, then joins
all pages in one pass straight into the mlx array that becomes the request's KV
(``tiers.join``): no staging copy, nothing allocated beyond the request's own KV.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from .counters import LINKS, LinkCounters, add_into
from .disk import DiskTier, StoreError
from .page import Namespace, PageGeometry, PageKey, Source
from .join import in_parallel, join_pages, shares
from .tier import DevicePage, HostTier, Tier, kv_to_host

log = logging.getLogger(__name__)

@dataclass
class RestoredPrefix:
    """Pages restored for one request, pinned until ``TieredStore.release``."""

    keys: list[PageKey]
    sources: list[Source]
    layers: list[tuple[mx.array, mx.array]]  # per layer K, V: (1, kv_heads, tokens, head_dim)

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass
class _Page:
    """One page of a restore being planned: where it is and a host view of its bytes."""

    key: PageKey
    tokens: tuple[int, ...]
    source: Source
    data: np.ndarray | None = None  # geometry.shape; None until an L3 page is read
    slot: int | None = None  # the L2 slot an L3 page is read into
    stored_nbytes: int = 0  # record bytes read from L3


@dataclass
class StoreConfig:
    l1_bytes: int = 1 << 30
    l2_bytes: int = 4 << 30
    l3_bytes: int = 32 << 30
    store_dir: Path | None = None
    codec: str = "raw"
    # Tier ("L2" or "L3") -> bytes per second: reads from that tier take at least
    # bytes / rate (the rest is slept), and the link counters show it (tests, demos).
    # "L3" slows the L3->L2 reads; "L2" slows the L2->L1 join of every page that
    # crosses it (so also of pages that came up from L3 in the same restore).
    throttle: dict[str, float] = field(default_factory=dict)


class TieredStore:
    """L1 (device), L2 (host arena) and L3 (LMDB) behind one lookup/restore/publish API."""

    def __init__(
        self,
        geometry: PageGeometry,
        namespace: Namespace,
        config: StoreConfig,
    ) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.ns_digest = namespace.digest()
        self.l1: Tier[DevicePage] = Tier("L1", config.l1_bytes, geometry.nbytes)
        self.l2 = HostTier(config.l2_bytes, geometry)
        self.disk = _open_disk(config)
        self.throttle = _checked_throttle(config.throttle)
        self.links = {name: LinkCounters() for name in LINKS}
        self._pins: Counter[PageKey] = Counter()
        self._lock = threading.RLock()
        self._closed = False

    # -- queries -------------------------------------------------------------

    def locate(self, keys: Sequence[PageKey], tokens: Sequence[int]) -> list[Source]:
        """Tier of each page of the longest prefix of ``keys`` that is stored."""
        with self._lock:
            found = []
            for i, key in enumerate(keys):
                source = self._where(key, self._page_tokens(tokens, i))
                if source is None:
                    break
                found.append(source)
            return found

    def _where(self, key: PageKey, page_tokens: tuple[int, ...]) -> Source | None:
        for tier, source in ((self.l1, Source.L1), (self.l2, Source.L2)):
            entry = tier.entries.get(key)
            if entry is not None:
                return source if entry.tokens == page_tokens else None
        if self.disk is not None and self.disk.contains(key):
            return Source.L3
        return None

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark ``keys``' L1 pages recently used (a waiting request will want them);
        pins nothing and loads nothing."""
        with self._lock:
            for key in keys:
                if key in self.l1:
                    self.l1.get(key)

    def _page_tokens(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        size = self.geometry.page_size
        return tuple(tokens[index * size : (index + 1) * size])

    # -- restore -------------------------------------------------------------

    def restore(self, keys: Sequence[PageKey], tokens: Sequence[int]) -> RestoredPrefix:
        """Pin and load the longest loadable prefix of ``keys`` as per-layer device arrays.

        A page that vanished or failed its check since ``locate`` ends the prefix;
        the caller recomputes from there.
        """
        with self._lock:
            pages = self._read_l3(self._plan(keys, tokens))
            restored = RestoredPrefix([p.key for p in pages], [p.source for p in pages], [])
            if pages:
                t0 = time.perf_counter()
                restored.layers = join_pages([p.data for p in pages], self.geometry)
                moved = sum(p.source is not Source.L1 for p in pages)
                if moved:  # L1 pages cross no link; the rest came up from host memory
                    nbytes = moved * self.geometry.nbytes
                    share = self._throttled("L2", nbytes, (time.perf_counter() - t0) * moved / len(pages))
                    self.links["L2->L1"].record(nbytes, share, moved)
            return restored

    def _plan(self, keys: Sequence[PageKey], tokens: Sequence[int]) -> list[_Page]:
        """The longest stored prefix: L1/L2 pages pinned with host views of their bytes,
        L3 pages with an L2 slot reserved to read into (None when L2 has no room).

        Resident pages are pinned before any slot is reserved, so making room in L2
        never evicts a page of this prefix. Lookups and hits count here for L1 and L2;
        L3 counts its own in ``get``.
        """
        pages = []
        for i, key in enumerate(keys):
            page_tokens = self._page_tokens(tokens, i)
            page = self._pin_resident(key, page_tokens)
            if page is None and self.disk is not None:
                if self.disk.contains(key):
                    page = _Page(key, page_tokens, Source.L3)
                else:  # the miss that ends the prefix is an L3 lookup too
                    self.disk.get(key, self.ns_digest, page_tokens, self.geometry.nbytes)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if page.source is Source.L3 and self._make_room(self.l2):
                page.slot = self.l2.take_slot()
        return pages

    def _pin_resident(self, key: PageKey, page_tokens: tuple[int, ...]) -> _Page | None:
        for tier in (self.l1, self.l2):
            tier.counters.lookups += 1
            entry = tier.get(key)
            if entry is not None and entry.tokens == page_tokens:
                self._pins[key] += 1
                tier.counters.hit_pages += 1
                tier.counters.hit_tokens += self.geometry.page_size
                data = kv_to_host(entry.kv) if tier is self.l1 else self.l2.read(key)
                return _Page(key, page_tokens, Source(tier.name), self._shaped(data))
        return None

    def _read_l3(self, pages: list[_Page]) -> list[_Page]:
        """Read the planned L3 pages (on a few threads) into their L2 slots, keep them in
        L2, and cut the prefix at the first page that failed; returns the pinned prefix."""
        reads = [p for p in pages if p.source is Source.L3]
        if not reads:
            return pages
        t0 = time.perf_counter()
        in_parallel(self._read_pages, shares(reads, len(reads) * self.geometry.nbytes))
        done = [p for p in reads if p.data is not None]
        if done:
            nbytes = sum(p.stored_nbytes for p in done)
            self.links["L3->L2"].record(nbytes, self._throttled("L3", nbytes, time.perf_counter() - t0), len(done))
        for page in reads:  # a page read whole is kept in L2, even past the cut
            if page.slot is not None:
                if page.data is not None:
                    self.l2.fill(page.key, page.tokens, page.slot)
                else:
                    self.l2.give_back(page.slot)
        cut = next((i for i, p in enumerate(pages) if p.data is None), len(pages))
        for page in pages[:cut]:
            if page.source is Source.L3:
                self._pins[page.key] += 1
        self.release([p.key for p in pages[cut:] if p.source is not Source.L3])
        return pages[:cut]

    def _read_pages(self, pages: list[_Page]) -> None:
        """One thread's share of the L3 reads, in order; stops at its first miss."""
        for page in pages:
            out = None if page.slot is None else self.l2.arena[page.slot]
            hit = self.disk.get(page.key, self.ns_digest, page.tokens, self.geometry.nbytes, out=out)
            if hit is None:
                return
            page.data, page.stored_nbytes = self._shaped(hit[0]), hit[1]

    def _throttled(self, tier: str, nbytes: int, seconds: float) -> float:
        """Seconds a read of ``nbytes`` from ``tier`` took, after sleeping up to its throttle."""
        rate = self.throttle.get(tier)
        if rate is None or seconds >= nbytes / rate:
            return seconds
        t0 = time.perf_counter()
        time.sleep(nbytes / rate - seconds)
        return seconds + time.perf_counter() - t0

    def _shaped(self, data: np.ndarray | bytes) -> np.ndarray:
        return np.frombuffer(data, self.geometry.storage_dtype).reshape(self.geometry.shape)

    def release(self, keys: Sequence[PageKey]) -> None:
        """Unpin pages taken by ``restore`` (or ``pin``)."""
        with self._lock:
            for key in keys:
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    def pinned(self, key: PageKey) -> bool:
        return key in self._pins

    # -- publish and spill ---------------------------------------------------

    def publish(self, key: PageKey, tokens: Sequence[int], kv: mx.array) -> bool:
        """Add a newly computed full page to L1; False if it was already stored."""
        with self._lock:
            if key in self.l1 or key in self.l2 or (self.disk and self.disk.contains(key)):
                return False
            self._add_l1(key, tuple(tokens), kv)
            return True

    def _add_l1(self, key: PageKey, page_tokens: tuple[int, ...], kv: mx.array) -> None:
        if key in self.l1:
            return
        if self._make_room(self.l1):
            self.l1.add(key, DevicePage(page_tokens, kv))
        else:
            self._place_below_l1(key, page_tokens, kv)

    def _make_room(self, tier: Tier) -> bool:
        """Evict unpinned LRU pages of ``tier`` until one page fits."""
        while not tier.has_room():
            victim = tier.victim(self.pinned)
            if victim is None:
                return False
            tier.counters.evictions += 1
            if tier is self.l1:
                page = self.l1.pop(victim)
                self._place_below_l1(victim, page.tokens, page.kv)
            else:
                self._write_l3(victim, self.l2.entries[victim].tokens, self.l2.read(victim), "L2->L3")
                self.l2.pop(victim)
        return True

    def _place_below_l1(self, key: PageKey, page_tokens: tuple[int, ...], kv: mx.array) -> None:
        """Give a page leaving (or refused by) L1 a place in L2, else L3, else drop it."""
        if key in self.l2:
            return
        t0 = time.perf_counter()
        data = kv_to_host(kv)
        if self._make_room(self.l2):
            self.l2.write(key, page_tokens, data)
            self.links["L1->L2"].record(len(data), time.perf_counter() - t0)
        elif not self._write_l3(key, page_tokens, data, "L1->L3"):
            self.l2.counters.writes_dropped += 1

    def _write_l3(self, key: PageKey, page_tokens: tuple[int, ...], data: np.ndarray, link: str,
                  wait: bool = False) -> bool:
        """Queue a page for L3 unless it is already there; True if L3 has or will have it."""
        if self.disk is None:
            return False
        if self.disk.contains(key):
            return True
        t0 = time.perf_counter()
        queued = self.disk.put(key, self.ns_digest, page_tokens, data, wait=wait)
        if queued:
            self.links[link].record(len(data), time.perf_counter() - t0)
        return queued

    # -- lifecycle and numbers -------------------------------------------------

    def flush(self) -> None:
        """Write every page that lives only in L1 or L2 down to L3 and wait for it."""
        with self._lock:
            if self.disk is None:
                return
            for key in self.l1:
                if key not in self.l2:
                    page = self.l1.entries[key]
                    self._write_l3(key, page.tokens, kv_to_host(page.kv), "L1->L3", wait=True)
            for key in self.l2:
                self._write_l3(key, self.l2.entries[key].tokens, self.l2.read(key), "L2->L3", wait=True)
            self.disk.flush()

    def close(self, extra_counters: dict | None = None) -> None:
        """Flush to L3, add this process's counters to the store's, close L3 (once)."""
        with self._lock:
            if self.disk is None or self._closed:
                return
            self.flush()
            delta = self._cumulative()
            add_into(delta, extra_counters or {})
            self.disk.add_persistent_counters(delta)
            self.disk.close()
            self._closed = True

    def _cumulative(self) -> dict:
        tiers = {t.name: t.counters.cumulative() for t in (self.l1, self.l2)}
        if self.disk is not None:
            tiers["L3"] = self.disk.counters.cumulative()
        links = {name: link.cumulative() for name, link in self.links.items()}
        return {"tiers": tiers, "links": links}

    def stats(self) -> dict:
        """Counters of this process: per tier (gauges included) and per link."""
        with self._lock:
            tiers = {t.name: asdict(t.counters) for t in (self.l1, self.l2)}
            if self.disk is not None:
                tiers["L3"] = asdict(self.disk.counters)
            links = {name: asdict(link) for name, link in self.links.items()}
            return {"tiers": tiers, "links": links}


def _checked_throttle(throttle: dict[str, float]) -> dict[str, float]:
    for tier, rate in throttle.items():
        if tier not in ("L2", "L3") or not rate > 0:
            raise ValueError(f"bad throttle {tier}={rate!r}: tier L2 or L3, rate > 0 bytes/s")
    return dict(throttle)


def _open_disk(config: StoreConfig) -> DiskTier | None:
    """L3 if the store can be used; otherwise warn once and run without it."""
    if config.store_dir is None:
        return None
    try:
        return DiskTier(Path(config.store_dir), config.l3_bytes, codec=config.codec)
    except StoreError as err:
        log.warning("running without L3: %s", err)
        return None
