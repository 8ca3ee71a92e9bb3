"""Per-tier and per-link counters (DESIGN §5).

Tier gauges (capacity, bytes used, pages) describe the tier now; the other
fields only grow. Link counters record the bytes that physically crossed a link:
one restore of a compressed L3 page adds to ``L3->L2`` and ``L2->L1`` while its
tokens count once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

GAUGES = ("capacity", "bytes_used", "pages")


@dataclass
class TierCounters:
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

    def cumulative(self) -> dict[str, int]:
        """The fields that only grow (what persists across processes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in GAUGES}


@dataclass
class LinkCounters:
    bytes: int = 0
    pages: int = 0
    seconds: float = 0.0

    def record(self, nbytes: int, seconds: float, pages: int = 1) -> None:
        self.bytes += nbytes
        self.pages += pages
        self.seconds += seconds

    def cumulative(self) -> dict[str, float]:
        return asdict(self)


def add_into(total: dict, delta: dict) -> dict:
    """Add a nested dict of numbers into ``total`` (missing keys start at 0)."""
    for name, value in delta.items():
        if isinstance(value, dict):
            add_into(total.setdefault(name, {}), value)
        else:
            total[name] = total.get(name, 0) + value
    return total
