"""Per-tier and per-link counters (DESIGN §5), typed and frozen.

Tier gauges (capacity, bytes used, pages) describe the tier now; the other
fields only grow. Link counters record the bytes that physically crossed a link:
one restore of a compressed L3 page adds to ``L3->L2`` and ``L2->L1`` while its
tokens count once.

A tier or ledger holds one frozen value and replaces it at each change (``plus``,
``dataclasses.replace`` for gauges, under the lock that guards that tier), so what a
reader takes is a snapshot no later counting changes, and its fields are declared
once. ``to_json`` is the one place a row's JSON shape is made (the keys, in order, of
``kvtier run --json``, ``/v1/kvtier/stats`` and a store's persisted counters).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

GAUGES = ("capacity", "bytes_used", "pages")


@dataclass(frozen=True)
class TierStats:
    """One tier's counters at one moment."""

    capacity: int = 0
    bytes_used: int = 0
    pages: int = 0
    lookups: int = 0
    hit_pages: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    writes_dropped: int = 0
    writes_over_budget: int = 0  # pages leaving this tier that the L3 write budget refused (dropped)

    def plus(self, **deltas: int) -> TierStats:
        """These counters with ``deltas`` added (``plus(hit_pages=1)``)."""
        return replace(self, **{name: getattr(self, name) + n for name, n in deltas.items()})

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    def cumulative(self) -> dict[str, int]:
        """The fields that only grow (what persists across processes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in GAUGES}


@dataclass(frozen=True)
class LinkStats:
    """Bytes, pages and seconds that crossed one link, up to one moment."""

    bytes: int = 0
    pages: int = 0
    seconds: float = 0.0

    def plus(self, nbytes: int, seconds: float, pages: int = 1) -> LinkStats:
        return LinkStats(self.bytes + nbytes, self.pages + pages, self.seconds + seconds)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def add_into(total: dict, delta: dict) -> dict:
    """Add a nested dict of numbers into ``total`` (missing keys start at 0)."""
    for name, value in delta.items():
        if isinstance(value, dict):
            add_into(total.setdefault(name, {}), value)
        else:
            total[name] = total.get(name, 0) + value
    return total
