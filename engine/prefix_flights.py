"""Prefix single flight: pages in flight, and the requests waiting for them (DESIGN §7).

A running request still in prefill is computing its prompt pages not yet published:
they are "in flight", led by it. A request whose next pages (after its stored prefix)
are in flight may wait for them instead of computing them again (the cost model
decides: ``costmodel.plan.plan_wait``); it is released as soon as the last page it
awaits is published, or when its deadline passes, or when its leader ends (finished,
cancelled, failed): it then plans again, restoring what was published.

Invariants (tested in tests/engine/test_prefix_flight.py):
- a page key is in flight under at most one leader; a leader's keys leave the map
  as they are published, and all of them when it ends;
- a waiter waits on one leader, for one key (the last page it awaits); it is
  released exactly once: by publication, deadline, its leader's end, or withdrawn;
- waiters never lead (they are not running), so waiting cannot form a cycle.

Not thread-safe: ``engine.scheduler`` holds its lock around each call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvtier.tiers.page import PageKey


@dataclass(frozen=True)
class Waiter:
    rid: int
    leader: int
    awaited: PageKey  # released once this key is published
    deadline: float  # time.perf_counter() by which it is released anyway


@dataclass
class Leader:
    keys: set[PageKey] = field(default_factory=set)  # in flight, not yet published
    waiters: list[Waiter] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixFlightsView:
    """The bookkeeping at one moment, read-only (a copy)."""

    in_flight: Mapping[PageKey, int]  # page key -> the leader computing it
    leaders: Mapping[int, tuple[frozenset[PageKey], tuple[Waiter, ...]]]  # leader -> (keys in flight, waiters)
    waiting: Mapping[int, Waiter]  # held request -> what it waits for


class PrefixFlights:
    """Which pages are being computed, by whom, and who waits for them."""

    def __init__(self) -> None:
        self._leader_of: dict[PageKey, int] = {}
        self._leaders: dict[int, Leader] = {}
        self._waiting: dict[int, Waiter] = {}

    def computing(self, rid: int, keys: Sequence[PageKey]) -> None:
        """Request ``rid`` started computing ``keys`` (those no other request computes)."""
        leader = self._leaders.setdefault(rid, Leader())
        for key in keys:
            if key not in self._leader_of:
                self._leader_of[key] = rid
                leader.keys.add(key)

    def in_flight(self, keys: Sequence[PageKey], start: int) -> tuple[int | None, int]:
        """(leader, count): the run of ``keys[start:]`` one leader is computing."""
        leader = self._leader_of.get(keys[start]) if start < len(keys) else None
        count = 0
        while leader is not None and start + count < len(keys) and self._leader_of.get(keys[start + count]) == leader:
            count += 1
        return leader, count

    def hold(self, rid: int, leader: int, awaited: PageKey, deadline: float) -> None:
        waiter = Waiter(rid, leader, awaited, deadline)
        self._waiting[rid] = waiter
        self._leaders[leader].waiters.append(waiter)

    def published(self, rid: int, keys: Sequence[PageKey]) -> list[int]:
        """``rid`` published ``keys``: they leave flight; returns the waiters released."""
        leader = self._leaders.get(rid)
        if leader is None:
            return []
        for key in keys:
            if key in leader.keys:
                leader.keys.discard(key)
                del self._leader_of[key]
        return self._release(leader, [w for w in leader.waiters if w.awaited not in leader.keys])

    def ended(self, rid: int) -> list[int]:
        """``rid`` ended (or its prompt is done): its keys leave flight, its waiters go."""
        leader = self._leaders.pop(rid, None)
        if leader is None:
            return []
        for key in leader.keys:
            del self._leader_of[key]
        return self._release(leader, list(leader.waiters))

    def expired(self, now: float) -> list[int]:
        """Waiters whose deadline has passed, released."""
        out = []
        for waiter in [w for w in self._waiting.values() if w.deadline <= now]:
            out += self._release(self._leaders[waiter.leader], [waiter])
        return out

    def withdraw(self, rid: int) -> None:
        """A waiter ended (cancelled) while waiting: it leaves its leader's list."""
        waiter = self._waiting.pop(rid, None)
        if waiter is not None:
            self._leaders[waiter.leader].waiters.remove(waiter)

    def is_leader(self, rid: int) -> bool:
        """Whether someone waits for ``rid``'s pages."""
        leader = self._leaders.get(rid)
        return leader is not None and bool(leader.waiters)

    def waiting(self) -> int:
        return len(self._waiting)

    def view(self) -> PrefixFlightsView:
        leaders = {rid: (frozenset(lead.keys), tuple(lead.waiters)) for rid, lead in self._leaders.items()}
        return PrefixFlightsView(
            MappingProxyType(dict(self._leader_of)), MappingProxyType(leaders), MappingProxyType(dict(self._waiting))
        )

    def _release(self, leader: Leader, waiters: list[Waiter]) -> list[int]:
        for waiter in waiters:
            leader.waiters.remove(waiter)
            del self._waiting[waiter.rid]
        return [w.rid for w in waiters]
