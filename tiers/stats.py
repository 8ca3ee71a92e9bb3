"""The store's counters at one moment, typed: what ``TieredStore.stats()`` returns and
what the engine, the cost model's calibration and replay, and the benchmarks read by
attribute.

Frozen, like the rows it holds (``tiers.counters``): later counting does not change it.
``to_json`` is the one place its JSON shape is made, the keys and their order those
``kvtier run --json``, ``/v1/kvtier/stats`` and a store's persisted counters have.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from .counters import GAUGES, LinkStats, TierStats
from .links import Link


@dataclass(frozen=True)
class L3Place:
    """Which L3 backend a store uses (``lmdb`` or ``redis``) and where it is (a
    directory, or a URL without its password)."""

    backend: str
    location: str
    file_bytes: int | None = None  # an LMDB store's data.mdb on disk, when a report looked


@dataclass(frozen=True)
class SnapshotStats:
    """A recurrent model's state snapshots (``tiers.snapshots``): their own counters per
    tier (L1, L2; L3 snapshots are records of the L3 tier) and per link."""

    tiers: Mapping[str, TierStats]
    links: Mapping[Link, LinkStats]
    ungauged: frozenset[str] = frozenset()  # see StoreStats

    def to_json(self) -> dict:
        return _counters(self.tiers, self.links, cumulative=False, ungauged=self.ungauged)

    def cumulative(self) -> dict:
        return _counters(self.tiers, self.links, cumulative=True)

    @classmethod
    def from_cumulative(cls, d: Any) -> SnapshotStats:
        """What ``cumulative`` persisted, read back (no gauges: see StoreStats)."""
        tiers, links = _rows(d)
        return cls(tiers, links, frozenset(tiers))


@dataclass(frozen=True)
class StoreStats:
    """A store's counters: per tier (L1, L2, and L3 when there is one), per link, a
    recurrent model's snapshots (None: the model has none), and the L3 the store uses
    (None: none).

    This process's (``TieredStore.stats()``), gauges included; or the counters a store
    persisted (``from_cumulative``), summed over the processes that used it, whose L1
    and L2 gauges belonged to processes that have ended: those tiers are ``ungauged``,
    and their gauges are left out of every report (shown as ``-``, never as 0)."""

    tiers: Mapping[str, TierStats]
    links: Mapping[Link, LinkStats]
    l3: L3Place | None = None
    snapshots: SnapshotStats | None = None
    ungauged: frozenset[str] = frozenset()
    reads_abandoned: int = 0  # L3 reads abandoned at their deadline (``tiers.l3_reads``): persisted too

    def gauged(self, tier: str) -> bool:
        """Whether ``tier``'s capacity, bytes used and pages are known."""
        return tier not in self.ungauged

    def to_json(self) -> dict:
        """``{"tiers": {name: fields}, "links": {name: fields}, "snapshots": {...},
        "l3": {...}, "reads_abandoned": n}``, without "snapshots" or "l3" (and its
        reads) when there is none; an L3 row with the store's ``file_bytes`` when they
        are known."""
        shape = _counters(self.tiers, self.links, cumulative=False, ungauged=self.ungauged)
        if self.snapshots is not None:
            shape["snapshots"] = self.snapshots.to_json()
        if self.l3 is not None:
            place = asdict(self.l3)
            if (file_bytes := place.pop("file_bytes")) is not None and "L3" in shape["tiers"]:
                shape["tiers"]["L3"]["file_bytes"] = file_bytes
            shape["l3"] = place
            shape["reads_abandoned"] = self.reads_abandoned
        return shape

    @classmethod
    def from_cumulative(cls, d: Any, l3: L3Place, l3_now: TierStats) -> StoreStats:
        """The counters a store persisted (``cumulative`` summed by every process), with
        its L3's gauges as they are now (``l3_now``). Rows and fields it cannot read (a
        damaged or older record) are left out, never raised."""
        tiers, links = _rows(d)
        tiers["L3"] = TierStats(
            **{f: getattr(l3_now, f) for f in GAUGES},
            **{f: getattr(row, f) for f in _CUMULATIVE} if (row := tiers.get("L3")) else {},
        )
        raw = d.get("snapshots") if isinstance(d, Mapping) else None
        snapshots = SnapshotStats.from_cumulative(raw) if isinstance(raw, Mapping) else None
        abandoned = _numbers(d, ("reads_abandoned",), int) if isinstance(d, Mapping) else {}
        return cls(tiers, links, l3, snapshots, frozenset(tiers) - {"L3"}, **abandoned)

    def cumulative(self) -> dict:
        """What the store persists: the counters that only grow, snapshots' and the
        abandoned reads' included."""
        shape = _counters(self.tiers, self.links, cumulative=True)
        if self.snapshots is not None:
            shape["snapshots"] = self.snapshots.cumulative()
        shape["reads_abandoned"] = self.reads_abandoned
        return shape


_CUMULATIVE = tuple(f.name for f in fields(TierStats) if f.name not in GAUGES)


def _counters(
    tiers: Mapping[str, TierStats],
    links: Mapping[Link, LinkStats],
    cumulative: bool,
    ungauged: frozenset[str] = frozenset(),
) -> dict:
    """``{"tiers": ..., "links": ...}``: every field (but the gauges of ``ungauged``
    tiers), or (``cumulative``) only those that only grow, what a store persists (a
    link's are all such)."""
    return {
        "tiers": {
            name: tier.cumulative() if cumulative or name in ungauged else tier.to_json()
            for name, tier in tiers.items()
        },
        "links": {link: counters.to_json() for link, counters in links.items()},
    }


def _rows(d: Any) -> tuple[dict[str, TierStats], dict[Link, LinkStats]]:
    """The tier and link rows of a persisted ``{"tiers": ..., "links": ...}``: numbers
    under known names only (a link under a name no kvtier uses is left out)."""
    d = d if isinstance(d, Mapping) else {}
    tiers = {
        str(name): TierStats(**_numbers(row, _CUMULATIVE, int))
        for name, row in _mapping(d.get("tiers")).items()
        if isinstance(row, Mapping)
    }
    known = {link.value: link for link in Link}
    links = {
        known[name]: LinkStats(**_numbers(row, ("bytes", "pages"), int), **_numbers(row, ("seconds",), float))
        for name, row in _mapping(d.get("links")).items()
        if name in known and isinstance(row, Mapping)
    }
    return tiers, links


def _mapping(value: Any) -> Mapping:
    return value if isinstance(value, Mapping) else {}


def _numbers(row: Mapping, names: tuple[str, ...], kind: type) -> dict[str, Any]:
    return {
        name: kind(row[name])
        for name in names
        if isinstance(row.get(name), int | float) and not isinstance(row.get(name), bool)
    }
