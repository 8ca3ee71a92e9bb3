"""The store's counters at one moment, typed: what ``TieredStore.stats()`` returns and
what the engine, the cost model's calibration and replay, and the benchmarks read by
attribute.

Frozen, like the rows it holds (``tiers.counters``): later counting does not change it.
``to_json`` is the one place its JSON shape is made, the keys and their order those
``kvtier run --json``, ``/v1/kvtier/stats`` and a store's persisted counters have.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from .counters import LinkStats, TierStats
from .links import Link


@dataclass(frozen=True)
class L3Place:
    """Which L3 backend a store uses (``lmdb`` or ``redis``) and where it is (a
    directory, or a URL without its password)."""

    backend: str
    location: str


@dataclass(frozen=True)
class SnapshotStats:
    """A recurrent model's state snapshots (``tiers.snapshots``): their own counters per
    tier (L1, L2; L3 snapshots are records of the L3 tier) and per link."""

    tiers: Mapping[str, TierStats]
    links: Mapping[Link, LinkStats]

    def to_json(self) -> dict:
        return _counters(self.tiers, self.links, cumulative=False)

    def cumulative(self) -> dict:
        return _counters(self.tiers, self.links, cumulative=True)


@dataclass(frozen=True)
class StoreStats:
    """This process's counters: per tier (L1, L2, and L3 when there is one, gauges
    included), per link, a recurrent model's snapshots (None: the model has none), and
    the L3 the store uses (None: none)."""

    tiers: Mapping[str, TierStats]
    links: Mapping[Link, LinkStats]
    l3: L3Place | None = None
    snapshots: SnapshotStats | None = None

    def to_json(self) -> dict:
        """``{"tiers": {name: fields}, "links": {name: fields}, "snapshots": {...},
        "l3": {...}}``, without "snapshots" or "l3" when there is none."""
        shape = _counters(self.tiers, self.links, cumulative=False)
        if self.snapshots is not None:
            shape["snapshots"] = self.snapshots.to_json()
        if self.l3 is not None:
            shape["l3"] = asdict(self.l3)
        return shape

    def cumulative(self) -> dict:
        """What the store persists: the counters that only grow, snapshots' included."""
        shape = _counters(self.tiers, self.links, cumulative=True)
        if self.snapshots is not None:
            shape["snapshots"] = self.snapshots.cumulative()
        return shape


def _counters(tiers: Mapping[str, TierStats], links: Mapping[Link, LinkStats], cumulative: bool) -> dict:
    """``{"tiers": ..., "links": ...}``: every field, or (``cumulative``) only those that
    only grow, what a store persists (a link's are all such)."""
    return {
        "tiers": {name: tier.cumulative() if cumulative else tier.to_json() for name, tier in tiers.items()},
        "links": {link: counters.to_json() for link, counters in links.items()},
    }
