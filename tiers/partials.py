"""Partial pages: a request's last page, fewer tokens than a page, kept in L1 only
(DESIGN §8a).

A conversation's next turn shares its previous turn's prompt and answer, which rarely
end on a page boundary: the partial page after the previous turn's last full page is
kept in L1 so that the next turn reuses that start too (``match``). It is keyed by its
parent and its tokens (``partial_key``), found through L1's index of pages by their
previous page (``DeviceTier.following``), and never leaves L1: evicted, it is dropped,
and it is never flushed (L2 and L3 hold whole pages). A hybrid model's partial page
carries the state after its tokens; a state cannot be cut, so such a page is reused
only whole (``match``, ``resumes``).

Every call takes the store's lock (``TieredStore``'s, shared with its other parts).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import mlx.core as mx

from .page import PageGeometry, partial_key, shared_start
from .page_rows import first_tokens
from .placement import Placement
from .policy import PageCost
from .restore import PartialMatch
from .tier import DevicePage, DeviceTier


class PartialPages:
    def __init__(
        self, l1: DeviceTier, placement: Placement, geometry: PageGeometry, with_state: bool, lock: threading.RLock
    ) -> None:
        self.l1, self.placement, self.geometry, self.page_size = l1, placement, geometry, geometry.page_size
        self.with_state = with_state  # a hybrid model's: reused only whole, with their state
        self._lock = lock
        self.page_cost = PageCost()  # the store's (``TieredStore.page_cost``)

    def publish(self, parent: bytes, tokens: Sequence[int], kv: mx.array, state: mx.array | None = None) -> bool:
        """Keep a partial page (``kv``: a page's layout of its tokens; a hybrid model's ``state``
        after them) in L1 after the page keyed ``parent``, weighed by the eviction
        policy as the fraction of a first page's recompute it saves (its depth is not
        known here). False if already there or if L1 has no room."""
        key = partial_key(parent, tokens)
        with self._lock:
            if key in self.l1 or not self.placement.make_room(self.l1):
                return False
            self.l1.add(
                key, DevicePage(tuple(tokens), kv, parent, state), self.page_cost(0) * len(tokens) / self.page_size
            )
            return True

    def match(self, parent: bytes, tokens: Sequence[int]) -> PartialMatch | None:
        """The L1 page after ``parent`` (full or partial) whose start ``tokens`` shares
        most, cut to that start; None if none shares a token. The caller passes the
        prompt's tokens after its restored pages, its last token excluded. The match
        counts as an L1 hit of its tokens. A hybrid model's match is a partial page with
        its state, all of whose tokens the prompt shares."""
        with self._lock:
            best, shared = None, 0
            for key, page in self.l1.following(parent):
                n = shared_start(page.tokens, tokens)
                whole = page.state is not None and n == len(page.tokens)
                if n > shared and (not self.with_state or whole):
                    best, shared = key, n
            if best is None:
                return None
            self.l1.counters = self.l1.counters.plus(hit_tokens=shared)
            found = self.l1.get(best)  # marked most recently used
            assert found is not None, "following() lists pages in L1 (under the same lock)"
            return PartialMatch(best, first_tokens(found.kv, self.geometry, shared), shared, found.parent, found.state)

    def shared(self, parent: bytes, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the L1 page after ``parent`` that shares most of them
        starts with (full or partial, with a state or not; not counted as a hit): where
        a prompt leaves the stored ones midway. A hybrid model keeps its state there
        (``Publisher.with_state``): the next prompt that leaves them at the same token,
        a new conversation on the same system prompt, then reuses that start too."""
        with self._lock:
            return max((shared_start(page.tokens, tokens) for _, page in self.l1.following(parent)), default=0)

    def resumes(self, parent: bytes, after: Sequence[int]) -> bool:
        """Whether a partial page with its state follows ``parent`` whose tokens ``after``
        (the prompt's tokens after that page, its last excluded) all start with
        (unverified): a hybrid restore may then end after it."""
        with self._lock:
            following = self.l1.following(parent)
        return any(p.state is not None and tuple(after[: len(p.tokens)]) == p.tokens for _, p in following)
