"""Exact-input single flight (DESIGN §7).

Requests whose input tokens equal an in-flight request's wait as followers of that
leader instead of computing the same prompt again. The release policy decides
when followers become eligible for admission (they then restore the leader's
published pages): ``after-prefill`` (the leader has published its prompt pages)
or ``at-completion`` (the leader has finished).

Invariants (tested in tests/engine/test_flights.py):
- an input has at most one flight; a request is in at most one flight;
- a released flight is removed at once, so a later identical request starts a new one;
- the ids of released, unfinished requests are kept only to validate their
  termination; terminating an id that is neither a leader nor released is an error;
- a request that ends without finishing (cancelled, failed) is withdrawn in whatever
  state it is: a held follower leaves its flight, a leader hands its flight to its
  first follower, a released one is forgotten. Nothing of it remains.

Not thread-safe: the caller serialises every call (``engine.scheduler`` holds one
lock around each).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

POLICIES = ("off", "after-prefill", "at-completion")


@dataclass
class Flight:
    leader: int
    followers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FlightsView:
    """The coordinator's state at one moment, read-only (a copy)."""

    flights: Mapping[bytes, tuple[int, tuple[int, ...]]]  # flight key -> (leader, followers held, in order)
    key_of_leader: Mapping[int, bytes]  # leader -> the key of its flight
    released: frozenset[int]  # released, not yet ended


class FlightCoordinator:
    """Who leads, who waits, and who may go now."""

    def __init__(self, policy: str = "after-prefill") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown single-flight policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self._flights: dict[bytes, Flight] = {}
        self._key_of_leader: dict[int, bytes] = {}
        self._released: set[int] = set()

    def join(self, rid: int, key: bytes) -> bool:
        """Enter request ``rid`` with input ``key``; True if it must wait as a follower."""
        if self.policy == "off":
            return False
        flight = self._flights.get(key)
        if flight is not None:
            flight.followers.append(rid)
            return True
        self._flights[key] = Flight(rid)
        self._key_of_leader[rid] = key
        return False

    def is_leader(self, rid: int) -> bool:
        return rid in self._key_of_leader

    def release(self, leader: int) -> list[int]:
        """End ``leader``'s flight now; its followers may be admitted."""
        flight = self._flights.pop(self._key_of_leader.pop(leader))
        self._released.update([leader, *flight.followers])
        return flight.followers

    def prefilled(self, rid: int) -> list[int]:
        """``rid`` has published its prompt pages: followers released under ``after-prefill``."""
        if self.policy == "after-prefill" and self.is_leader(rid):
            return self.release(rid)
        return []

    def terminate(self, rid: int) -> list[int]:
        """``rid`` finished; returns followers released by it (``at-completion``)."""
        if self.policy == "off":
            return []
        released = self.release(rid) if self.is_leader(rid) else []
        if rid not in self._released:
            raise KeyError(f"single flight: unknown request id {rid}")
        self._released.remove(rid)
        return released

    def withdraw(self, rid: int) -> list[int]:
        """``rid`` ended without finishing; returns the follower released to lead its
        flight in its place, if it led one (that follower then computes the prompt)."""
        if self.policy == "off":
            return []
        if rid in self._released:
            self._released.remove(rid)
            return []
        key = self._key_of_leader.pop(rid, None)
        if key is not None:
            flight = self._flights[key]
            if not flight.followers:
                del self._flights[key]
                return []
            flight.leader = flight.followers.pop(0)
            self._key_of_leader[flight.leader] = key
            return [flight.leader]
        for flight in self._flights.values():
            if rid in flight.followers:
                flight.followers.remove(rid)
                return []
        raise KeyError(f"single flight: unknown request id {rid}")

    def view(self) -> FlightsView:
        flights = {key: (f.leader, tuple(f.followers)) for key, f in self._flights.items()}
        return FlightsView(
            MappingProxyType(flights), MappingProxyType(dict(self._key_of_leader)), frozenset(self._released)
        )

    def waiting(self) -> int:
        """Followers still held back."""
        return sum(len(f.followers) for f in self._flights.values())
