"""Calibration: timed restores on every link and timed prefills, fitted into a Profile.

Link samples are restores of 1..N pages of the model's page geometry through a
scratch ``TieredStore`` next to the real store (same filesystem), timed in steady
state (after a warm-up restore). A hybrid model's links are also timed with one of its
state snapshots (``snapshot_samples``): the snapshot spacing prices a snapshot by the
links at its size (``costmodel.spacing``), which may be tens of MiB, far above the
pages sampled. Compute samples are forward passes of ``n`` tokens
after ``p`` cached ones. Each sample is the median of ``REPEATS`` timings.

The quick calibration (``kvtier run``'s first use of a store, ``kvtier calibrate
--quick``) must stay short on any BLAS: mlx's reference BLAS prefills many times slower
than OpenBLAS, so a fixed grid of prompt lengths takes seconds on one and minutes on
the other. It times one short forward pass first and scales its prefill grid so that
the prefills add up to about ``QUICK_PREFILL_S``; its link samples are few and small
(the links' speed does not depend on the BLAS), one timing each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kvtier.tiers.counters import LinkStats
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.cipher import RecordCipher
from kvtier.tiers.l3.open import scratch_location
from kvtier.tiers.links import Link
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.quant import namespace_codecs

from .profile import Profile

PAGE_COUNTS = (1, 2, 4, 8, 16)
REPEATS = 3  # timings per sample, the median kept: one stall of a noisy machine moves nothing
PREFILL_TOKENS = (32, 128, 384)
CONTEXTS = (0, 512, 1024)
# The quick grid: the fewest points a fit takes (TimeModel.refit: twice as many distinct
# inputs as terms), small ones, one timing each (the robust fit absorbs a stall).
QUICK_PAGE_COUNTS = (1, 2, 3, 4)
QUICK_REPEATS = 1
QUICK_PREFILL_S = 5.0  # what the quick prefill grid may add up to, by the probe's speed
QUICK_SCALES = (16, 8, 4, 2, 1)  # prompt lengths scale, s, 2s, 4s after 0 and 4s cached: the largest that fits
PROBE_TOKENS = 4
SNAPSHOT_LINKS = (Link.L2_L1, Link.L3_L1)  # a snapshot is restored raw (no L2 slot to decode into)

Tick = Callable[[], None]


def calibrate(
    model: nn.Module,
    geometry: PageGeometry,
    store_dir: Path,
    tick: Tick = lambda: None,
    quick: bool = False,
    codecs: tuple[str, str] = ("raw", "raw"),
) -> Profile:
    """Measure links and prefill on this machine; ``tick`` is called once per sample.
    ``quick``: the quick grid (``quick_grid``), a rougher fit in seconds. ``codecs``: the
    store's L3 and L2 codecs, whose decodes ``L3->L2`` and ``L2->L1`` measure
    (``link_samples``)."""
    profile = Profile.defaults()
    page_counts, repeats = (QUICK_PAGE_COUNTS, QUICK_REPEATS) if quick else (PAGE_COUNTS, REPEATS)
    for link, nbytes, seconds in [
        *link_samples(geometry, store_dir, tick, page_counts, repeats, *codecs),
        *snapshot_samples(geometry, store_dir, tick, repeats),
    ]:
        profile.links[link].samples.append((nbytes, seconds))
    prefill_tokens, contexts = quick_grid(model) if quick else (PREFILL_TOKENS, CONTEXTS)
    for n, p, seconds in prefill_samples(model, tick, prefill_tokens, contexts, repeats):
        profile.compute.samples.append((n, p, seconds))
    for fitted in (*profile.links.values(), profile.compute):
        fitted.refit()
    profile.calibrated = True
    return profile


def quick_grid(model: nn.Module, budget_s: float = QUICK_PREFILL_S) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt lengths, contexts) of the quick prefill samples: ``(s, 2s, 4s)`` after 0 and
    ``4s`` cached tokens, for the largest ``s`` of ``QUICK_SCALES`` whose passes (and
    the context's) add up to ``budget_s`` at the speed of a timed ``PROBE_TOKENS``-token
    pass (after one untimed: kernels warm). Per-pass overhead makes the probe's
    per-token time an overestimate for longer passes: the grid errs short."""
    tokens = mx.array([[32 + i for i in range(PROBE_TOKENS)]])
    mx.eval(model(tokens))
    t0 = time.perf_counter()
    mx.eval(model(tokens))
    per_token = (time.perf_counter() - t0) / PROBE_TOKENS
    for s in QUICK_SCALES:
        grid = ((s, 2 * s, 4 * s), (0, 4 * s))
        if per_token * (len(grid[1]) * sum(grid[0]) + max(grid[1])) <= budget_s:
            return grid
    return grid


def steps(page_counts: Iterable[int] = PAGE_COUNTS, quick: bool = False, snapshots: bool = False) -> int:
    """How many samples ``calibrate`` takes (for a progress bar); ``snapshots``: for a
    model with state layers (two more: ``snapshot_samples``)."""
    extra = len(SNAPSHOT_LINKS) if snapshots else 0
    if quick:
        return 3 * len(QUICK_PAGE_COUNTS) + 3 * 2 + extra
    return 3 * len(tuple(page_counts)) + len(PREFILL_TOKENS) * len(CONTEXTS) + extra


@contextmanager
def scratch_store(
    geometry: PageGeometry,
    store_dir: Path | str,
    pages: int,
    codec: str = "raw",
    cipher: RecordCipher | None = None,
    l2_codec: str = "raw",
) -> Iterator[tuple[TieredStore, list, list[int]]]:
    """A throwaway store beside ``store_dir`` (same filesystem, or the same Redis server:
    the L3 link measured is the one in use) holding ``pages`` random pages in L2 (and
    nothing in L1), with their keys and tokens; removed afterwards. For a hybrid model,
    also a random snapshot after the last page, likewise in L2 only.
    Random values compress a little (~0.93 with zstd), as real KV does. With a ``cipher``
    its L3 records are encrypted. Random values quantize like real KV (``tiers.quant``:
    every group has its own scale)."""
    size, state_bytes = geometry.page_size, geometry.snapshot_nbytes
    tokens = list(range(pages * size + 1))
    namespace = Namespace(
        "kvtier-calibration",
        geometry.dtype,
        size,
        encryption=cipher.name if cipher else "",
        codecs=namespace_codecs(codec, l2_codec),
    )
    keys = page_keys(namespace, tokens)[:pages]
    room = (pages + 1) * geometry.nbytes + 2 * state_bytes
    with scratch_location(store_dir) as scratch:
        config = StoreConfig(
            l1_bytes=0,
            l2_bytes=room,
            l3_bytes=4 * room,
            store_dir=scratch,
            codec=codec,
            l2_codec=l2_codec,
            snapshot_l1_bytes=0,
            snapshot_l2_bytes=2 * state_bytes,
            cipher=cipher,
        )
        store = TieredStore(geometry, namespace, config)
        rng = np.random.default_rng(0)
        for i, key in enumerate(keys):
            kv = mx.array(rng.standard_normal(geometry.shape, dtype=np.float32)).astype(_mx_dtype(geometry))
            store.publish(key, tokens[i * size : (i + 1) * size], kv)
        if state_bytes:
            state = mx.array(rng.integers(0, 256, state_bytes, dtype=np.uint8))
            store.publish_snapshot(keys[-1], tokens[(pages - 1) * size : pages * size], state)
        try:
            yield store, keys, tokens
        finally:
            store.close()


def link_samples(
    geometry: PageGeometry,
    store_dir: Path,
    tick: Tick,
    page_counts: Iterable[int] = PAGE_COUNTS,
    repeats: int | None = None,
    codec: str = "raw",
    l2_codec: str = "raw",
) -> list[tuple[str, int, float]]:
    """(link, bytes, seconds) of restores from L2 and from L3 (OS page cache warm): raw
    pages (``L3->L1``) and pages of the store's ``codec`` (``L3->L2``: their stored
    bytes and their decode into L2; zstd pages for a raw store); the median of
    ``repeats`` (default ``REPEATS``) timings each, L2 holding its pages in ``l2_codec``.
    A quantizing codec's decode is what decides whether its pages are worth restoring,
    so it is measured, not assumed."""
    counts = tuple(page_counts)
    samples = []
    decoded = "zstd" if codec == "raw" else codec
    for kind, links in (("raw", (Link.L2_L1, Link.L3_L1)), (decoded, (Link.L3_L2,))):
        with scratch_store(geometry, store_dir, max(counts), kind, None, l2_codec) as (store, keys, tokens):
            store.keeping.flush()
            for link in links:
                for k in counts:
                    samples.append(_timed(store, keys[:k], tokens, link, repeats or REPEATS))
                    tick()
    return samples


def snapshot_samples(
    geometry: PageGeometry, store_dir: Path, tick: Tick, repeats: int | None = None
) -> list[tuple[str, int, float]]:
    """(link, bytes, seconds) of a hybrid model's state snapshot restored from L2 and from
    L3 (raw), the median of ``repeats`` timings each; none for a model without state
    layers. The snapshot's own bytes and time only (its page's are counted apart)."""
    if not geometry.snapshot_nbytes:
        return []
    samples = []
    with scratch_store(geometry, store_dir, 1) as (store, keys, tokens):
        store.keeping.flush()
        for link in SNAPSHOT_LINKS:
            samples.append(_timed(store, keys, tokens, link, repeats or REPEATS, snapshots=True))
            tick()
    return samples


def _timed(
    store: TieredStore, keys: list, tokens: list[int], link: Link, repeats: int, snapshots: bool = False
) -> tuple[str, int, float]:
    """Bytes and median seconds on ``link`` of ``repeats`` steady-state restores of ``keys``
    (for an L3 link, with L2's copies dropped before each, so every restore reads L3),
    as the store counts them for its pages or (``snapshots``) its snapshots."""

    def counted() -> LinkStats:
        stats = store.stats()
        if snapshots:
            assert stats.snapshots is not None, "a store of a model with state snapshots"
            return stats.snapshots.links[link]
        return stats.links[link]

    seconds = []
    for _ in range(repeats + 1):  # the first warms mlx's buffers (and the page cache)
        if link.startswith("L3"):
            store.keeping.drop_l2()
        before = counted()
        store.release(store.restore(keys, tokens).keys)
        after = counted()
        seconds.append(after.seconds - before.seconds)
    return link, after.bytes - before.bytes, statistics.median(seconds[1:])


def prefill_samples(
    model: nn.Module,
    tick: Tick,
    prefill_tokens: Iterable[int] = PREFILL_TOKENS,
    contexts: Iterable[int] = CONTEXTS,
    repeats: int | None = None,
) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, median seconds of ``repeats``, default ``REPEATS``) of forward passes."""
    prefill_tokens, contexts = tuple(prefill_tokens), tuple(contexts)
    tokens = mx.array([[(i * 31) % 200 + 32 for i in range(max(contexts) + max(prefill_tokens))]])
    mx.eval(model(tokens[:, :8]))  # warm-up: kernels (mlx is lazy: unevaluated, nothing would run)
    samples = []
    for p in contexts:
        cache = make_prompt_cache(model)
        if p:
            mx.eval(model(tokens[:, :p], cache=cache))
        for n in prefill_tokens:
            seconds = []
            for _ in range(repeats or REPEATS):
                t0 = time.perf_counter()
                mx.eval(model(tokens[:, p : p + n], cache=cache))
                seconds.append(time.perf_counter() - t0)
                trim_prompt_cache(cache, n)
            samples.append((n, p, statistics.median(seconds)))
            tick()
    return samples


def _mx_dtype(geometry: PageGeometry) -> mx.Dtype:
    return getattr(mx, geometry.dtype)
