"""The links between tiers: which links a page crosses into a request's KV (the one rule
the store counts by and the cost model prices by), the ledger of what crossed each link,
and the read throttle of tests and demos.

Link counters record the bytes that physically crossed a link: a compressed L3 page
read into a request adds to ``L3->L2`` (its stored bytes) and ``L2->L1`` (its raw
bytes), while its tokens count once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from enum import Enum

from .counters import LinkStats
from .page import Source


class Link(str, Enum):
    """A link between two tiers. A member is its name as a string (``Link.L2_L1 ==
    "L2->L1"``, same hash), so counters keyed by either are read by either, and JSON,
    msgpack and Prometheus labels carry the plain name; ``str`` is the string's too, so
    f-strings print the name (Python 3.11 made it ``Link.L2_L1`` for mixed-in enums).
    ``(str, Enum)`` rather than ``StrEnum``: kvtier supports Python 3.10."""

    L3_L1 = "L3->L1"
    L3_L2 = "L3->L2"
    L2_L1 = "L2->L1"
    L1_L2 = "L1->L2"
    L2_L3 = "L2->L3"
    L1_L3 = "L1->L3"

    __str__ = str.__str__


# The links that read from a tier (what a read throttle on that tier slows).
READ_LINKS = {"L2": (Link.L2_L1,), "L3": (Link.L3_L1, Link.L3_L2)}


def links_crossed(source: Source, codec: str = "raw") -> tuple[Link, ...]:
    """Links a page crosses on its way into a request's KV, by the tier it is found in
    and the codec it is stored with there: a raw L3 page is read straight from the
    record (LMDB's map, the bytes Redis sent), a compressed one is decoded into L2 and
    joined from there; an L1 page crosses none."""
    if source is Source.L3:
        return (Link.L3_L1,) if codec == "raw" else (Link.L3_L2, Link.L2_L1)
    return (Link.L2_L1,) if source is Source.L2 else ()


class Throttle:
    """Read rates of tiers (``"L2"``, ``"L3"`` -> bytes per second): a read from a
    throttled tier takes at least bytes / rate, the rest slept (tests, demos)."""

    def __init__(self, rates: dict[str, float]) -> None:
        for tier, rate in rates.items():
            if tier not in READ_LINKS or not rate > 0:
                raise ValueError(f"bad throttle {tier}={rate!r}: tier L2 or L3, rate > 0 bytes/s")
        self.rates = dict(rates)

    def wait(self, tier: str, nbytes: int, seconds: float) -> float:
        """Seconds a read of ``nbytes`` from ``tier`` took, after sleeping up to its rate."""
        rate = self.rates.get(tier)
        if rate is None or seconds >= nbytes / rate:
            return seconds
        t0 = time.perf_counter()
        time.sleep(nbytes / rate - seconds)
        return seconds + time.perf_counter() - t0


class LinkLedger:
    """Bytes, pages and seconds that crossed each link in this process (each link's
    value replaced at each change: a reader's ``stats()`` is a snapshot)."""

    def __init__(self) -> None:
        self.links = {link: LinkStats() for link in Link}

    def record(self, link: Link, nbytes: int, seconds: float, pages: int = 1) -> None:
        self.links[link] = self.links[link].plus(nbytes, seconds, pages)

    def record_restore(
        self, pages: list[tuple[Source, str, int, int]], host_s: float, join_s: float, throttle: Throttle
    ) -> None:
        """Add one restore's pages, each ``(source, codec, stored bytes read, raw bytes
        joined)``, to the links they crossed (``links_crossed``): each page takes an
        equal share of finding and joining (``join_s``, counted on the link that ends in
        L1), each L3 page an equal share of the host work (``host_s``: decodes, checks,
        an L3 throttle's wait, counted on the link that leaves L3). A link out of L3
        carries the stored bytes, ``L2->L1`` the raw ones; an L2 throttle stretches the
        joins. (A page of a sliding-window model may be read and joined in part.)"""
        moved: dict[Link, LinkStats] = {}
        from_l3 = sum(source is Source.L3 for source, *_ in pages)
        for source, codec, stored, page_nbytes in pages:
            for link in links_crossed(source, codec):
                leaves_l3 = link in READ_LINKS["L3"]
                seconds = (host_s / from_l3 if leaves_l3 else 0.0) + (
                    join_s / len(pages) if link.endswith("L1") else 0.0
                )
                moved[link] = moved.get(link, LinkStats()).plus(stored if leaves_l3 else page_nbytes, seconds)
        if (joined := moved.get(Link.L2_L1)) is not None and joined.seconds > 0:
            moved[Link.L2_L1] = replace(joined, seconds=throttle.wait("L2", joined.bytes, joined.seconds))
        for name, counters in moved.items():
            self.record(name, counters.bytes, counters.seconds, counters.pages)

    def stats(self) -> Mapping[Link, LinkStats]:
        """Every link's counters now (a copy: later records do not change it)."""
        return dict(self.links)
