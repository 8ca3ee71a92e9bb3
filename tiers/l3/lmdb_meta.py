"""The meta numbers of an LMDB store (``bytes_used``, ``pages``, ``access_seq``, ``clock``,
``capacity`` in the ``meta`` database) read inside a transaction, with a defined value
for each one that is damaged, and the namespaces table rebuilt from the records.

A damaged number (garbage, or not a whole number >= 0) is one warning (``DamageLog``)
and its fallback, taken from what the records and the eviction order say:
``bytes_used`` and ``pages`` are recounted from the records; ``access_seq`` continues
after the highest rank in ``order``; ``clock`` (the ``cost`` policy's aging) restarts at
the lowest rank in ``order`` (no page outranks a victim it should have outlived); a
damaged ``capacity`` reads as the default cap. A write transaction saves what it read,
so the first write repairs the store; a read-only opener repairs nothing.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import lmdb
import msgpack

from ..text import format_bytes
from .record import header_or_none
from .tables import DamageLog, is_count, is_namespace_row, unpacked

if TYPE_CHECKING:
    from lmdb import _Database as Database  # the stub's handle type: annotations only

STATE_FIELDS = ("bytes_used", "pages", "access_seq", "capacity", "clock")
_SEQ = struct.Struct(">Q")
_LOW = 0xFFFFFFFF


@dataclass
class StoreState:
    """The meta numbers, read and written back inside one write transaction, and the
    per-namespace changes that transaction makes (added to ``namespaces`` on save)."""

    bytes_used: int = 0
    pages: int = 0
    access_seq: int = 0
    clock: int = 0  # the ``cost`` policy's aging clock: the priority of the last victim
    capacity: int = 0
    namespaces: dict[bytes, list[int]] = field(default_factory=dict)  # digest -> [pages, bytes, tokens]
    used: set[bytes] = field(default_factory=set)  # namespaces whose pages were written or read

    def tally(self, namespace: bytes | None, pages: int, nbytes: int, tokens: int) -> None:
        """Count records in or out (namespace None: a record whose header is unreadable)."""
        if namespace is not None:
            row = self.namespaces.setdefault(namespace, [0, 0, 0])
            for i, n in enumerate((pages, nbytes, tokens)):
                row[i] += n
        self.bytes_used += nbytes
        self.pages += pages


def ns_row() -> dict:
    """A namespaces-table row before anything is counted in it."""
    return {"pages": 0, "bytes": 0, "tokens": 0, "last_use": 0.0, "about": {}}


@dataclass
class MetaTables:
    """What reading the meta numbers needs: the handles, how a record counts against the
    cap, the eviction policy, the cap a damaged one falls back to, where damage is told."""

    meta: Database
    pages: Database
    order: Database
    size: Callable[[memoryview | bytes], int]
    policy: str
    default_capacity: int
    damage: DamageLog

    def load_state(self, txn: lmdb.Transaction) -> StoreState:
        state = StoreState()  # a number not stored yet reads as 0
        damaged = []
        for name in STATE_FIELDS:
            readable, value = unpacked(txn.get(name.encode(), db=self.meta))
            if readable and (value is None or is_count(value)):
                setattr(state, name, value or 0)
            else:
                damaged.append(name)
        if "bytes_used" in damaged or "pages" in damaged:
            recount = self.count_records(txn)
            state.bytes_used, state.pages = recount.bytes_used, recount.pages
        ranks = [_SEQ.unpack_from(key)[0] for key in self._order_keys(txn)] if damaged else []
        if "access_seq" in damaged:
            state.access_seq = max((r if self.policy == "lru" else r & _LOW for r in ranks), default=0)
        if "clock" in damaged:
            state.clock = min(ranks, default=0) >> 32 if self.policy == "cost" else 0
        if "capacity" in damaged:
            state.capacity = self.default_capacity
        for name in damaged:
            fallback = f"taken as {format_bytes(state.capacity)}" if name == "capacity" else _FALLBACKS[name]
            self.damage.report(f"meta value {name}", fallback)
        return state

    def count_records(self, txn: lmdb.Transaction) -> StoreState:
        """Bytes, pages and per-namespace counts of the records, read from the records."""
        state = StoreState()
        for _, value in txn.cursor(db=self.pages):
            header = header_or_none(value)
            namespace, tokens = (None, 0) if header is None else (header.namespace, header.token_count)
            state.tally(namespace, 1, self.size(value), tokens)
        return state

    def _order_keys(self, txn: lmdb.Transaction) -> list[bytes]:
        return [bytes(key) for key, _ in txn.cursor(db=self.order)]

    def rebuilt_namespaces(self, txn: lmdb.Transaction, namespaces: Database | None) -> dict[bytes, dict]:
        """The namespaces table as the records say it should be: counts from the records,
        ``about`` and ``last_use`` from the sound rows (a namespace without pages keeps
        its row)."""
        kept = {}
        for digest, stored in txn.cursor(db=namespaces) if namespaces is not None else ():
            readable, row = unpacked(stored)
            if readable and is_namespace_row(row):
                kept[bytes(digest)] = row
        counted = self.count_records(txn).namespaces
        rows = {}
        for digest in kept.keys() | counted.keys():
            pages, nbytes, tokens = counted.get(digest, (0, 0, 0))
            rows[digest] = {**kept.get(digest, ns_row()), "pages": pages, "bytes": nbytes, "tokens": tokens}
        return rows

    def rebuild_namespaces(self, txn: lmdb.Transaction, namespaces: Database | None) -> None:
        """Fill the namespaces table anew from the records (a store from before the
        table, or one with a damaged row), inside the write transaction ``txn``; nothing
        for a store opened without the table (read-only, from before it existed)."""
        if namespaces is None:
            return
        rows = self.rebuilt_namespaces(txn, namespaces)
        txn.drop(namespaces, delete=False)
        for digest, row in rows.items():
            txn.put(digest, msgpack.packb(row), db=namespaces)


_FALLBACKS = {
    "bytes_used": "recounted from the records",
    "pages": "recounted from the records",
    "access_seq": "continued after the eviction order's last rank",
    "clock": "restarted at the eviction order's lowest rank",
}
