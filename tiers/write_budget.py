"""L3 writes under a byte rate (``--l3-write-budget``): which pages leaving L2 (or L1, when
L2 has no room) are worth the disk's wear.

A token bucket on the store's clock (``StoreConfig.clock``: wall time in ``run`` and
``serve``, the trace's own time in a replay, so that a replay's bytes per day are the
trace's) fills at ``bytes_per_s`` up to ``BURST_S`` seconds of it (at least one page) and
starts full. A page asks with its worth in L3 and is written when the bucket holds its
bytes and its worth ranks at least as high, among the last ``MEMORY`` pages that asked,
as the bucket is empty: a full bucket (writes well under the budget) takes every page, a
nearly empty one only the pages worth most, so the budget goes to those, not to whichever
come first. Equal worths rank in the middle: a bucket of pages all worth the same writes
while it is at least half full. A page refused is counted (``skipped``, in the tier's
``writes_over_budget``) and dropped, as a page that finds no room is.

A page's worth (``worth``) is first its depth, shallower first, then its expected saving
(``EvictionPolicy.saving``: its recompute cost at its depth times its expected reuse). A
page in L3 is usable only after every page before it, so every reuse of a deeper page
needs the shallower ones: a page is worth at least what any page after it is. And pages
leave L2 leaf-first (a chain's last pages before its first): a page written while the
pages before it, leaving later, find the bucket empty is stranded (on Mooncake's
conversation trace, a budget of half of what ``lru`` writes, ranked by saving alone or
by depth alone, left 35-41% of the pages held unusable). So a page ``depth`` pages into
its chain is written only while the bucket also holds the bytes of the pages before it
(at most the bucket's size), which come next: what is written of a chain is its start.

Invariant: over any span of the clock, the bytes admitted are at most the span times
``bytes_per_s`` plus the bucket's size; ``tokens`` stays within ``0 .. capacity``.
A flush (a close, ``kvtier store flush``) is not budgeted: it writes what L1 and L2
keep, bounded by their size, once.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

Worth = tuple[int, float]  # (minus the page's depth, its expected saving): higher is worth more

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
        self.recent: deque[Worth] = deque()
        self.ranked: list[Worth] = []  # ``recent``, sorted
        self.skipped = 0

    @staticmethod
    def worth(depth: int, saving: float) -> Worth:
        """The worth of a page ``depth`` pages into its chain that is expected to save ``saving``."""
        return (-depth, saving)

    def admits(self, worth: Worth) -> bool:
        """Whether a page of this ``worth`` may be written now (its ``page_bytes`` are then
        charged); a refusal is counted in ``skipped``."""
        nbytes = self.page_bytes
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + max(now - self.at, 0.0) * self.bytes_per_s)
        self.at = max(now, self.at)
        rank = self._rank(worth)
        reserve = min(self.capacity, nbytes * (1 - worth[0]))  # its bytes and its ancestors' (module docstring)
        if self.tokens >= max(nbytes, reserve) and rank >= 1.0 - self.tokens / self.capacity:
            self.tokens -= nbytes
            return True
        self.skipped += 1
        return False

    def _rank(self, worth: Worth) -> float:
        """The share of the recent worths below ``worth`` (equal ones count half), then
        ``worth`` remembered; 1.0 for the first page."""
        below = bisect.bisect_left(self.ranked, worth)
        equal = bisect.bisect_right(self.ranked, worth) - below
        rank = (below + equal / 2) / len(self.ranked) if self.ranked else 1.0
        self.recent.append(worth)
        bisect.insort(self.ranked, worth)
        if len(self.recent) > MEMORY:
            old = self.recent.popleft()
            del self.ranked[bisect.bisect_left(self.ranked, old)]
        return rank
