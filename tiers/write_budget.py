"""L3 writes under a byte rate (``--l3-write-budget``): which pages leaving L2 (or L1, when
L2 has no room) are worth the disk's wear.

A token bucket on the store's clock (``StoreConfig.clock``: wall time in ``run`` and
``serve``, the trace's own time in a replay, so that a replay's bytes per day are the
trace's) fills at ``bytes_per_s`` up to ``BURST_S`` seconds of it (at least one page) and
starts full. A page asks with its expected saving (``EvictionPolicy.saving``: its
recompute cost at its depth times its expected reuse) and is written when the bucket
holds its bytes and its saving ranks at least as high, among the last ``MEMORY`` pages
that asked, as the bucket is empty: a full bucket (writes well under the budget) takes
every page, a nearly empty one only the pages of highest saving, so the budget goes to
the pages worth most, not to whichever come first. Equal savings rank in the middle: a
bucket of pages all worth the same writes while it is at least half full. A page refused
is counted (``skipped``, in the tier's ``writes_over_budget``) and dropped, as a page
that finds no room is.

Invariant: over any span of the clock, the bytes admitted are at most the span times
``bytes_per_s`` plus the bucket's size; ``tokens`` stays within ``0 .. capacity``.
A flush (a close, ``kvtier store flush``) is not budgeted: it writes what L1 and L2
keep, bounded by their size, once.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

BURST_S = 60.0  # the bucket holds a minute of the budget: a burst of spills is smoothed, not refused
MEMORY = 1024  # the recent savings a page is ranked among


class WriteBudget:
    """A token bucket of L3 bytes that admits pages by their expected saving."""

    def __init__(self, bytes_per_s: float, page_bytes: int, clock: Callable[[], float]) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"an L3 write budget must be positive, got {bytes_per_s!r} bytes/s")
        self.bytes_per_s, self.page_bytes, self.clock = bytes_per_s, page_bytes, clock
        self.capacity = max(bytes_per_s * BURST_S, float(page_bytes))
        self.tokens = self.capacity
        self.at = clock()
        self.recent: deque[float] = deque()
        self.ranked: list[float] = []  # ``recent``, sorted
        self.skipped = 0

    def admits(self, saving: float) -> bool:
        """Whether a page worth ``saving`` may be written now (its ``page_bytes`` are then
        charged); a refusal is counted in ``skipped``."""
        nbytes = self.page_bytes
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + max(now - self.at, 0.0) * self.bytes_per_s)
        self.at = max(now, self.at)
        rank = self._rank(saving)
        if self.tokens >= nbytes and rank >= 1.0 - self.tokens / self.capacity:
            self.tokens -= nbytes
            return True
        self.skipped += 1
        return False

    def _rank(self, saving: float) -> float:
        """The share of the recent savings below ``saving`` (equal ones count half), then
        ``saving`` remembered; 1.0 for the first page."""
        below = bisect.bisect_left(self.ranked, saving)
        equal = bisect.bisect_right(self.ranked, saving) - below
        rank = (below + equal / 2) / len(self.ranked) if self.ranked else 1.0
        self.recent.append(saving)
        bisect.insort(self.ranked, saving)
        if len(self.recent) > MEMORY:
            old = self.recent.popleft()
            del self.ranked[bisect.bisect_left(self.ranked, old)]
        return rank
