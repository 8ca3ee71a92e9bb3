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
class StoreStats:
    """This process's counters: per tier (L1, L2, and L3 when there is one, gauges
    included), per link, and the L3 the store uses (None: none)."""

    tiers: Mapping[str, TierStats]
    links: Mapping[Link, LinkStats]
    l3: L3Place | None = None

    def to_json(self) -> dict:
        """``{"tiers": {name: fields}, "links": {name: fields}, "l3": {...}}``, without
        "l3" when there is none."""
        shape: dict = {
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
            "links": {link: counters.to_json() for link, counters in self.links.items()},
        }
        if self.l3 is not None:
            shape["l3"] = asdict(self.l3)
        return shape
