"""L3 on this machine: pages in an LMDB environment on disk, shared by every process.

Records (``tiers.l3.record``) live in the ``pages`` database under their 16-byte page key.
Side databases: ``meta`` (format version, store-wide bytes_used and pages, access_seq,
the L3 cap ``capacity``, ``put_meta`` entries under ``user/``), ``lru`` (page key ->
8-byte big-endian rank (the last access seq under LRU) and a u32 use count), ``order``
(rank || page key -> b"", next victim first), ``counters``, ``namespaces`` (namespace
digest -> its pages, bytes, tokens, last use and what the process that wrote it said
about it).

The cap belongs to the store, not to a process: the first opener sets it, later
openers keep it (a different request is logged and ignored) and ``resize`` changes it,
so one process with a small cap never evicts everyone else's pages.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import msgpack
from xxhash import xxh3_64_intdigest

from ..counters import add_into
from ..policy import POLICIES
from ..text import format_bytes, one_line
from .base import Batch, L3Store, Snapshot, StoreError
from .record import FORMAT_VERSION, RecordHeader, encode_record, header_or_none

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 32 << 30  # the cap of a new store when none is asked for
_LEN, _SEQ = struct.Struct("<I"), struct.Struct(">Q")
_MIB = 1 << 20
_VALUE_AT = 16  # LMDB keeps a value larger than a page on overflow pages, past their 16-byte header
_MIN_MAP = 16 << 30  # address space only: the file grows with the data, not with the map
_DBS = (b"pages", b"lru", b"order", b"counters", b"namespaces")


class _LmdbSnapshot(Snapshot):
    """Lookups inside one LMDB read transaction: values are views into the map."""

    def __init__(self, disk: DiskTier, txn: lmdb.Transaction[memoryview] | None) -> None:  # buffers=True
        super().__init__(disk)
        self.txn = txn

    def _value(self, key: bytes) -> memoryview | None:
        if self.txn is None:
            return None
        try:
            return self.txn.get(key)
        except lmdb.Error as exc:
            self.store._failed("read", exc)
            return None


_STATE_FIELDS = ("bytes_used", "pages", "access_seq", "capacity", "clock")


@dataclass
class _StoreState:
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


@dataclass
class _Outcome:
    """Counter deltas of one write transaction, applied once it commits."""

    inserts: int = 0
    evictions: int = 0
    writes_dropped: int = 0


def _uses(stamp: memoryview | bytes) -> int:
    """Use count of an ``lru`` entry (entries written before counts were kept: 1)."""
    return _LEN.unpack_from(stamp, _SEQ.size)[0] if len(stamp) >= _SEQ.size + _LEN.size else 1


def check_format_version(path: Path, stored: bytes | None) -> None:
    version = FORMAT_VERSION if stored is None else msgpack.unpackb(stored)
    if version != FORMAT_VERSION:
        raise StoreError(f"store at {path} has format version {version}, this kvtier reads version {FORMAT_VERSION}")


def _ns_row() -> dict:
    return {"pages": 0, "bytes": 0, "tokens": 0, "last_use": 0.0, "about": {}}


def _describe(row: dict) -> str:
    about = row.get("about") or {}
    return f"model {about.get('model', '?')}, page size {about.get('page_size', '?')}"


class DiskTier(L3Store):
    """L3: an LMDB store of immutable pages, capped in bytes, evicted least-recently-used.

    Invariants (each tested in tests/tiers/test_disk.py):
    - get returns the exact raw bytes that were put, or None; never a page whose write
      did not commit, never a record failing its header or checksum check (that one
      is deleted and counted in checksum_failures). Bad data never raises.
    - write-once: a key already stored is never written again.
    - stored record bytes (sum of value lengths, store-wide; or ``record_bytes`` per
      record, for a trace replay's tiny payloads) never exceed the store's cap; meta
      bytes_used/pages, the namespaces table, lru and order change in the same
      transaction as the records.
    - eviction takes the least-recently-used record first (or, with ``policy="cost"``,
      the lowest frequency-with-aging rank); a get counts as a use.
    - put never waits for the disk: a full queue drops the write and counts it.
    - LMDB errors (MapFullError included) never reach a caller after open.
    - another format version, an unwritable directory or a damaged environment raise
      StoreError on open, with one line.
    - several processes may use one store at once; pages survive close and reopen.
    - ``readonly=True`` never writes a byte of the store (it may be a read-only
      directory); it reads pages, meta and counters, and puts nothing.

    Counted here: lookups, hit_pages, hit_tokens (by get), inserts, evictions,
    checksum_failures, writes_dropped. bytes_used, pages and capacity are store-wide
    gauges, reloaded from meta after each commit and by refresh().
    """

    def __init__(
        self,
        path: Path,
        capacity_bytes: int | None = None,
        *,
        codec: str = "raw",
        zstd_level: int = 3,
        queue_pages: int = 64,
        map_size: int | None = None,
        readonly: bool = False,
        record_bytes: int | None = None,
        policy: str = "lru",
    ) -> None:
        super().__init__(
            DEFAULT_CAPACITY if capacity_bytes is None else capacity_bytes,  # until meta says
            codec=codec,
            zstd_level=zstd_level,
            queue_pages=queue_pages,
            readonly=readonly,
        )
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.path = Path(path)
        self._record_bytes = record_bytes  # what a record counts against the cap; None: its size
        self._policy = policy  # eviction order: "lru", or "cost" (see _stamp)
        self._env = self._open_readonly() if readonly else self._open_env(map_size, capacity_bytes)
        self._start()

    backend = "lmdb"

    @property
    def location(self) -> str:
        return str(self.path)

    def _open_env(self, map_size: int | None, capacity: int | None) -> lmdb.Environment:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.path}: {exc.strerror or exc}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {self.path} is not writable")
        if map_size is None:
            # Generous: if another process later grows the data past this map, every txn
            # here fails with MapResizedError (a miss or a dropped write, logged once). No
            # larger than the filesystem: a cap beyond it cannot be reached, nor mapped.
            data = self.path / "data.mdb"
            existing = data.stat().st_size if data.exists() else 0
            wanted = min(2 * self._capacity + 64 * _MIB, shutil.disk_usage(self.path).total)
            map_size = max(wanted, 2 * existing, _MIN_MAP)
        try:
            # sync=True: every commit is durable and a crash never leaves a damaged B-tree;
            # commits are batched on the writer thread, off the request path. readahead
            # stays on: a large value is one contiguous run of pages.
            env = lmdb.open(str(self.path), map_size=map_size, max_dbs=8, subdir=True, lock=True)
        except lmdb.Error as exc:
            raise StoreError(f"cannot open store at {self.path}: {one_line(exc)}") from None
        try:
            self._check_file_size(env)
            env.reader_check()  # free reader slots of killed processes (they pin old pages)
            self._open_dbs(env, capacity)
        except BaseException:
            env.close()
            raise
        return env

    def _open_readonly(self) -> lmdb.Environment:
        """The existing store, opened without writing to it (nor creating it)."""
        if not (self.path / "data.mdb").is_file():
            raise StoreError(f"no kvtier store at {self.path}")
        env = None
        for lock in (True, False):  # without locks only where the lock file cannot be written
            try:
                env = lmdb.open(str(self.path), readonly=True, max_dbs=8, subdir=True, lock=lock, create=False)
                break
            except lmdb.Error as exc:
                error = exc
        if env is None:
            raise StoreError(f"cannot open store at {self.path}: {one_line(error)}")
        try:
            self._check_file_size(env)
            # Without a txn: py-lmdb keeps the handles of a read-only env only when it opens them itself
            self._meta = env.open_db(b"meta", create=False)
            with env.begin(db=self._meta) as txn:
                check_format_version(self.path, txn.get(b"format_version"))
            self._pages, self._lru, self._order, self._counters_db = (
                env.open_db(name, create=False) for name in _DBS[:4]
            )
            try:
                self._namespaces = env.open_db(b"namespaces", create=False)
            except lmdb.NotFoundError:  # a store no writer has opened since the table came
                self._namespaces = None
        except lmdb.Error as exc:  # NotFoundError: a database missing
            env.close()
            raise StoreError(f"cannot read store at {self.path}: {one_line(exc)}") from None
        except BaseException:
            env.close()
            raise
        return env

    def _check_file_size(self, env: lmdb.Environment) -> None:
        """Refuse a data file shorter than its meta page says.

        LMDB checks only the meta pages on open and then reads the file through its
        memory map: a page past the end of a truncated file kills the process with
        SIGBUS at the first read. LMDB writes a commit's pages before its meta and never
        shrinks the file, so a sound file always covers ``last_pgno``.
        """
        data = self.path / "data.mdb"
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # both read the meta only
        have = data.stat().st_size
        if have < need:
            raise StoreError(f"store file {data} is truncated ({have} bytes, its meta needs {need})")

    def _open_dbs(self, env: lmdb.Environment, capacity: int | None) -> None:
        """Check the format version, create the databases, settle the cap (one transaction)."""
        try:
            with env.begin(write=True) as txn:
                self._meta = env.open_db(b"meta", txn=txn)
                check_format_version(self.path, txn.get(b"format_version", db=self._meta))
                txn.put(b"format_version", msgpack.packb(FORMAT_VERSION), db=self._meta)
                fresh = b"namespaces" not in {bytes(k) for k, _ in txn.cursor()}
                self._pages, self._lru, self._order, self._counters_db, self._namespaces = (
                    env.open_db(name, txn=txn) for name in _DBS
                )
                if fresh:
                    self._count_namespaces(txn)
                self._settle_capacity(txn, capacity)
        except (lmdb.Error, ValueError) as exc:  # ValueError: msgpack, on a damaged version
            raise StoreError(f"cannot open store at {self.path}: {one_line(exc)}") from None

    def _settle_capacity(self, txn: lmdb.Transaction, asked: int | None) -> None:
        """The store's cap wins; a store without one takes the cap asked for."""
        stored = txn.get(b"capacity", db=self._meta)
        if stored is None:
            txn.put(b"capacity", msgpack.packb(self._capacity), db=self._meta)
            return
        self._capacity = msgpack.unpackb(stored)
        if asked is not None and asked != self._capacity:
            log.warning(
                "store %s keeps its L3 cap of %s; the %s asked for is ignored "
                "(`kvtier store resize --l3-bytes` changes it)",
                self.path,
                format_bytes(self._capacity),
                format_bytes(asked),
            )

    def _count_namespaces(self, txn: lmdb.Transaction) -> None:
        """Fill the namespaces table from the records (a store from before it existed)."""
        state = _StoreState()
        for _, value in txn.cursor(db=self._pages):
            if (header := header_or_none(value)) is not None:
                state.tally(header.namespace, 1, self._size(value), len(header.tokens) // 4)
        self._save_namespaces(txn, state)

    # --- caller threads ----------------------------------------------------------------

    def read_through(self, keys: Sequence[bytes]) -> int:
        """Hash every byte of these records through the map, copying nothing: the
        floor under ``get`` (benchmarks compare against it). Returns bytes read."""
        total = 0
        with self._env.begin(db=self._pages, buffers=True) as txn:
            for key in keys:
                value = txn.get(key)
                if value is not None:
                    xxh3_64_intdigest(value)
                    total += len(value)
        return total

    def _exists(self, key: bytes) -> bool:
        try:
            with self._env.begin(db=self._pages, buffers=True) as txn:
                return txn.get(key) is not None
        except lmdb.Error as exc:  # closed, or another process grew the map
            self._failed("lookup", exc)
            return False

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """One read transaction for a batch of page lookups: payload views it hands out
        point into the map and stay valid, unchanged by any writer, until it ends."""
        try:
            txn = self._env.begin(db=self._pages, buffers=True)
        except lmdb.Error as exc:  # closed, or another process grew the map
            self._failed("read", exc)
            txn = None
        try:
            yield _LmdbSnapshot(self, txn)
        finally:
            if txn is not None:
                txn.abort()

    def _fingerprint(self, value: memoryview | bytes) -> int:
        return xxh3_64_intdigest(value)

    def _never_fits(self, raw_nbytes: int) -> bool:
        return self._codec == "raw" and (self._record_bytes or raw_nbytes) > self._capacity

    def _close_backend(self) -> None:
        self._env.close()

    def refresh(self) -> None:
        """Reload the store-wide gauges (every process changes them)."""
        try:
            with self._env.begin() as txn:
                state = self._load_state(txn)
        except lmdb.Error as exc:
            self._failed("meta read", exc)
            return
        with self._lock:
            self.counters.bytes_used, self.counters.pages = state.bytes_used, state.pages
            self._capacity = self.counters.capacity = state.capacity

    @property
    def file_bytes(self) -> int:
        """Size of ``data.mdb`` on disk: LMDB reuses freed pages but never shrinks the
        file, so after churn it can exceed the cap (``compact_store`` shrinks it)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    # --- store management (caller threads; each one write transaction) ------------------

    def namespaces(self) -> dict[bytes, dict]:
        """Per namespace digest: pages, bytes, tokens, last_use (unix time) and what its
        writer said about it (``describe_namespace``)."""
        if self._namespaces is None:
            return {}
        try:
            with self._env.begin(db=self._namespaces) as txn:
                return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}
        except Exception as exc:  # lmdb or msgpack: a damaged table reads as empty
            self._failed("namespaces read", exc)
            return {}

    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is (model, page size, ...) for ``kvtier store ls``; warn
        in one line when the store holds pages, none of them of this namespace."""

        def merge(row: object) -> dict:
            row = row if isinstance(row, dict) else _ns_row()
            return {**row, "about": about}

        self._update(self._namespaces, digest, merge)
        others = {d: row for d, row in self.namespaces().items() if d != digest and row["pages"]}
        if others and not self.namespaces().get(digest, {}).get("pages"):
            seen = sorted({_describe(row) for row in others.values()})
            log.warning(
                "store %s holds no pages for this model and page size (%s), only %d of "
                "other namespaces (%s): nothing here will be reused",
                self.path,
                _describe({"about": about}),
                sum(r["pages"] for r in others.values()),
                "; ".join(seen),
            )

    def clear(self, namespaces: set[bytes] | None = None) -> tuple[int, int]:
        """Delete every page (or those of ``namespaces``); (pages, bytes) removed."""
        self.flush()
        with self._env.begin(write=True, buffers=True) as txn:
            state = self._load_state(txn)
            doomed = []
            for key, value in txn.cursor(db=self._pages):
                header = header_or_none(value)
                if namespaces is None or (header is not None and header.namespace in namespaces):
                    doomed.append(bytes(key))
            before = (state.pages, state.bytes_used)
            for key in doomed:
                self._remove(txn, state, key, txn.get(key, db=self._pages))
            self._save_state(txn, state)
        self.refresh()
        return before[0] - state.pages, before[1] - state.bytes_used

    def resize(self, capacity: int) -> int:
        """Set the store's cap and evict down to it; how many pages were evicted."""
        self.flush()
        with self._env.begin(write=True, buffers=True) as txn:
            state = self._load_state(txn)
            state.capacity = capacity
            evicted = self._evict(txn, state, capacity)
            self._save_state(txn, state)
        self.refresh()
        return evicted

    def reset_counters(self) -> None:
        """Forget the cumulative counters (``kvtier stats --reset``)."""
        with self._env.begin(write=True, db=self._counters_db) as txn:
            txn.drop(self._counters_db, delete=False)

    # --- side tables (caller threads; LMDB serialises them with the writer) ------------

    def add_persistent_counters(self, delta: dict) -> None:
        """Add a nested dict of numbers into the stored cumulative counters."""

        def add(stored: object) -> object:
            return add_into(stored if isinstance(stored, dict) else {}, delta)

        self._update(self._counters_db, b"cumulative", add)

    def persistent_counters(self) -> dict:
        stored = self._read(self._counters_db, b"cumulative")
        return stored if isinstance(stored, dict) else {}

    def get_meta(self, name: str) -> object | None:
        return self._read(self._meta, b"user/" + name.encode())

    def put_meta(self, name: str, value: object) -> None:
        self._update(self._meta, b"user/" + name.encode(), lambda _: value)

    def _read(self, db: object, key: bytes) -> object | None:
        try:
            with self._env.begin(db=db) as txn:
                stored = txn.get(key)
            return None if stored is None else msgpack.unpackb(stored)
        except Exception as exc:  # lmdb or msgpack: a damaged side entry reads as absent
            self._failed("side-table read", exc, f" ({key!r})")
            return None

    def _update(self, db: object, key: bytes, change: Callable[[object], object]) -> None:
        try:
            with self._env.begin(write=True, db=db) as txn:
                stored = txn.get(key)
                old = None if stored is None else msgpack.unpackb(stored)
                txn.put(key, msgpack.packb(change(old)))
        except (lmdb.Error, ValueError) as exc:  # side tables are best effort
            self._failed("side-table write", exc, f" ({key!r})")

    # --- writer thread -----------------------------------------------------------------

    def _commit(self, batch: Batch) -> None:
        records = [
            (p.key, encode_record(p.namespace, p.tokens, p.payload, self._codec, self._level, _VALUE_AT))
            for p in batch.puts
        ]  # encode outside the txn
        try:
            outcome = self._write(batch, records)
        except lmdb.MapFullError:
            outcome = self._retry_map_full(batch, records)
        self.count(**vars(outcome))
        self.refresh()

    def _retry_map_full(self, batch: Batch, records: list[tuple[bytes, bytes]]) -> _Outcome:
        """Evict in a txn of its own (LMDB reuses freed pages only in later txns), retry once."""
        need = 2 * sum(len(v) for _, v in records) + _MIB
        log.warning("L3 map full; evicting %d more bytes and retrying", need)
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                state = self._load_state(txn)
                evicted = self._evict(txn, state, state.bytes_used - need)
                self._save_state(txn, state)
            outcome = self._write(batch, records)
            outcome.evictions += evicted
            return outcome
        except lmdb.MapFullError:
            log.warning("L3 map still full; dropping %d pages", len(records))
            return _Outcome(writes_dropped=len(records))

    def _write(self, batch: Batch, records: list[tuple[bytes, bytes]]) -> _Outcome:
        outcome = _Outcome()
        with self._env.begin(write=True, buffers=True) as txn:  # buffers: no copy of values
            state = self._load_state(txn)
            for key, fingerprint in batch.deletes.items():
                value = txn.get(key, db=self._pages)
                if value is not None and xxh3_64_intdigest(value) == fingerprint:
                    self._remove(txn, state, key, value)  # unless rewritten meanwhile
            for key in batch.touches:
                if (stamp := txn.get(key, db=self._lru)) is not None:
                    txn.delete(bytes(stamp)[: _SEQ.size] + key, db=self._order)
                    self._stamp(txn, state, key, _uses(stamp) + 1)
                    if (header := header_or_none(txn.get(key, db=self._pages) or b"")) is not None:
                        state.used.add(header.namespace)
            for key, value in records:
                self._insert(txn, state, key, value, outcome)
            self._save_state(txn, state)
        return outcome

    def _insert(self, txn: lmdb.Transaction, state: _StoreState, key: bytes, value: bytes, outcome: _Outcome) -> None:
        if txn.get(key, db=self._pages) is not None:
            return  # write-once (another process may have written it since put)
        if self._size(value) > state.capacity:  # larger than the whole tier: evict nothing for it
            outcome.writes_dropped += 1
            return
        outcome.evictions += self._evict(txn, state, state.capacity - self._size(value))
        txn.put(key, value, db=self._pages)
        self._stamp(txn, state, key)
        header = RecordHeader.unpack(value)[0]  # encoded by _encode just now
        state.tally(header.namespace, 1, self._size(value), len(header.tokens) // 4)
        state.used.add(header.namespace)
        outcome.inserts += 1

    def _evict(self, txn: lmdb.Transaction, state: _StoreState, limit: int) -> int:
        """Remove least-recently-used records until bytes_used <= limit; how many went."""
        evicted = 0
        while state.bytes_used > limit:
            with txn.cursor(db=self._order) as cursor:
                if not cursor.first():
                    break
                key = bytes(cursor.key())[_SEQ.size :]
                if self._policy == "cost":
                    state.clock = _SEQ.unpack_from(cursor.key())[0] >> 32
                cursor.delete()  # always progress, even past an entry lru no longer names
            value = txn.get(key, db=self._pages)
            self._remove(txn, state, key, value)
            evicted += value is not None
        return evicted

    def _remove(self, txn: lmdb.Transaction, state: _StoreState, key: bytes, value: memoryview | None) -> None:
        """Delete a record and its lru/order entries (value None: the record is gone)."""
        if value is not None:
            header = header_or_none(value)
            namespace, tokens = (None, 0) if header is None else (header.namespace, len(header.tokens) // 4)
            state.tally(namespace, -1, -self._size(value), -tokens)
            txn.delete(key, db=self._pages)
        if (stamp := txn.get(key, db=self._lru)) is not None:
            txn.delete(bytes(stamp)[: _SEQ.size] + key, db=self._order)
            txn.delete(key, db=self._lru)

    def _size(self, value: memoryview | bytes) -> int:
        """Bytes a record counts against the cap (and in bytes_used)."""
        return self._record_bytes or len(value)

    def _stamp(self, txn: lmdb.Transaction, state: _StoreState, key: bytes, uses: int = 1) -> None:
        """Place a page in the eviction order (``order`` is read first to last): by
        access sequence (``lru``), or (``cost``) by GreedyDual-Frequency rank
        ``clock + uses`` in the high 32 bits, the access sequence below it, so equal
        ranks leave oldest first. Every L3 page costs the same to recompute, so this
        is frequency with aging. ``lru`` holds the rank and the use count."""
        state.access_seq += 1
        rank = (
            state.access_seq if self._policy == "lru" else (state.clock + uses) << 32 | (state.access_seq & 0xFFFFFFFF)
        )
        seq = _SEQ.pack(rank)
        txn.put(key, seq + _LEN.pack(uses), db=self._lru)
        txn.put(seq + key, b"", db=self._order)

    def _load_state(self, txn: lmdb.Transaction) -> _StoreState:
        stored = {name: txn.get(name.encode(), db=self._meta) for name in _STATE_FIELDS}
        return _StoreState(**{name: 0 if v is None else msgpack.unpackb(bytes(v)) for name, v in stored.items()})

    def _save_state(self, txn: lmdb.Transaction, state: _StoreState) -> None:
        for name in _STATE_FIELDS:
            txn.put(name.encode(), msgpack.packb(getattr(state, name)), db=self._meta)
        self._save_namespaces(txn, state)

    def _save_namespaces(self, txn: lmdb.Transaction, state: _StoreState) -> None:
        """Add the transaction's per-namespace changes into the namespaces table."""
        now = time.time()
        for digest in state.namespaces.keys() | state.used:
            stored = txn.get(digest, db=self._namespaces)
            row = _ns_row() if stored is None else msgpack.unpackb(bytes(stored))
            for name, n in zip(("pages", "bytes", "tokens"), state.namespaces.get(digest, (0, 0, 0))):
                row[name] += n
            if digest in state.used:
                row["last_use"] = now
            txn.put(digest, msgpack.packb(row), db=self._namespaces)
