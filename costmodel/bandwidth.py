"""``kvtier bench restore``: link bandwidth against transfer size, beside the machine's
physical limits and mlx-lm's own prompt-cache files, all measured in one run.

Every figure is a ratio to something measured in the same run (memcpy of the same
bytes, ``load_prompt_cache`` of the same KV): this kind of machine drifts.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from itertools import cycle
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import zstandard
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from kvtier.tiers.page import PageGeometry, Source

from .calibrate import REPEATS, link_samples, prefill_samples, scratch_store
from .plan import Profile, plan_restore

GIB = 1 << 30
PAGE_COUNTS = (1, 4, 16, 64)


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_seconds(nbytes: int) -> float:
    """numpy copy of ``nbytes`` between warm buffers, timed as the links are: the
    median of ``REPEATS`` copies after a warm-up one."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    seconds = []
    for _ in range(REPEATS + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[1:])


def run(model: nn.Module, geometry: PageGeometry, store_dir: Path, tick: Callable[[], None],
        page_counts: tuple[int, ...] = PAGE_COUNTS) -> dict:
    """The report behind ``kvtier bench restore --json``."""
    links = []
    # link_samples runs each link over page_counts in order; bytes alone cannot give the
    # pages (compressed pages are smaller than a page)
    for (link, nbytes, seconds), pages in zip(link_samples(geometry, store_dir, tick, page_counts), cycle(page_counts)):
        memcpy = memcpy_seconds(nbytes)
        links.append({"link": link, "bytes": nbytes, "pages": pages, "seconds": seconds,
                      "gib_s": nbytes / seconds / GIB, "memcpy_gib_s": nbytes / memcpy / GIB,
                      "ratio_to_memcpy": memcpy / seconds})
    limits, peer = _whole_prompt(geometry, store_dir, max(page_counts))
    tick()
    profile = _profile(links, prefill_samples(model, tick))
    return {"links": links, "limits": limits, "peer": peer,
            "break_even_tokens": break_even_tokens(profile, geometry)}


def _whole_prompt(geometry: PageGeometry, store_dir: Path, pages: int) -> tuple[dict, dict]:
    """Physical limits and the peer, on the same whole-prompt KV."""
    nbytes = pages * geometry.nbytes
    with scratch_store(geometry, store_dir, pages) as (store, keys, tokens):
        store.flush()
        store.drop_l2()
        store.release(store.restore(keys, tokens).keys)  # warm the OS page cache and buffers
        store.drop_l2()
        t0 = time.perf_counter()
        restored = store.restore(keys, tokens)
        ours = time.perf_counter() - t0
        assert set(restored.sources) == {Source.L3}
        layers = restored.layers
        store.release(restored.keys)
        lmdb_read = best_seconds(lambda: store.disk.read_through(keys))
        page = np.random.default_rng(0).standard_normal(geometry.nbytes // 4, dtype=np.float32).tobytes()
        frame = zstandard.ZstdCompressor(level=3).compress(page)
        decompressor = zstandard.ZstdDecompressor()
        zstd = best_seconds(lambda: decompressor.decompress(frame)) * pages
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "prompt.safetensors")
        save_prompt_cache(path, [_kv_cache(k, v) for k, v in layers])
        peer = best_seconds(lambda: mx.eval([c.state[:2] for c in load_prompt_cache(path)]))
    limits = {"bytes": nbytes, "memcpy_gib_s": nbytes / memcpy_seconds(nbytes) / GIB,
              "lmdb_zero_copy_read_gib_s": nbytes / lmdb_read / GIB, "zstd_decompress_gib_s": nbytes / zstd / GIB}
    peer_report = {"bytes": nbytes, "load_prompt_cache_gib_s": nbytes / peer / GIB,
                   "ours_l3_gib_s": nbytes / ours / GIB, "ratio": peer / ours}
    return limits, peer_report


def _kv_cache(keys: mx.array, values: mx.array) -> KVCache:
    cache = KVCache()
    cache.state = (keys, values, keys.shape[2])
    return cache


def _profile(links: list[dict], prefill: list[tuple[int, int, float]]) -> Profile:
    profile = Profile.defaults()
    for row in links:
        profile.links[row["link"]].samples.append((row["bytes"], row["seconds"]))
    profile.compute.samples.extend(prefill)
    for fitted in (*profile.links.values(), profile.compute):
        fitted.refit()
    return profile


def break_even_tokens(profile: Profile, geometry: PageGeometry, longest: int = 1 << 16) -> dict[str, int | None]:
    """Shortest prompt whose stored prefix in each tier is worth restoring (None: never, up to ``longest``)."""
    found: dict[str, int | None] = {}
    for tier in (Source.L2, Source.L3):
        found[tier.value] = None
        for pages in range(1, longest // geometry.page_size):
            n = pages * geometry.page_size + 1
            if plan_restore([tier] * pages, n, geometry.page_size, geometry.nbytes, profile).restore_pages:
                found[tier.value] = n
                break
    return found
