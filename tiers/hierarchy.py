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
class StoreConfig:
    l1_bytes: int = 1 << 30
    l2_bytes: int = 4 << 30
    l3_bytes: int = 32 << 30
    store_dir: Path | None = None
    codec: str = "raw"
    # Tier ("L2" or "L3") -> bytes per second: reads from that tier take at least
    # bytes / rate (the rest is slept), and the link counters show it (tests, demos).
    throttle: dict[str, float] = field(default_factory=dict)
    throttle: dict[str, float] = field(default_factory=dict)  # tier -> max read bytes/s


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
        self._staging = np.empty(0, geometry.storage_dtype)

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
            restored = RestoredPrefix([], [], [])
            hosts = []
            for i, key in enumerate(keys):
                loaded = self._load(key, self._page_tokens(tokens, i))
                if loaded is None:
                    break
                restored.keys.append(key)
                restored.sources.append(loaded[0])
                hosts.append(loaded[1])
            if hosts:
                t0 = time.perf_counter()
                restored.layers = self._join(hosts)
                moved = sum(s is not Source.L1 for s in restored.sources)
                if moved:  # L1 pages cross no link; the rest came up from host memory
                    nbytes = moved * self.geometry.nbytes
                    share = self._throttled("L2", nbytes, (time.perf_counter() - t0) * moved / len(hosts))
                    self.links["L2->L1"].record(nbytes, share, moved)
            return restored

    def _load(self, key: PageKey, page_tokens: tuple[int, ...]) -> tuple[Source, np.ndarray] | None:
        """Pin one page and return a host view of its bytes (``geometry.shape``).

        Lookups and hits count here for L1 and L2; L3 counts its own in ``get``.
        """
        for tier in (self.l1, self.l2):
            tier.counters.lookups += 1
            entry = tier.get(key)
            if entry is not None and entry.tokens == page_tokens:
                self._pins[key] += 1
                tier.counters.hit_pages += 1
                tier.counters.hit_tokens += self.geometry.page_size
                data = kv_to_host(entry.kv) if tier is self.l1 else self.l2.read(key)
                return Source(tier.name), self._shaped(data)
        if self.disk is None:
            return None
        # Read straight into an L2 slot (an L3 hit is kept in L2): one copy, warm memory.
        slot = self.l2.take_slot() if self._make_room(self.l2) else None
        t0 = time.perf_counter()
        out = None if slot is None else self.l2.arena[slot]
        hit = self.disk.get(key, self.ns_digest, page_tokens, self.geometry.nbytes, out=out)
        if hit is None:
            if slot is not None:
                self.l2.give_back(slot)
            return None
        payload, stored_nbytes = hit
        self.links["L3->L2"].record(stored_nbytes, self._throttled("L3", stored_nbytes, time.perf_counter() - t0))
        if slot is not None:
            self.l2.fill(key, page_tokens, slot)
        self._pins[key] += 1
        return Source.L3, self._shaped(payload)

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

    def _join(self, hosts: list[np.ndarray]) -> list[tuple[mx.array, mx.array]]:
        """Per-layer K/V device arrays of consecutive pages.

        One pass gathers a layer's pages into a reused host staging buffer, one copy
        moves it to the device: no per-page device arrays, and the extra memory is one
        layer's K and V, not the whole prefix.
        """
        g = self.geometry
        shape = (2, g.num_kv_heads, g.page_size * len(hosts), g.head_dim)
        size = int(np.prod(shape))
        if self._staging.size < size:
            self._staging = np.empty(size, g.storage_dtype)
        stage = self._staging[:size].reshape(shape)
        layers = []
        for layer in range(g.num_layers):
            np.concatenate([h[layer] for h in hosts], axis=2, out=stage)
            kv = mx.array(stage)
            kv = kv.view(mx.bfloat16) if g.dtype == "bfloat16" else kv
            mx.eval(kv)
            layers.append((kv[0][None], kv[1][None]))
        return layers

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
