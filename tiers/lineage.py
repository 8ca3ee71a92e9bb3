"""Which page comes before which among the pages L1 and L2 hold: what leaf-first eviction
and the count of unreachable pages need.

A page key names a whole prefix (``tiers.page``), so a page is usable only while every
page before it is found too. Keys do not say which key came before them, so the store
tells ``Lineage`` as it sees chains (``learn``: a restore's keys, a published page's
parent), and ``Lineage`` follows L1's and L2's changes (a ``Residency`` watcher: every
whole page indexed or dropped).

Leaf-first (``needed``): a tier never evicts a page while a page after it stays in the
same or a faster tier, unless L1 holds it too (the L2 copy is then not what makes the
child usable), so every page kept is usable from the tiers it is in; a page's children
leave first. The page arriving (the one being published, or the one that just left L1
for L2: ``arriving``) counts as staying, so it never pushes out its own parent. The tier
asks the policy again, having told it the page was needed (``Tier.victim``); when every
unpinned page is needed it takes none and the arriving page goes further down.

Unreachable (``unreachable_share``): at each page leaving L1 or L2, the share of the
pages they hold whose previous page neither holds (they need an L3 read to be used, or
cannot be used at all), averaged over those moments; a page moving from L1 to L2 counts
as held on its way.

Invariants: ``children[tier][p]`` counts the pages ``tier`` holds whose known previous
page is ``p``; ``held_children[p]`` the same over both tiers, each page once;
``orphans`` the held pages whose previous page is a page (not a chain's root) that
neither tier holds. A page's previous page never changes (keys are content), so it is
learned once (a page published without one, taken for a chain's first page, is
corrected by the first chain that shows it); the pages it is remembered for are those
held and at most ``memory`` more, the least recently dropped forgotten first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

from .page import PageKey
from .residency import Change, Residency
from .tier import Tier

TIERS = ("L1", "L2")


class Lineage:
    """The previous page of each page L1 and L2 hold, and what depends on it."""

    def __init__(self, memory: int = 1 << 16) -> None:
        self.memory = memory
        self.parent: dict[PageKey, PageKey | None] = {}  # None: the chain's first page
        self.where: dict[PageKey, set[str]] = {}  # held page -> the tiers holding it
        self.children: dict[str, Counter[PageKey]] = {tier: Counter() for tier in TIERS}
        self.held_children: Counter[PageKey] = Counter()
        self.orphans = 0
        self._dropped: OrderedDict[PageKey, None] = OrderedDict()  # unheld pages still remembered
        self.arriving: PageKey | None = None  # set until it enters a tier, or the next one comes
        self._samples = 0
        self._share_sum = 0.0

    def learn(self, keys: Sequence[PageKey]) -> None:
        """``keys`` are a chain from its first page: each follows the one before it."""
        for i, key in enumerate(keys):
            self._learn(key, keys[i - 1] if i else None)

    def arrives(self, key: PageKey, parent: bytes | None) -> None:
        """Page ``key``, which follows ``parent``, is being published: it is ``arriving``."""
        self._learn(key, parent)
        self.arriving = key

    def _learn(self, key: PageKey, parent: bytes | None) -> None:
        """Page ``key`` follows ``parent``: a page's key, or a chain's root (a parent
        never learned as a page is taken for a root, until a chain shows otherwise)."""
        before = PageKey(parent) if parent is not None and parent in self.parent else None
        if key in self.parent and (self.parent[key] is not None or before is None):
            return
        self.parent[key] = before
        self._forget_some()
        if before is None:
            return
        for tier in self.where.get(key, ()):  # held before its parent was known
            self.children[tier][before] += 1
        if key in self.where:
            self._link(key, before, +1)

    def changed(self, change: Change) -> None:
        """A ``Residency`` watcher: ``change.key`` entered or left ``change.tier``."""
        key, tier = change.key, change.tier
        if not change.stored and key not in self.where:
            return
        parent = self.parent.get(key)
        tiers = self.where.setdefault(key, set())
        if change.stored:
            if key == self.arriving:
                self.arriving = None
            if parent is not None:
                self.children[tier][parent] += 1
            first = not tiers
            tiers.add(tier)
            self._dropped.pop(key, None)
            if first:
                self._held(key, parent, +1)
            return
        tiers.discard(tier)
        if tier == "L1":  # on its way to L2 (``tiers.placement``), unless it is dropped
            self.arriving = key
        if parent is not None:
            self._count_down(self.children[tier], parent)
        if not tiers:
            del self.where[key]
            self._held(key, parent, -1)
            self._dropped[key] = None
            self._forget_some()
        self._sample()

    def needed(self, tier: str, key: PageKey) -> bool:
        """Whether evicting ``key`` from ``tier`` would leave a page after it (held in that
        tier or a faster one, or arriving) without it (L1 holding it too, L2's copy is not
        needed)."""
        arriving_child = self.arriving is not None and self.parent.get(self.arriving) == key
        if tier == "L1":
            return arriving_child or self.children["L1"][key] > 0
        below = self.children["L1"][key] + self.children["L2"][key] > 0 or arriving_child
        return below and "L1" not in self.where.get(key, ())

    def depth(self, key: PageKey) -> int:
        """How many pages come before ``key`` in its chain, as far as the store remembers
        (0: a chain's first page, or one whose previous page is not known)."""
        n, parent = 0, self.parent.get(key)
        while parent is not None:
            n, parent = n + 1, self.parent.get(parent)
        return n

    def unreachable_share(self) -> float:
        """The mean, over every page that left L1 or L2, of the share of their pages whose
        previous page neither held at that moment (0.0 before any)."""
        return self._share_sum / max(self._samples, 1)

    def _sample(self) -> None:
        """One eviction's share of unreachable pages; a page on its way from one tier to
        the next (``arriving``) counts as held, so its children are not counted for it."""
        orphans, held, moving = self.orphans, len(self.where), self.arriving
        if moving is not None and moving not in self.where and moving in self.parent:
            parent = self.parent[moving]
            orphans += (parent is not None and parent not in self.where) - self.held_children[moving]
            held += 1
        self._samples += 1
        self._share_sum += orphans / max(held, 1)

    def _held(self, key: PageKey, parent: PageKey | None, sign: int) -> None:
        """``key`` became held (+1) or unheld (-1) by both tiers together."""
        self.orphans -= sign * self.held_children[key]  # its held children gain (lose) their parent
        if parent is not None:
            self._link(key, parent, sign)

    def _link(self, key: PageKey, parent: PageKey, sign: int) -> None:
        """Count (+1) or uncount (-1) held ``key`` as a child of ``parent``."""
        if sign > 0:
            self.held_children[parent] += 1
        else:
            self._count_down(self.held_children, parent)
        if parent not in self.where:
            self.orphans += sign

    def _forget_some(self) -> None:
        while len(self._dropped) > self.memory:
            key, _ = self._dropped.popitem(last=False)
            self.parent.pop(key, None)

    @staticmethod
    def _count_down(counter: Counter[PageKey], key: PageKey) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]


def leaf_first(residency: Residency, l1: Tier[Any], l2: Tier[Any]) -> Lineage:
    """A ``Lineage`` that follows ``residency`` and makes ``l1`` and ``l2`` evict leaf-first."""
    lineage = Lineage()
    residency.watch(lineage.changed)
    l1.needed, l2.needed = partial(lineage.needed, "L1"), partial(lineage.needed, "L2")
    return lineage
