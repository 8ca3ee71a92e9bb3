"""Which page a full tier gives up, and which pages L3 takes in.

A tier reports every page it adds, uses and removes to its ``EvictionPolicy`` and
asks it for a victim when it needs room. Policies only order pages; the tier keeps
the caps and the pins (a victim is always an unpinned page the tier holds).

- ``lru``: least recently used first.
- ``cost``: GreedyDual-Size-Frequency. A page's priority is ``clock + uses * cost``:
  the recompute seconds its loss would cost (per byte: every page of a tier has
  one size, so seconds order them alike), weighted by how often it was used, on
  top of the tier's clock, which rises to the priority of each victim. Pages that
  are used again climb; pages left alone fall behind the clock and leave in turn,
  however hot they once were (the aging). Equal priorities leave oldest first. A
  page's cost is the prefill seconds of recomputing it at its depth in its prompt
  (``TieredStore.page_cost``: the engine's and the replay's fitted prefill model;
  without one every page costs the same and the policy orders by uses and age), so a
  deep page outlives a shallow one of equal use. L3 keeps the same order in its LMDB
  tables (``tiers.l3.lmdb_store``), with every page costing the same.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23), scan-resistant. A new page enters a small
  probationary FIFO (a tenth of the tier); one not used again while there leaves first
  and is remembered in a ghost list of keys (as many as the tier holds), so a run of
  one-hit pages (a scan) only ever cycles through the small queue and never pushes out
  the main FIFO's reused pages. A page used while in the small queue, or added again
  while its key is a ghost, goes to the main FIFO, where a used page is given another
  round (its use count, at most 3, falls by one) instead of leaving. L3 keeps ``lru``'s
  order (``l3_order``): its records see only what L2 lets go.

``L3Admission`` decides which pages are worth writing to L3 at all: ``always``, or
``second-use``, which writes a page only once it has been seen a second time
(published again after it left, or restored), so one-off prompts never wear the disk.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable

from .page import PageKey

POLICIES = ("lru", "cost", "s3fifo")
L3_ORDERS = ("lru", "cost")  # the orders L3's tables keep
DEFAULT_POLICY = "cost"
ADMISSIONS = ("always", "second-use")

Pinned = Callable[[PageKey], bool]


class EvictionPolicy:
    """Least recently used first (the base every policy refines)."""

    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[PageKey, None] = OrderedDict()
        self.cost: dict[PageKey, float] = {}
        self.uses: dict[PageKey, int] = {}

    def added(self, key: PageKey, cost: float = 1.0) -> None:
        self.order[key] = None
        self.note(key, cost)

    def note(self, key: PageKey, cost: float) -> None:
        """Every policy's bookkeeping of a page added: its cost, no use yet."""
        self.cost[key], self.uses[key] = cost, 0

    def used(self, key: PageKey) -> None:
        self.uses[key] += 1
        self.order.move_to_end(key)

    def kept(self, key: PageKey) -> None:
        """``key``, named as the victim, stays (a page after it needs it: leaf-first,
        ``Tier.victim``): order it as a page just used, without counting a use."""
        self.order.move_to_end(key)

    def cost_of(self, key: PageKey) -> float:
        """The cost the page was added with (it goes with the page to the next tier)."""
        return self.cost[key]

    def saving(self, key: PageKey) -> float:
        """What keeping the page is expected to save: its cost times its expected reuse
        (its uses in this tier, plus the one a page is published or moved down for)."""
        return self.cost[key] * (self.uses[key] + 1)

    def removed(self, key: PageKey) -> None:
        del self.order[key], self.cost[key], self.uses[key]

    def victim(self, pinned: Pinned) -> PageKey | None:
        """The page to evict next, or None when every page is pinned."""
        return next((k for k in self.order if not pinned(k)), None)


class CostPolicy(EvictionPolicy):
    """GreedyDual-Size-Frequency over same-sized pages (see the module docstring).

    Invariant: ``priority[k]`` is the priority of every live heap entry of ``k``;
    older entries of ``k`` are stale and skipped when they surface.
    """

    name = "cost"

    def __init__(self) -> None:
        self.clock = 0.0
        self.priority: dict[PageKey, float] = {}
        self.cost: dict[PageKey, float] = {}
        self.uses: dict[PageKey, int] = {}
        self.heap: list[tuple[float, int, PageKey]] = []
        self._seq = itertools.count()

    def added(self, key: PageKey, cost: float = 1.0) -> None:
        self.note(key, cost)
        self.used(key)

    def used(self, key: PageKey) -> None:
        self.uses[key] += 1
        self.kept(key)

    def kept(self, key: PageKey) -> None:
        """Its priority from the clock now (a kept page ages like a used one)."""
        self.priority[key] = self.clock + self.uses[key] * self.cost[key]
        heapq.heappush(self.heap, (self.priority[key], next(self._seq), key))
        if len(self.heap) > 4 * len(self.priority) + 64:
            self._compact()

    def saving(self, key: PageKey) -> float:
        """Its cost times its uses (the publish counts as the first)."""
        return self.cost[key] * self.uses[key]

    def removed(self, key: PageKey) -> None:
        del self.priority[key], self.uses[key], self.cost[key]

    def victim(self, pinned: Pinned) -> PageKey | None:
        skipped, found = [], None
        while self.heap:
            entry = heapq.heappop(self.heap)
            priority, _, key = entry
            if self.priority.get(key) != priority:
                continue  # stale
            if pinned(key):
                skipped.append(entry)
                continue
            found = key
            self.clock = priority
            heapq.heappush(self.heap, entry)  # still live until the tier removes it
            break
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        return found

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if self.priority.get(e[2]) == e[0]]
        heapq.heapify(self.heap)


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO over one tier (see the module docstring).

    Invariants: every page is in exactly one of ``small`` and ``main`` (key -> use
    count, 0..3); ``ghost`` holds only keys of neither, at most as many as both held
    when its newest left;
    the small queue's target is a tenth of the pages held, at least one.
    """

    name = "s3fifo"
    MAX_USES = 3

    def __init__(self) -> None:
        self.small: OrderedDict[PageKey, int] = OrderedDict()
        self.main: OrderedDict[PageKey, int] = OrderedDict()
        self.ghost: OrderedDict[PageKey, None] = OrderedDict()
        self.cost: dict[PageKey, float] = {}
        self.uses: dict[PageKey, int] = {}

    def added(self, key: PageKey, cost: float = 1.0) -> None:
        self.note(key, cost)
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0

    def used(self, key: PageKey) -> None:
        self.uses[key] += 1
        queue = self.small if key in self.small else self.main
        queue[key] = min(queue[key] + 1, self.MAX_USES)

    def kept(self, key: PageKey) -> None:
        """To its queue's tail, its uses unchanged (a kept page is still on probation)."""
        (self.small if key in self.small else self.main).move_to_end(key)

    def removed(self, key: PageKey) -> None:
        del self.cost[key], self.uses[key]
        if key in self.small:
            del self.small[key]
            self.ghost[key] = None
            while len(self.ghost) > len(self.small) + len(self.main) + 1:  # as many as held with it
                self.ghost.popitem(last=False)
        else:
            del self.main[key]

    def victim(self, pinned: Pinned) -> PageKey | None:
        """The head of the small queue while it holds more than its share (a used one
        moves to the main queue instead), else of the main queue (a used one goes round
        again, one use fewer); pinned pages go round unchanged. None when every page of
        both queues was found pinned."""
        pinned_small = pinned_main = 0
        for _ in range((self.MAX_USES + 2) * (len(self.small) + len(self.main)) + 1):
            small_open, main_open = pinned_small < len(self.small), pinned_main < len(self.main)
            over_share = len(self.small) * 10 >= len(self.small) + len(self.main)
            if small_open and (over_share or not main_open):
                key, uses = next(iter(self.small.items()))
                if pinned(key):
                    pinned_small += 1
                    self.small.move_to_end(key)
                elif uses:
                    del self.small[key]
                    self.main[key] = 0
                else:
                    return key
            elif main_open:
                key, uses = next(iter(self.main.items()))
                if pinned(key):
                    pinned_main += 1
                elif not uses:
                    return key
                self.main.move_to_end(key)
                self.main[key] = uses if pinned(key) else uses - 1
            else:
                return None
        return None


class PageCost:
    """The seconds recomputing page ``index`` of a prompt (0: its first) takes, what the
    ``cost`` policy weighs a page by: 1.0 for every page until an owner of a prefill
    model sets ``by_index`` (the engine and the replay: ``ComputeModel.page_seconds``)."""

    def __init__(self) -> None:
        self.by_index: Callable[[int], float] = lambda index: 1.0

    def __call__(self, index: int) -> float:
        return self.by_index(index)


def make_policy(name: str) -> EvictionPolicy:
    policies = {"lru": EvictionPolicy, "cost": CostPolicy, "s3fifo": S3FifoPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
    return policies[name]()


def l3_order(policy: str) -> str:
    """The order L3's tables keep for a tier policy (``L3_ORDERS``): its own, else ``lru``."""
    return policy if policy in L3_ORDERS else "lru"


class L3Admission:
    """Which pages may be written to L3.

    ``second-use`` remembers how often recent keys were seen (at most ``memory`` keys,
    the least recently seen forgotten first) and admits a key seen twice.
    ``rejected`` counts refused writes.
    """

    def __init__(self, mode: str = "always", memory: int = 1 << 18) -> None:
        if mode not in ADMISSIONS:
            raise ValueError(f"unknown L3 admission {mode!r}; expected one of {', '.join(ADMISSIONS)}")
        self.mode, self.memory = mode, memory
        self.sightings: OrderedDict[PageKey, int] = OrderedDict()
        self.rejected = 0

    def seen(self, key: PageKey) -> None:
        """A page was published or restored."""
        if self.mode == "always":
            return
        self.sightings[key] = min(self.sightings.pop(key, 0) + 1, 2)
        if len(self.sightings) > self.memory:
            self.sightings.popitem(last=False)

    def admits(self, key: PageKey) -> bool:
        """Whether a write of ``key`` may go to L3 now (a key admitted is forgotten:
        L3 has it, and once it is evicted it must earn its place again)."""
        if not self.would_admit(key):
            self.rejected += 1
            return False
        self.sightings.pop(key, None)
        return True

    def would_admit(self, key: PageKey) -> bool:
        """Whether ``admits(key)`` would be True now (changing nothing)."""
        return self.mode == "always" or self.sightings.get(key, 0) >= 2
