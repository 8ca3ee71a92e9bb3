"""``kvtier stats``: the counters a store persisted, as tables, JSON or Prometheus text."""

from __future__ import annotations

import argparse
import json

from kvtier.tiers.text import format_bytes

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
        counters = disk.tables.persistent_counters()
        counters["last_run"] = disk.tables.get_meta("last_run") or {}
        counters.setdefault("tiers", {}).setdefault("L3", {}).update(
            capacity=disk.counters.capacity,
            bytes_used=disk.counters.bytes_used,
            pages=disk.counters.pages,
            file_bytes=disk.file_bytes,
        )
        counters["l3"] = {"backend": disk.backend, "location": disk.location}
    if args.json:
        print(json.dumps(counters))
    elif args.prometheus:
        from ..serve.prometheus import format_stats

        print(format_stats(counters), end="")
    else:
        _print_tables(counters)
    return 0


def _print_tables(counters: dict) -> None:
    l3 = counters["tiers"]["L3"]
    print(format_tier_table(counters))
    if counters["l3"]["backend"] == "redis":
        print(
            f"\nL3 is the Redis store {counters['l3']['location']}: it uses {format_bytes(l3['bytes_used'])} "
            f"of its maxmemory {format_bytes(l3['capacity']) if l3['capacity'] else '(none set)'}. "
            "L1 and L2 capacities belong to each run (-)."
        )
    else:
        print(
            f"\nL3 holds {format_bytes(l3['bytes_used'])} of its {format_bytes(l3['capacity'])} cap; "
            f"data.mdb is {format_bytes(l3['file_bytes'])} on disk (`kvtier store compact` shrinks it). "
            "L1 and L2 capacities belong to each run (-)."
        )
    if counters.get("engine"):
        print()
        print(format_engine_totals(counters["engine"]))
    if counters["last_run"]:
        print()
        print(format_last_run(counters["last_run"]))
