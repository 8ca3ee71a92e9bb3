"""``kvtier stats``: the counters a store persisted, as tables, JSON or Prometheus text."""

from __future__ import annotations

import argparse
import json

from kvtier.tiers.counters import TierStats
from kvtier.tiers.stats import L3Place
from kvtier.tiers.text import format_bytes

from ..serve.prometheus import format_stats
from ..stats import EngineStats
from .common import open_store
from .report import format_engine_totals, format_last_run, format_tier_table


def cmd_stats(args: argparse.Namespace) -> int:
    if args.reset:
        with open_store(args.store) as disk:
            disk.tables.reset_counters()
            disk.tables.put_meta("last_run", {})
            print(f"counters of {disk.location} reset")
        return 0
    with open_store(args.store, readonly=True) as disk:
        place = L3Place(disk.backend, disk.location, disk.file_bytes)
        now = TierStats(disk.counters.capacity, disk.counters.bytes_used, disk.counters.pages)
        stats = EngineStats.persisted(disk.tables.persistent_counters(), disk.tables.get_meta("last_run"), place, now)
    if args.json:
        print(json.dumps(stats.to_json()))
    elif args.prometheus:
        print(format_stats(stats), end="")
    else:
        _print_tables(stats)
    return 0


def _print_tables(stats: EngineStats) -> None:
    store = stats.store
    assert store is not None and store.l3 is not None  # a store's persisted counters always have both
    l3, place = store.tiers["L3"], store.l3
    print(format_tier_table(store))
    if place.backend == "redis":
        print(
            f"\nL3 is the Redis store {place.location}: it uses {format_bytes(l3.bytes_used)} "
            f"of its maxmemory {format_bytes(l3.capacity) if l3.capacity else '(none set)'}. "
            "L1 and L2 capacities belong to each run (-)."
        )
    else:
        print(
            f"\nL3 holds {format_bytes(l3.bytes_used)} of its {format_bytes(l3.capacity)} cap; "
            f"data.mdb is {format_bytes(place.file_bytes or 0)} on disk (`kvtier store compact` shrinks it). "
            "L1 and L2 capacities belong to each run (-)."
        )
    print(f"L3 reads abandoned at their deadline (those requests recomputed instead): {store.reads_abandoned}")
    if store.snapshots is not None and store.snapshots.tiers:
        print("\nState snapshots of hybrid models (their L3 records count in L3 above):")
        print(format_tier_table(store.snapshots))
    if stats.totals is not None:
        print()
        print(format_engine_totals(stats.totals))
    if stats.last_run is not None:
        print()
        print(format_last_run(stats.last_run))
