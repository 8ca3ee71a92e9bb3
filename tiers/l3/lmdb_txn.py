"""The page tables of an LMDB store inside one write transaction: insert, evict, remove,
stamp a use, and the meta numbers and namespace counts that change with them.

Records live in ``pages``; ``lru`` maps a page key to its 8-byte big-endian rank and a
u32 use count, ``order`` holds rank || page key -> b"" (next victim first) for the
records no stored record follows (leaf-first: ``tiers.l3.lmdb_chain``, whose ``chain``
table keeps which record follows which). Everything a transaction changes (records,
lru/order/chain, meta bytes_used/pages/access_seq/clock, namespace counts) is written
in that same transaction, so the tables always agree.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb
import msgpack
from xxhash import xxh3_64_intdigest

from .lmdb_chain import Chain
from .lmdb_meta import STATE_FIELDS, MetaTables, StoreState, ns_row
from .record import RecordHeader, fingerprinted, header_or_none
from .tables import DamageLog, is_namespace_row, unpacked
from .writer import Batch

if TYPE_CHECKING:
    # py-lmdb's stub names the handle ``open_db`` returns only privately; at run time it
    # is ``lmdb._Database`` too, but nothing here needs it outside annotations.
    from lmdb import _Database as Database

_LEN, _SEQ = struct.Struct("<I"), struct.Struct(">Q")


def record_fingerprint(value: memoryview | bytes) -> int:
    """An LMDB record's fingerprint (``L3Store._fingerprint``): xxh3_64 of its
    ``record.fingerprinted`` part, the same at a reject and at the delete it queues."""
    return xxh3_64_intdigest(fingerprinted(value))


@dataclass
class Outcome:
    """Counter deltas of one write transaction, applied once it commits."""

    inserts: int = 0
    evictions: int = 0
    writes_dropped: int = 0


def _uses(stamp: memoryview | bytes) -> int:
    """Use count of an ``lru`` entry (entries written before counts were kept: 1)."""
    return _LEN.unpack_from(stamp, _SEQ.size)[0] if len(stamp) >= _SEQ.size + _LEN.size else 1


@dataclass
class Databases:
    """The handles of an open store's databases (``namespaces`` None: see LmdbTables)."""

    meta: Database
    pages: Database
    lru: Database
    order: Database
    counters: Database
    namespaces: Database | None
    chain: Database | None = None  # None: a read-only store no writer has opened since it came


@dataclass(frozen=True)
class Census:
    """What the page tables hold at one moment, read in one transaction: a read-only view
    for consistency checks (meta must match the records; lru and order must name them)."""

    sizes: dict[bytes, int]  # record key -> stored value length
    lru: frozenset[bytes]  # keys with an lru entry
    order: tuple[bytes, ...]  # keys in eviction order, next victim first (those no record follows)
    followed: frozenset[bytes]  # stored keys that a stored record follows (out of ``order`` until it goes)
    bytes_used: int  # meta
    pages: int  # meta


class PageTables:
    """The write-transaction operations on one store's page tables.

    ``policy`` orders eviction (``lru``, or ``cost``: see ``stamp``); ``record_bytes``,
    when set, is what every record counts against the cap (a trace replay's tiny
    payloads stand for full pages), else its stored size.
    """

    def __init__(
        self, env: lmdb.Environment, dbs: Databases, policy: str, record_bytes: int | None, default_capacity: int
    ) -> None:
        self.env, self.dbs = env, dbs
        self._policy, self._record_bytes = policy, record_bytes
        self.damage = DamageLog(env.path())  # damaged side values, each told once
        self.meta = MetaTables(dbs.meta, dbs.pages, dbs.order, self.size, policy, default_capacity, self.damage)
        self.chain = Chain(dbs.chain)

    def size(self, value: memoryview | bytes) -> int:
        """Bytes a record counts against the cap (and in bytes_used)."""
        return self._record_bytes or len(value)

    def census(self) -> Census:
        with self.env.begin(buffers=True) as txn:
            state = self.load_state(txn)
            return Census(
                {bytes(k): len(v) for k, v in txn.cursor(db=self.dbs.pages)},
                frozenset(bytes(k) for k, _ in txn.cursor(db=self.dbs.lru)),
                tuple(bytes(k)[_SEQ.size :] for k, _ in txn.cursor(db=self.dbs.order)),
                frozenset(bytes(k) for k, _ in txn.cursor(db=self.dbs.pages) if self.chain.followers(txn, bytes(k))),
                state.bytes_used,
                state.pages,
            )

    def load_state(self, txn: lmdb.Transaction) -> StoreState:
        """The meta numbers (a damaged one: its fallback, ``tiers.l3.lmdb_meta``)."""
        return self.meta.load_state(txn)

    def save_state(self, txn: lmdb.Transaction, state: StoreState) -> None:
        for name in STATE_FIELDS:
            txn.put(name.encode(), msgpack.packb(getattr(state, name)), db=self.dbs.meta)
        self.save_namespaces(txn, state)

    def save_namespaces(self, txn: lmdb.Transaction, state: StoreState) -> None:
        """Add the transaction's per-namespace changes into the namespaces table (a
        damaged row: the table is rebuilt from the records, this transaction's included)."""
        now = time.time()
        for digest in state.namespaces.keys() | state.used:
            readable, row = unpacked(txn.get(digest, db=self.dbs.namespaces))
            if not readable or not (row is None or is_namespace_row(row)):
                self.damage.report("namespaces table", "rebuilt from the records")
                self.meta.rebuild_namespaces(txn, self.dbs.namespaces)
                state.namespaces.clear()  # counted by the rebuild: what is left is last_use
                self.save_namespaces(txn, state)
                return
            row = row or ns_row()
            for name, n in zip(("pages", "bytes", "tokens"), state.namespaces.get(digest, (0, 0, 0))):
                row[name] += n
            if digest in state.used:
                row["last_use"] = now
            txn.put(digest, msgpack.packb(row), db=self.dbs.namespaces)

    def count_namespaces(self, txn: lmdb.Transaction) -> None:
        """Fill the namespaces table from the records (a store from before it existed)."""
        self.meta.rebuild_namespaces(txn, self.dbs.namespaces)

    def write(self, batch: Batch, records: list[tuple[bytes, bytes]]) -> Outcome:
        """Commit a batch in one transaction: deletes (if unchanged), uses, then writes."""
        outcome = Outcome()
        with self.env.begin(write=True, buffers=True) as txn:  # buffers: no copy of values
            state = self.load_state(txn)
            for key, fingerprint in batch.deletes.items():
                stored = txn.get(key, db=self.dbs.pages)
                if stored is not None and record_fingerprint(stored) == fingerprint:
                    self.remove(txn, state, key, stored)  # unless rewritten meanwhile
            for key in batch.touches:
                if (stamp := txn.get(key, db=self.dbs.lru)) is not None:
                    txn.delete(bytes(stamp)[: _SEQ.size] + key, db=self.dbs.order)
                    self.stamp(txn, state, key, _uses(stamp) + 1)
                    if (header := header_or_none(txn.get(key, db=self.dbs.pages) or b"")) is not None:
                        state.used.add(header.namespace)
            for (key, value), put in zip(records, batch.puts):
                self._insert(txn, state, key, value, put.parent, outcome)
            self.save_state(txn, state)
        return outcome

    def _insert(
        self,
        txn: lmdb.Transaction,
        state: StoreState,
        key: bytes,
        value: bytes,
        parent: bytes | None,
        outcome: Outcome,
    ) -> None:
        if txn.get(key, db=self.dbs.pages) is not None:
            return  # write-once (another process may have written it since put)
        if self.size(value) > state.capacity:  # larger than the whole tier: evict nothing for it
            outcome.writes_dropped += 1
            return
        outcome.evictions += self.evict(txn, state, state.capacity - self.size(value), spare=parent)
        txn.put(key, value, db=self.dbs.pages)
        self.stamp(txn, state, key)
        if parent is not None and self.chain.link(txn, key, parent):
            self._hold(txn, parent)
        header = RecordHeader.unpack(value)[0]  # encoded by the writer just now
        state.tally(header.namespace, 1, self.size(value), header.token_count)
        state.used.add(header.namespace)
        outcome.inserts += 1

    def evict(self, txn: lmdb.Transaction, state: StoreState, limit: int, spare: bytes | None = None) -> int:
        """Remove records, next victim first, until bytes_used <= limit; how many went.
        ``spare``: the parent of the record being written, which counts as followed (a
        page never pushes out the page before it), unless nothing else can go."""
        evicted = 0
        while state.bytes_used > limit and (key := self._victim(txn, state, spare)) is not None:
            value = txn.get(key, db=self.dbs.pages)
            self.remove(txn, state, key, value)
            evicted += value is not None
        return evicted

    def _victim(self, txn: lmdb.Transaction, state: StoreState, spare: bytes | None) -> bytes | None:
        """The next record to evict, its ``order`` entry taken (None: the store is empty).
        Should ``order`` be empty while records remain (a follower removed by a kvtier
        that kept no chain table), any record goes: the cap is a hard limit."""
        with txn.cursor(db=self.dbs.order) as cursor:
            if not cursor.first():
                with txn.cursor(db=self.dbs.pages) as records:
                    return bytes(records.key()) if records.first() else None
            if bytes(cursor.key())[_SEQ.size :] == spare:
                if not cursor.next():  # the page before the one arriving goes last
                    cursor.first()
            key = bytes(cursor.key())[_SEQ.size :]
            if self._policy == "cost":
                state.clock = _SEQ.unpack_from(cursor.key())[0] >> 32
            cursor.delete()  # always progress, even past an entry lru no longer names
            return key

    def evict_alone(self, limit: Callable[[StoreState], int], capacity: int | None = None) -> int:
        """Evict in a transaction of its own down to ``limit(state)`` bytes (and set the
        store's cap to ``capacity`` when given); how many records went. LMDB reuses the
        pages this frees only in later transactions."""
        with self.env.begin(write=True, buffers=True) as txn:
            state = self.load_state(txn)
            if capacity is not None:
                state.capacity = capacity
            evicted = self.evict(txn, state, limit(state))
            self.save_state(txn, state)
        return evicted

    def remove(self, txn: lmdb.Transaction, state: StoreState, key: bytes, value: memoryview | bytes | None) -> None:
        """Delete a record and its lru/order entries (value None: the record is gone)."""
        if value is not None:
            header = header_or_none(value)
            namespace, tokens = (None, 0) if header is None else (header.namespace, header.token_count)
            state.tally(namespace, -1, -self.size(value), -tokens)
            txn.delete(key, db=self.dbs.pages)
        if (stamp := txn.get(key, db=self.dbs.lru)) is not None:
            txn.delete(bytes(stamp)[: _SEQ.size] + key, db=self.dbs.order)
            txn.delete(key, db=self.dbs.lru)
        parent = self.chain.unlink(txn, key)
        if parent is not None and (stamp := txn.get(parent, db=self.dbs.lru)) is not None:
            txn.put(bytes(stamp)[: _SEQ.size] + parent, b"", db=self.dbs.order)  # its last follower went

    def _hold(self, txn: lmdb.Transaction, key: bytes) -> None:
        """A stored record followed now leaves the eviction order (its rank stays in lru)."""
        if (stamp := txn.get(key, db=self.dbs.lru)) is not None:
            txn.delete(bytes(stamp)[: _SEQ.size] + key, db=self.dbs.order)

    def stamp(self, txn: lmdb.Transaction, state: StoreState, key: bytes, uses: int = 1) -> None:
        """Place a page in the eviction order (``order`` is read first to last): by
        access sequence (``lru``), or (``cost``) by GreedyDual-Frequency rank
        ``clock + uses`` in the high 32 bits, the access sequence below it, so equal
        ranks leave oldest first. Every L3 page costs the same to recompute, so this
        is frequency with aging. ``lru`` holds the rank and the use count; ``order`` the
        rank only while no stored record follows the page (leaf-first)."""
        state.access_seq += 1
        rank = (
            state.access_seq if self._policy == "lru" else (state.clock + uses) << 32 | (state.access_seq & 0xFFFFFFFF)
        )
        seq = _SEQ.pack(rank)
        txn.put(key, seq + _LEN.pack(uses), db=self.dbs.lru)
        if not self.chain.followers(txn, key):
            txn.put(seq + key, b"", db=self.dbs.order)
