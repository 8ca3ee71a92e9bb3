"""Restore bandwidth per link, beside memcpy of the same bytes in the same run.

    python bench/restore_bandwidth.py [--pages 1 16 256] [--rounds 5] [--json]

For each prefix length it publishes pages of the default model's KV geometry
(24 layers, 2 KV heads, head_dim 64, 128-token pages, float32: 3 MiB a page),
places them in one tier and times ``TieredStore.restore`` (the engine's path: page
lookups and pins, L3 reads into L2 slots, the join into per-layer device arrays,
evaluated). Each round times, back to back on the same bytes: numpy memcpy (one
thread, warm source and destination), memcpy split over two threads, the restore
from L2, the restore from L3 (OS page cache warm, raw codec) and mlx_lm's
``load_prompt_cache`` of the same KV (safetensors, page cache warm). The best of the
rounds (16/n times as many for n < 16 pages) is reported for each, so the ratios compare times from one stretch of the run
(this VM's bandwidth drifts by 1.5x from minute to minute).

Reported per row:
- GiB/s of the whole restore, and its ratio to one-thread memcpy of the same bytes;
- each link's share (the link counters' bytes / seconds for that restore);
- peak extra memory beyond the request's own KV, in pages: the growth of the
  process's peak RSS during the restore (host staging, any fresh buffer) plus mlx's
  peak beyond the KV, on the first restore of a fresh store (see
  ``Restorer.extra_pages``). Not tracemalloc: with mlx's file-object loads it hits
  CPython 3.11's tracemalloc races with threads made outside Python (segfaults);
- for load_prompt_cache: its time over ours from L3 (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from kvtier.engine.blas import blas_in_use
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, Source, page_keys

GEOMETRY = PageGeometry(24, 2, 64, 128, "float32")
NS = Namespace("bench", "float32", 128)
GIB = 1 << 30


def make_pages(n: int) -> tuple[list[int], list, list[mx.array]]:
    tokens = list(np.random.default_rng(0).integers(0, 250, n * 128 + 1))
    keys = page_keys(NS, tokens)[:n]
    pages = [mx.random.normal(GEOMETRY.shape, key=mx.random.key(i)) for i in range(n)]
    mx.eval(pages)
    return tokens, keys, pages


class Memcpy:
    """numpy copies of ``nbytes`` between warm buffers, on one thread or split over two."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the destination in: we time the copy, not the kernel
        half = nbytes // 2
        self.halves = [slice(0, half), slice(half, nbytes)]
        self.pool = ThreadPoolExecutor(2)

    def one_thread(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0

    def two_threads(self) -> float:
        t0 = time.perf_counter()
        list(self.pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), self.halves))
        return time.perf_counter() - t0


def store_with(tier: str, n: int, directory: Path | None) -> TieredStore:
    big = (n + 1) * GEOMETRY.nbytes
    sizes = {"L1": (big, 0), "L2": (0, big)}[tier]
    return TieredStore(GEOMETRY, NS, StoreConfig(*sizes, l3_bytes=4 * big, store_dir=directory))


def pin_malloc_mmap_threshold() -> bool:
    """Make glibc serve every allocation of 128 KiB or more with fresh pages (mmap), as it
    does until its dynamic threshold has grown: a new host buffer then shows in RSS
    instead of hiding in reused heap memory. Timed paths allocate no such buffers per
    restore (mlx keeps its own buffers in its cache), so timings are unaffected."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD
    except OSError:
        return False


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (kB there)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class Restorer:
    """A store holding n pages in ``tier``; ``run`` restores them once (for L3: from L3)."""

    def __init__(self, tier: str, directory: Path, tokens, keys, pages) -> None:
        self.tier, self.directory, self.tokens, self.keys, self.pages = tier, directory, tokens, keys, pages
        self.n = len(keys)
        if tier == "L3":  # written by close()
            self._published(store_with("L1", self.n, directory)).close()
        self.store = self._fresh_store()
        self.links: dict = {}
        self.best = float("inf")
        self._release(self.store.restore(keys, tokens))  # warm up (for L3: the OS page cache too)

    def _published(self, store: TieredStore) -> TieredStore:
        for i, key in enumerate(self.keys):
            store.publish(key, self.tokens[i * 128 : (i + 1) * 128], self.pages[i])
        return store

    def _fresh_store(self) -> TieredStore:
        if self.tier == "L2":
            return self._published(store_with("L2", self.n, None))
        return store_with("L2", self.n, self.directory)

    def _release(self, restored, store: TieredStore | None = None) -> None:
        store = store or self.store
        assert restored.num_pages == self.n and set(restored.sources) == {Source(self.tier)}, restored.sources
        store.release(restored.keys)
        if self.tier == "L3":  # forget any L2 copies (compressed pages); their slots stay warm
            for key in self.keys:
                if key in store.l2:
                    store.l2.pop(key)

    def run(self) -> float:
        before = {k: dict(v) for k, v in self.store.stats()["links"].items()}
        t0 = time.perf_counter()
        restored = self.store.restore(self.keys, self.tokens)
        seconds = time.perf_counter() - t0
        links = {}
        for name, after in self.store.stats()["links"].items():
            if after["pages"] > before[name]["pages"]:
                links[name] = {k: after[k] - before[name][k] for k in ("bytes", "pages", "seconds")}
        del restored.layers
        self._release(restored)
        if seconds < self.best:
            self.best, self.links = seconds, links
        return seconds

    def extra_pages(self) -> float:
        """Peak memory of a restore beyond the request's own KV, in pages (closes the store).

        Measured on the first restore of a fresh store, so buffers a store allocates once
        and keeps (a staging buffer) count. Host side: the growth of this process's peak
        RSS during the restore (its L2 arena is touched and, for L3, the pages read
        once before, so neither the arena nor the file's page cache counts); the
        request's KV comes from mlx's buffer cache, warm from the timed rounds. Device
        side: mlx's peak beyond its active memory before the restore, minus the KV.
        """
        self.store.close()
        self.store = store = self._fresh_store()
        if self.tier == "L3":  # touch the arena; map the records into this store's view of the file
            store.l2.arena.fill(0)
            scratch = np.zeros(GEOMETRY.nbytes, np.uint8)
            for i, key in enumerate(self.keys):
                store.disk.get(key, store.ns_digest, self.tokens[i * 128 : (i + 1) * 128], GEOMETRY.nbytes, out=scratch)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        rss = _status_bytes("VmRSS")
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        restored = store.restore(self.keys, self.tokens)
        host = _status_bytes("VmHWM") - rss
        device = mx.get_peak_memory() - base - self.n * GEOMETRY.nbytes
        self._release(restored)
        store.close()
        return (max(host, 0) + max(device, 0)) / GEOMETRY.nbytes


class PromptCachePeer:
    """mlx_lm's save_prompt_cache / load_prompt_cache of the same KV."""

    def __init__(self, pages: list[mx.array], directory: Path) -> None:
        kv = mx.concatenate(pages, axis=3)
        cache = []
        for layer in range(GEOMETRY.num_layers):
            c = KVCache()
            c.state = (kv[layer, 0][None], kv[layer, 1][None], kv.shape[3])
            cache.append(c)
        self.path = str(directory / "prompt.safetensors")
        save_prompt_cache(self.path, cache)
        self.run()  # page cache warm

    def run(self) -> float:
        t0 = time.perf_counter()
        loaded = load_prompt_cache(self.path)
        mx.eval([c.state[:2] for c in loaded])
        return time.perf_counter() - t0


def measure(n: int, rounds: int) -> list[dict]:
    tokens, keys, pages = make_pages(n)
    nbytes = n * GEOMETRY.nbytes
    with tempfile.TemporaryDirectory() as l2_dir, tempfile.TemporaryDirectory() as l3_dir, \
            tempfile.TemporaryDirectory() as peer_dir:
        memcpy = Memcpy(nbytes)
        restorers = {tier: Restorer(tier, Path(d), tokens, keys, pages) for tier, d in (("L2", l2_dir), ("L3", l3_dir))}
        peer = PromptCachePeer(pages, Path(peer_dir))
        timed = {"memcpy": memcpy.one_thread, "memcpy2": memcpy.two_threads,
                 **{t: r.run for t, r in restorers.items()}, "peer": peer.run}
        best = dict.fromkeys(timed, float("inf"))
        for _ in range(rounds * max(1, 16 // n)):  # sub-millisecond restores get more rounds
            for name, run in timed.items():  # each returns the seconds of the timed part
                best[name] = min(best[name], run())
        extra = {tier: r.extra_pages() for tier, r in restorers.items()}
    rows = []
    for tier, r in restorers.items():
        rows.append({"pages": n, "bytes": nbytes, "from": tier, "seconds": best[tier],
                     "gib_s": nbytes / best[tier] / GIB,
                     "memcpy_gib_s": nbytes / best["memcpy"] / GIB,
                     "memcpy_2_threads_gib_s": nbytes / best["memcpy2"] / GIB,
                     "ratio_to_memcpy": best["memcpy"] / best[tier],
                     "extra_pages": extra[tier], "links": r.links})
    rows.append({"pages": n, "bytes": nbytes, "from": "load_prompt_cache", "seconds": best["peer"],
                 "gib_s": nbytes / best["peer"] / GIB, "ratio_to_memcpy": best["memcpy"] / best["peer"],
                 "ratio_peer_over_ours_l3": best["peer"] / best["L3"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mlx-cache-gib", type=float, default=4.0,
                        help="mlx buffer cache limit (the engine raises it to at least 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cache_limit = int(args.mlx_cache_gib * GIB)
    mx.set_cache_limit(cache_limit)
    pinned = pin_malloc_mmap_threshold()
    rows = [row for n in args.pages for row in measure(n, args.rounds)]
    if args.json:
        print(json.dumps({"blas": blas_in_use(), "mlx_cache_limit": cache_limit,
                          "malloc_mmap_threshold_pinned": pinned, "rows": rows}, indent=1))
        return
    print(f"BLAS: {blas_in_use()}; page = {GEOMETRY.nbytes / (1 << 20):.1f} MiB; "
          f"mlx cache limit {cache_limit / GIB:g} GiB; best of {args.rounds} interleaved rounds "
          "(x16/n below 16 pages)")
    print(f"{'pages':>5} {'from':>17} {'GiB/s':>7} {'memcpy':>7} {'2thr':>6} {'ratio':>6} {'extra pages':>11}"
          f"  per link GiB/s")
    for r in rows:
        links = "  ".join(f"{k} {v['bytes'] / v['seconds'] / GIB:.2f}" for k, v in r.get("links", {}).items())
        memcpy = f"{r['memcpy_gib_s']:7.2f} {r['memcpy_2_threads_gib_s']:6.2f}" if "memcpy_gib_s" in r else " " * 14
        extra = f"{r['extra_pages']:11.2f}" if "extra_pages" in r else " " * 11
        peer = f"  load_prompt_cache time / ours from L3: {r['ratio_peer_over_ours_l3']:.2f}" \
            if "ratio_peer_over_ours_l3" in r else ""
        print(f"{r['pages']:>5} {r['from']:>17} {r['gib_s']:7.2f} {memcpy} {r['ratio_to_memcpy']:6.2f} {extra}"
              f"  {links}{peer}")
    print("ratio: memcpy time (one thread) / this time, same bytes; 2thr: memcpy split over two threads, GiB/s")
    print("extra pages: peak RSS growth + mlx peak beyond the KV, first restore of a fresh store"
          + ("" if pinned else " (glibc mmap threshold not pinned: reused heap memory may hide host buffers)"))


if __name__ == "__main__":
    main()
