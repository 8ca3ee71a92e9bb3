"""Joining a restore's pages into the request's KV, and the copy threads behind it.

A restore ends with every page's bytes in host memory (L1 pages as views of their
device arrays, L2 slots, raw L3 pages as views of LMDB's map, compressed ones
decoded into L2 slots); ``join_pages`` turns them into mlx-lm's per-layer K/V
arrays in one pass, hashing the L3 pages as it copies them.
"""

from __future__ import annotations

import atexit
import functools
import io
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, TypeVar, cast

import mlx.core as mx
import numpy as np
from xxhash import xxh3_64

from . import page_rows
from .layout import SLOT_OFFSET
from .page import PageGeometry

SLACK = 4096  # bytes a joined array's buffer has beyond its payload, to place it (see JoinedPages)
# numpy declares ndarray's buffer protocol (``__buffer__``) for Python 3.12 on only, so
# the hashers and memoryviews here take an array's ``.data``: the same bytes, no copy.


@dataclass(frozen=True)
class JoinLimits:
    """How a restore's bulk copies are cut up (``StoreConfig.join_limits``); the defaults
    serve every store, and a test shrinks them to run the threaded and grouped paths on
    tiny pages.

    Threads: numpy copies and LMDB reads release the GIL, and one thread alone does not
    saturate memory bandwidth, so a few threads (``workers``, the caller's included) copy
    faster (bench/restore_bandwidth.py measures by how much). Each takes at least
    ``min_share`` bytes, so a small restore stays on one thread (handing work over costs
    more than it saves). ``max_buffer``: bytes of one restored array (a group of layers).
    ``hash_chunk``: a hashed page is hashed and copied this many bytes (whole layers) at a
    time, so the copy reads what the hash just brought into the core's own cache instead
    of memory.
    """

    workers: int = max(1, min(4, os.cpu_count() or 1))
    min_share: int = 4 << 20
    max_buffer: int = 64 << 20
    hash_chunk: int = 512 << 10

    def __post_init__(self) -> None:
        if min(self.workers, self.min_share, self.max_buffer, self.hash_chunk) < 1:
            raise ValueError(f"join limits must all be at least 1: {self}")


_T = TypeVar("_T")


_joined = False


@atexit.register
def _let_mlx_finish_loads() -> None:
    """mlx ends an ``mx.load`` from a Python file on one of its own threads, which needs
    the GIL; a process exiting right then aborts. A pause at exit lets it finish."""
    if _joined:
        time.sleep(0.02)


def keep_buffers_for_restores(limit: int = 1 << 30) -> None:
    """Raise mlx's buffer-cache limit to at least ``limit``: a restore's arrays come from
    that cache, and below the limit freed buffers are kept for the next restore
    instead of being returned to the OS and faulted in again (each fresh page is faulted in
    and zero-filled by the kernel before the copy can write it)."""
    previous = mx.set_cache_limit(1 << 62)  # read the limit by raising it: lowering would trim the cache
    mx.set_cache_limit(max(previous, limit))


@dataclass
class Joined:
    """A restore's pages joined into per-layer K/V, with the checksums taken on the way."""

    layers: list[tuple[mx.array, mx.array]]  # per layer K, V: (1, kv_heads, tokens, head_dim)
    # xxh3_64 of each page's bytes where asked for, else None (a window model's: one per segment)
    digests: list[int | tuple[int | None, int | None] | None]


def join_pages(
    hosts: list[np.ndarray],
    geometry: PageGeometry,
    digest: Sequence[bool] = (),
    limits: JoinLimits = JoinLimits(),
    blocks: Sequence[int] | None = None,
) -> Joined:
    """Per-layer K/V device arrays of consecutive pages (of their rows in ``blocks``,
    consecutive blocks of a page: a record segment's; None: all), block by block
    (``_join_block``); each page flagged in ``digest`` hashed over those rows' bytes
    in order, which are one segment's checksum."""
    if blocks is not None and not blocks:
        return Joined([], [None] * len(hosts))
    hashers = [xxh3_64() if i < len(digest) and digest[i] else None for i in range(len(hosts))]
    if blocks is None and geometry.uniform:  # every row at once: the page's own array
        layers = _join_block(hosts, geometry, hashers, limits)
    else:
        layers = []
        for b in range(len(geometry.blocks)) if blocks is None else blocks:
            part = geometry.block(b)
            layers += _join_block([geometry.block_array(host, b) for host in hosts], part, hashers, limits)
    return Joined(layers, [None if h is None else h.intdigest() for h in hashers])


def _join_block(
    hosts: list[np.ndarray], geometry: PageGeometry, hashers: list[xxh3_64 | None], limits: JoinLimits
) -> list[tuple[mx.array, mx.array]]:
    """Per-layer K/V device arrays of consecutive pages of a uniform geometry (one
    block's rows), written in one pass.

    One page is its own join (``_page_here``): copied layer by layer on this thread,
    each layer into arrays of its own, with no mlx evaluation: waking mlx's threads
    (its loads, its evaluation of views) or a hashing thread costs a one-page restore
    about as much as its copy when the machine is busy.

    Two pages or more: ``mx.load`` reads the joined prefix from a file-like ``JoinedPages``,
    whose ``readinto`` is handed mlx's freshly allocated buffer and gathers the pages
    straight into it: no host staging, no zero-fill, so nothing beyond the
    request's own KV (and ``SLACK`` bytes an array, to place it). One load per group of
    layers of at most ``limits.max_buffer`` bytes (a few for a long prefix): mlx's buffer cache then keeps and reuses
    them like the model's own buffers, and a cache trim drops one group, not
    the whole prefix. The layers are views of the groups' arrays.

    Pages flagged in ``digest`` are hashed, a few layers at a time, just before those
    bytes are copied (they are then in the CPU cache), so checking them costs no second
    pass over memory; the caller compares the digests and drops what follows a bad
    page.
    """
    global _joined
    g = geometry
    layer_bytes = len(hosts) * g.nbytes // g.num_layers
    if len(hosts) == 1:
        return _page_here(hosts[0], g, hashers[0])
    _joined = True
    per_group = max(1, min(g.num_layers, limits.max_buffer // layer_bytes))
    layers: list[tuple[mx.array, mx.array]] = []
    for first in range(0, g.num_layers, per_group):
        group = range(first, min(first + per_group, g.num_layers))
        kv = _join_group(hosts, g, group, hashers, limits)
        kv = kv.view(mx.bfloat16) if g.dtype == "bfloat16" else kv
        layers.extend(page_rows.rows(kv, g))  # views, lazy: (1, heads, tokens, dim)
    return layers


def _page_here(host: np.ndarray, geometry: PageGeometry, hasher: xxh3_64 | None) -> list[tuple[mx.array, mx.array]]:
    """One page, its own join, layer by layer on this thread: each layer hashed (if
    asked), then copied while it is in the CPU cache into its own K and V arrays.
    ``mx.array`` copies now and leaves no lazy work, so the layers need no evaluation
    (a bfloat16 page's are views of those copies, evaluated without copying)."""
    layers = []
    for layer in range(geometry.num_layers):
        if hasher is not None:
            hasher.update(host[layer].data)
        keys, values = geometry.key_value(host, layer)
        layers.append((_device(keys, geometry), _device(values, geometry)))
    return layers


def _device(rows: np.ndarray, geometry: PageGeometry) -> mx.array:
    """A copy of ``rows`` as a new mlx array now, in the page's dtype."""
    array = mx.array(rows)  # a copy (of a strided view too: a fused row's K or V)
    return array.view(mx.bfloat16) if geometry.dtype == "bfloat16" else array


def _join_group(
    hosts: list[np.ndarray], geometry: PageGeometry, layers: range, hashers: list[xxh3_64 | None], limits: JoinLimits
) -> mx.array:
    """The pages joined along tokens for ``layers``, as one new mlx array, read now
    (while the pages are pinned), each hasher fed its page's bytes of these layers."""
    joined = JoinedPages(hosts, geometry, layers, hashers, limits)
    # mlx reads any object with readinto, seek and tell (its hint says a binary file); a
    # .npy file is one array (its hint gives every kind load returns)
    flat = cast(mx.array, mx.load(cast(BinaryIO, joined), format="npy"))
    mx.eval(flat)
    first = joined.start // joined.dtype.itemsize
    kv = flat[first : first + joined.payload // joined.dtype.itemsize].reshape(joined.shape)  # a view
    joined.hash_rest()
    return kv


class JoinedPages:
    """A read-only file: a flat ``.npy`` holding, ``start`` bytes in, consecutive pages
    of a uniform geometry joined along tokens for a range of layers (``shape``:
    ``(layers, 2, kv_heads, pages * page_size, head_dim)``, or its fused form), then
    slack up to ``SLACK`` bytes.

    Where the join starts: a read of the whole payload (what ``mx.load`` does) puts it
    at ``SLOT_OFFSET`` past a 4 KiB boundary of memory, where L2 slots start: a copy
    from a slot then pairs aligned loads with aligned stores and never 4K-aliases
    (``tiers.layout.slot_arena``), wherever mlx's allocator put the buffer. Other reads
    put it at 0.

    Why a file: ``mx.load`` allocates the array and hands its memory to ``readinto``,
    the one way mlx's Python API lets us fill a fresh mlx buffer in a single pass
    (``mx.array`` copies a finished host buffer, ``mx.zeros``/``mx.empty`` write the
    whole buffer first). That is mlx's private behaviour, not its API: pyproject pins
    the mlx versions whose behaviour tests/tiers/test_hierarchy.py checks directly. mlx
    calls ``readinto`` on one of its own I/O threads, which takes the GIL; CPython 3.11's
    tracemalloc is not safe with threads made outside Python (it can crash), so do not
    trace allocations around restores.

    A read of the whole payload (what ``mx.load`` does) gathers with a few threads,
    one run of pages each, hashing each page's layers just before copying them;
    any other read is served run by run (a run: one page's tokens of one layer, K or
    V, and head) and hashes nothing.
    """

    closed = False

    def __init__(
        self,
        hosts: list[np.ndarray],
        geometry: PageGeometry,
        layers: range,
        hashers: Sequence[xxh3_64 | None] = (),
        limits: JoinLimits = JoinLimits(),
    ) -> None:
        g = geometry
        self.hosts = [host[layers.start : layers.stop] for host in hosts]
        self.hashers = list(hashers) or [None] * len(hosts)
        self.hashed = False  # whether a whole-payload read hashed every page's layers
        _, parts, heads, _, width = g.shape
        self.shape = (len(layers), parts, heads, g.page_size * len(hosts), width)
        self.dtype = g.storage_dtype
        self.run = g.page_size * width * self.dtype.itemsize
        self.limits = limits
        self.chunk = max(1, limits.hash_chunk * g.num_layers // g.nbytes)  # layers of a page hashed, then copied
        self.payload = len(hosts) * g.nbytes * len(layers) // g.num_layers  # bytes of the join
        self.start = 0  # where the join starts in the file's payload
        self.size = self.payload + SLACK  # bytes of the file's payload
        self.header = _npy_header(self.dtype.str, self.size // self.dtype.itemsize)
        self.pos = 0

    def hash_rest(self) -> None:
        """Feed each hasher its page's layers unless a whole-payload read already did
        (mlx read the file in pieces): after a full read, every hasher has its page's
        bytes of these layers, in order, whatever the read pattern."""
        if not self.hashed:
            for host, hasher in zip(self.hosts, self.hashers):
                if hasher is not None:
                    hasher.update(host.data)
            self.hashed = True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.header) + self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        start, head = self.pos, len(self.header)
        end = min(start + len(out), head + self.size)
        if end <= start:
            return 0
        if start < head:
            out[: min(end, head) - start] = self.header[start : min(end, head)]
        if end > head:
            at = max(start, head)
            self._gather(out[at - start : end - start], at - head)
        self.pos = end
        return end - start

    def _gather(self, out: memoryview, offset: int) -> None:
        """The file's payload bytes ``offset .. offset + len(out)`` into ``out``."""
        if offset == 0 and len(out) == self.size:  # all of it: straight into the array
            self.start = (SLOT_OFFSET - np.frombuffer(out, np.uint8).ctypes.data) % SLACK
            joined = np.frombuffer(out[self.start : self.start + self.payload], self.dtype).reshape(self.shape)
            size = self.shape[3] // len(self.hosts)

            def fill(pages: Sequence[int]) -> None:
                for i in pages:
                    host, hasher, tokens = self.hosts[i], self.hashers[i], slice(i * size, (i + 1) * size)
                    if hasher is None:
                        joined[:, :, :, tokens] = host
                        continue
                    for a in range(0, len(host), self.chunk):  # hashed, then copied from the core's cache
                        hasher.update(host[a : a + self.chunk].data)
                        joined[a : a + self.chunk, :, :, tokens] = host[a : a + self.chunk]

            in_parallel(fill, shares(range(len(self.hosts)), self.payload, self.limits))
            self.hashed = True
            return
        runs = [host.view(np.uint8).reshape(-1, self.run) for host in self.hosts]
        row_bytes = self.run * len(self.hosts)  # one (layer, K or V, head) row of the join
        slack = min(len(out), max(0, offset + len(out) - self.payload))  # bytes read past the join
        out[len(out) - slack :] = bytes(slack)
        out = out[: len(out) - slack]
        done = 0
        while done < len(out):
            row, within = divmod(offset + done, row_bytes)
            page, at = divmod(within, self.run)
            n = min(self.run - at, len(out) - done)
            out[done : done + n] = runs[page][row, at : at + n].data
            done += n


@functools.lru_cache(maxsize=64)
def _npy_header(descr: str, count: int) -> bytes:
    """The ``.npy`` header of a flat array of ``count`` items: the same few sizes recur
    (one per page count and group), and numpy's writer costs a small restore more than
    a lookup."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": (count,)})
    return header.getvalue()


_pools: dict[int, ThreadPoolExecutor] = {}  # threads -> the shared pool of that many
_setup = threading.Lock()


def _chunks(items: Sequence[_T], n: int) -> list[Sequence[_T]]:
    """``items`` cut into at most ``n`` contiguous, non-empty, near-equal runs."""
    n = max(1, min(n, len(items)))
    bounds = [len(items) * i // n for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def shares(items: Sequence[_T], nbytes: int, limits: JoinLimits) -> list[Sequence[_T]]:
    """``items`` cut into at most ``limits.workers`` runs, each worth at least
    ``limits.min_share`` of ``nbytes``."""
    return _chunks(items, min(limits.workers, max(1, nbytes // limits.min_share)))


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` copy threads, made once: every store with the
    same limits shares it."""
    with _setup:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy")
        return _pools[threads]


def in_parallel(work: Callable[[_T], None], parts: Sequence[_T]) -> None:
    """``work(part)`` for every part: the first on this thread, the others on a shared
    pool of one thread each; returns when all are done (raising the first error)."""
    pool = _executor(len(parts) - 1) if len(parts) > 1 else None
    futures = [pool.submit(work, part) for part in parts[1:]] if pool is not None else []
    try:
        if parts:
            work(parts[0])
    finally:
        for future in futures:
            future.exception()  # wait: the others write into buffers the caller owns
    for future in futures:
        future.result()
