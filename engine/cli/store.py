"""``kvtier store ls|clear|compact|resize``: manage an L3 store."""

from __future__ import annotations

import argparse
import json

from kvtier.tiers.text import format_bytes

from ..models.paths import default_store_dir
from .common import UsageError, open_store
from .report import format_namespaces


def cmd_store(args: argparse.Namespace) -> int:
    commands = {"ls": _store_ls, "clear": _store_clear, "compact": _store_compact, "resize": _store_resize}
    if isinstance(args.store, str) and args.store_command != "clear":
        raise UsageError(
            f"kvtier store {args.store_command}: not for a Redis store, which evicts by its own "
            "maxmemory and policy (`kvtier stats` shows it; `kvtier store clear` empties it)"
        )
    return commands[args.store_command](args)


def _store_ls(args: argparse.Namespace) -> int:
    with open_store(args.store, readonly=True) as disk:
        rows = [
            {"namespace": digest.hex(), **row.pop("about"), **row}
            for digest, row in disk.tables.namespaces().items()
            if row["pages"]
        ]
        listing = {
            "path": str(disk.path),
            "pages": disk.counters.pages,
            "bytes_used": disk.counters.bytes_used,
            "capacity": disk.counters.capacity,
            "file_bytes": disk.file_bytes,
            "namespaces": sorted(rows, key=lambda r: -r["last_use"]),
        }
    for row in listing["namespaces"]:
        row.setdefault("model", "?"), row.setdefault("page_size", "?"), row.setdefault("dtype", "?")
    print(json.dumps(listing) if args.json else format_namespaces(listing))
    return 0


def _store_clear(args: argparse.Namespace) -> int:
    with open_store(args.store, readonly=True) as disk:  # a bad --namespace writes nothing
        chosen = None if args.namespace is None else {_namespace(disk, prefix) for prefix in args.namespace}
    from kvtier.tiers.l3.open import StoreError

    with open_store(args.store) as disk:
        try:
            pages, nbytes = disk.clear(chosen)
        except StoreError as err:
            raise UsageError(str(err)) from None
        print(f"removed {pages} pages ({format_bytes(nbytes)}) from {disk.location}")
    return 0


def _namespace(disk, prefix: str) -> bytes:
    matches = [d for d in disk.tables.namespaces() if d.hex().startswith(prefix.lower())]
    if len(matches) != 1:
        raise UsageError(
            f"--namespace {prefix} matches {len(matches)} namespaces of {disk.location} (see `kvtier store ls`)"
        )
    return matches[0]


def _store_compact(args: argparse.Namespace) -> int:
    from kvtier.tiers.l3.lmdb_admin import compact_store
    from kvtier.tiers.l3.open import StoreError

    path = args.store or default_store_dir()
    try:
        before, after = compact_store(path)
    except StoreError as err:
        raise UsageError(str(err)) from None
    print(f"compacted {path}: data.mdb {format_bytes(before)} -> {format_bytes(after)}")
    return 0


def _store_resize(args: argparse.Namespace) -> int:
    with open_store(args.store) as disk:
        old = disk.counters.capacity
        evicted = disk.resize(args.l3_bytes)
        print(
            f"L3 cap of {disk.path}: {format_bytes(old)} -> {format_bytes(args.l3_bytes)}; "
            f"{evicted} pages evicted" + ("; `kvtier store compact` shrinks data.mdb" if evicted else "")
        )
    return 0
