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

Placement is inclusive. Restoring from L2 promotes the page into L1; an L3 hit is
kept in L2 and L1 too. A page leaving L1 is copied to L2 only if L2 lacks it; a
page leaving L2 is queued for L3 only if L3 lacks it. When L2 has no room (every
page pinned) an L1 page goes straight to L3 (``L1->L3``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from .counters import LINKS, LinkCounters, add_into
from .disk import DiskTier, StoreError
from .page import Namespace, PageGeometry, PageKey, Source
from .tier import DevicePage, HostTier, Tier, kv_to_device, kv_to_host

log = logging.getLogger(__name__)


@dataclass
class RestoredPrefix:
    """Pages restored for one request, pinned until ``TieredStore.release``."""

    keys: list[PageKey]
    sources: list[Source]
    kv: mx.array | None  # (layers, 2, kv_heads, tokens, head_dim), None when empty

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass
class StoreConfig:
    l1_bytes: int = 1 << 30
    l2_bytes: int = 4 << 30
    l3_bytes: int = 32 << 30
    store_dir: Path | None = None
    codec: str = "raw"


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
        self.links = {name: LinkCounters() for name in (*LINKS, "L3->L1", "L1->L3")}
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

    def _page_tokens(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        size = self.geometry.page_size
        return tuple(tokens[index * size : (index + 1) * size])

    # -- restore -------------------------------------------------------------

    def restore(self, keys: Sequence[PageKey], tokens: Sequence[int]) -> RestoredPrefix:
        """Pin and load the longest loadable prefix of ``keys`` into one device array.

        A page that vanished or failed its check since ``locate`` ends the prefix;
        the caller recomputes from there.
        """
        with self._lock:
            restored = RestoredPrefix([], [], None)
            arrays = []
            for i, key in enumerate(keys):
                loaded = self._load(key, self._page_tokens(tokens, i))
                if loaded is None:
                    break
                source, kv = loaded
                restored.keys.append(key)
                restored.sources.append(source)
                arrays.append(kv)
            if arrays:
                restored.kv = mx.concatenate(arrays, axis=3) if len(arrays) > 1 else arrays[0]
                mx.eval(restored.kv)
            return restored

    def _load(self, key: PageKey, page_tokens: tuple[int, ...]) -> tuple[Source, mx.array] | None:
        """Pin one page and return it as a device array, promoting it into L1.

        Lookups and hits count here for L1 and L2; L3 counts its own in ``get``.
        """
        for tier in (self.l1, self.l2):
            tier.counters.lookups += 1
            entry = tier.get(key)
            if entry is not None and entry.tokens == page_tokens:
                self._pins[key] += 1
                tier.counters.hit_pages += 1
                tier.counters.hit_tokens += self.geometry.page_size
                if tier is self.l1:
                    return Source.L1, entry.kv
                return Source.L2, self._promote_from_l2(key, page_tokens)
        if self.disk is None:
            return None
        t0 = time.perf_counter()
        hit = self.disk.get(key, self.ns_digest, page_tokens, self.geometry.nbytes)
        if hit is None:
            return None
        payload, stored_nbytes = hit
        self._pins[key] += 1
        if self._make_room(self.l2):
            self.l2.write(key, page_tokens, payload)
            self.links["L3->L2"].record(stored_nbytes, time.perf_counter() - t0)
            return Source.L3, self._promote_from_l2(key, page_tokens)
        kv = kv_to_device(payload, self.geometry)
        mx.eval(kv)
        self.links["L3->L1"].record(stored_nbytes, time.perf_counter() - t0)
        self._add_l1(key, page_tokens, kv)
        return Source.L3, kv

    def _promote_from_l2(self, key: PageKey, page_tokens: tuple[int, ...]) -> mx.array:
        t0 = time.perf_counter()
        kv = kv_to_device(self.l2.read(key), self.geometry)
        mx.eval(kv)
        self.links["L2->L1"].record(self.geometry.nbytes, time.perf_counter() - t0)
        self._add_l1(key, page_tokens, kv)
        return kv

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

    def _write_l3(self, key: PageKey, page_tokens: tuple[int, ...], data: np.ndarray, link: str) -> bool:
        """Queue a page for L3 unless it is already there; True if L3 has or will have it."""
        if self.disk is None:
            return False
        if self.disk.contains(key):
            return True
        t0 = time.perf_counter()
        queued = self.disk.put(key, self.ns_digest, page_tokens, data)
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
                    self._write_l3(key, page.tokens, kv_to_host(page.kv), "L1->L3")
            for key in self.l2:
                self._write_l3(key, self.l2.entries[key].tokens, self.l2.read(key), "L2->L3")
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


def _open_disk(config: StoreConfig) -> DiskTier | None:
    """L3 if the store can be used; otherwise warn once and run without it."""
    if config.store_dir is None:
        return None
    try:
        return DiskTier(Path(config.store_dir), config.l3_bytes, codec=config.codec)
    except StoreError as err:
        log.warning("running without L3: %s", err)
        return None
