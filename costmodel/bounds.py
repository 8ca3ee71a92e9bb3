"""What tiers could give on a trace, without running a store: the infinite-cache bound
and Belady's offline choice, and the prefill seconds a reuse saves.

The infinite-cache bound: per request, the longest prefix of its reusable pages
that earlier requests published, summed over the trace and divided by all prompt
tokens (what unbounded tiers would reuse). For a hybrid model, only up to the last page
of that prefix after which an earlier request kept a snapshot (its state is needed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from .profile import Profile
from .trace import TraceRequest, page_names

BELADY = "belady"  # not a store policy: the offline bound for the same total capacity


def infinite_cache(
    trace: Sequence[TraceRequest],
    page_size: int,
    snapshot_points: Callable[[TraceRequest], list[int]] | None = None,
) -> list[int]:
    """Reused tokens per request with unbounded tiers: the longest prefix of its
    reusable pages that earlier requests published; with ``snapshot_points`` (the pages
    after which a request keeps a snapshot: a hybrid model), the longest such prefix
    that ends after a snapshot an earlier request kept."""
    published: set[tuple[int, int]] = set()
    snapshotted: set[tuple[int, int]] = set()  # pages followed by a snapshot
    reused = []
    for request in trace:
        pages = page_names(request, page_size)
        hits = next((i for i, page in enumerate(pages) if page not in published), len(pages))
        if snapshot_points is not None:
            hits = next((j for j in range(hits, 0, -1) if pages[j - 1] in snapshotted), 0)
            snapshotted.update(pages[j - 1] for j in snapshot_points(request))
        reused.append(hits * page_size)
        published.update(pages)
    return reused


def belady(trace: Sequence[TraceRequest], page_size: int, capacity_pages: int) -> list[int]:
    """Reused tokens per request for one cache of ``capacity_pages`` that always
    evicts the page used again farthest in the future (Belady's offline choice, from
    the trace's future; a page never used again is not kept). A prefix's pages are
    used together, so a page's next use is never later than the next use of the
    pages after it: the farthest is a chain's tail, and the reused prefix stays whole."""
    names = [page_names(r, page_size) for r in trace]
    never = len(trace)
    next_use: list[list[int]] = [[] for _ in trace]
    upcoming: dict[tuple[int, int], int] = {}
    for index in range(len(trace) - 1, -1, -1):
        next_use[index] = [upcoming.get(name, never) for name in names[index]]
        upcoming.update((name, index) for name in names[index])
    cached: dict[tuple[int, int], int] = {}  # page -> its next use
    farthest: list[tuple[int, tuple[int, int]]] = []  # max-heap of (-next use, page); stale entries skipped
    reused = []
    for index, pages in enumerate(names):
        reused.append(next((i for i, page in enumerate(pages) if page not in cached), len(pages)) * page_size)
        for page, use in zip(pages, next_use[index]):
            cached[page] = use
            heapq.heappush(farthest, (-use, page))
        while len(cached) > capacity_pages or (farthest and -farthest[0][0] == never):
            use, page = heapq.heappop(farthest)
            if cached.get(page) == -use:
                del cached[page]
    return reused


def compute_saved(trace: Sequence[TraceRequest], reused: Sequence[int], profile: Profile) -> float:
    """Prefill seconds saved by reusing ``reused`` tokens of each request, restores free
    (what a bound can claim)."""
    compute = profile.compute.predict
    return sum(compute(r.input_length, 0) - compute(r.input_length - k, k) for r, k in zip(trace, reused))
