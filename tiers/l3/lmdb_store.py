"""L3 on this machine: pages in an LMDB environment on disk, shared by every process.

Records (``tiers.l3.record``) live in the ``pages`` database under their 16-byte page key.
Side databases: ``meta`` (format version, store-wide bytes_used and pages, access_seq,
the L3 cap ``capacity``, ``put_meta`` entries under ``user/``), ``lru`` (page key ->
8-byte big-endian rank (the last access seq under LRU) and a u32 use count), ``order``
(rank || page key -> b"", next victim first, the records no stored record follows),
``chain`` (which record follows which: ``tiers.l3.lmdb_chain``), ``counters``, ``namespaces`` (namespace
digest -> its pages, bytes, tokens, last use and what the process that wrote it said
about it).

Laid out one job per module: opening and recovery (``lmdb_open``), the write
transaction over the page tables (``lmdb_txn``) and the meta numbers it reads
(``lmdb_meta``), the side tables (``lmdb_tables``), clear / resize / compact
(``lmdb_admin``), the store's lock (``lmdb_lock``); this module is the data path that
ties them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np

from ..policy import L3_ORDERS
from ..text import format_bytes
from . import lmdb_space
from .base import L3Store, ReadThrough, Snapshot, StoreError
from .cipher import RecordCipher
from .lmdb_admin import clear_pages, resize_store
from .lmdb_lock import EnvUsers, StoreLock, remove_partial_copies
from .lmdb_open import open_readonly, open_writable, read_only_store, writable_directory
from .lmdb_space import DEFAULT_CAPACITY
from .lmdb_tables import LmdbTables
from .lmdb_txn import Census, Outcome, record_fingerprint
from .writer import Batch

log = logging.getLogger(__name__)

_MIB = 1 << 20
_REOPEN_WAIT_S = 10.0  # a reopen waits this long for caller threads to leave the old environment
_PAGE_ALIGN = 4096  # a copy read ahead keeps its record's offset modulo this (see _LmdbSnapshot._owned)
_VALUE_AT = 16  # LMDB keeps a value larger than a page on overflow pages, past their 16-byte header


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
            self.store.failures.report("read", exc)
            return None

    copies = True

    def _owned(self, value: memoryview | bytes, upto: int | None = None) -> memoryview:
        """A copy of a record read ahead, made on the reader thread (``tiers.l3_reads``).

        Why: a value LMDB hands out is a view of its memory map, and finding it touched
        only its first page; the rest is read from disk when first touched. Kept as a
        view, the restore's join on the step loop would fault on the disk, and a hung
        disk would hang the step loop there, past any deadline. The copy touches every
        byte here instead (numpy copies without holding the GIL, so a hung disk stalls
        this reader alone), and the restore reads only host memory. It lands at the
        view's offset modulo 4 KiB, where the map put it (records start where L2 slots
        do: ``tiers.join``). With ``upto`` only the first ``upto`` bytes are copied (and
        touched); the rest of the copy's memory is left untouched until ``complete``."""
        src = np.frombuffer(value, np.uint8)
        at = src.ctypes.data % _PAGE_ALIGN
        room = np.empty(len(src) + _PAGE_ALIGN, np.uint8)
        start = (at - room.ctypes.data) % _PAGE_ALIGN
        held = room[start : start + len(src)]
        np.copyto(held[:upto], src[:upto])
        return held.data


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
      the lowest frequency-with-aging rank) among the records no stored record follows
      (leaf-first: a page written with its ``parent`` keeps it; ``tiers.l3.lmdb_chain``);
      a get counts as a use.
    - put never waits for the disk: a full queue drops the write and counts it.
    - LMDB errors (MapFullError included) never reach a caller after open.
    - another format version, an unwritable directory or a damaged environment raise
      StoreError on open, with one line.
    - several processes may use one store at once; pages survive close and reopen.
    - ``readonly=True`` never writes a byte of the store (it may be a read-only
      directory); it reads pages, meta and counters, and puts nothing. A store this
      process cannot write is opened so (one warning) even when asked to write: pages
      are restored from it, every put is dropped and counted, side tables unchanged.

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
        cipher: RecordCipher | None = None,
    ) -> None:
        if not readonly and read_only_store(Path(path)):
            log.warning(
                "store %s is read-only to this process: restoring pages from it, every write dropped (counted)", path
            )
            readonly = True
        super().__init__(
            DEFAULT_CAPACITY if capacity_bytes is None else capacity_bytes,  # until meta says
            codec=codec,
            zstd_level=zstd_level,
            queue_pages=queue_pages,
            readonly=readonly,
            cipher=cipher,
        )
        if policy not in L3_ORDERS:
            raise ValueError(f"unknown L3 eviction order {policy!r}; expected one of {', '.join(L3_ORDERS)}")
        self.path = Path(path)
        self._record_bytes = record_bytes  # what a record counts against the cap; None: its size
        self._options = (map_size, capacity_bytes, policy, record_bytes)  # to reopen a replaced store
        self._users = EnvUsers()
        self._told: set[str] = set()  # warnings about the disk already given
        self._disk_cap: int | None = None  # what the disk holds, while it is nearly full (_fit_disk)
        self._disk_file = 0  # data.mdb's size when the last commit found the disk nearly full
        if readonly and not (self.path / "data.mdb").is_file():
            raise StoreError(f"no kvtier store at {self.path}")
        if not readonly:
            writable_directory(self.path)
        self._held = StoreLock.shared(self.path)  # until close: no compaction meanwhile
        try:
            remove_partial_copies(self.path)
            self._open()
        except BaseException:
            self._release()
            raise
        self._start()

    def _open(self) -> None:
        map_size, asked, policy, record_bytes = self._options
        if self.readonly:
            self._tables = open_readonly(self.path, policy, record_bytes)
        else:
            self._tables, self._capacity = open_writable(self.path, map_size, asked, policy, record_bytes)
        self._env = self._tables.env
        self._inode = self._data_inode()
        self.tables = LmdbTables(self.path, self._tables, self.failures.report, readonly=self.readonly)

    def _data_inode(self) -> int | None:
        try:
            return (self.path / "data.mdb").stat().st_ino
        except OSError:
            return None

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()

    backend = "lmdb"

    @property
    def location(self) -> str:
        return str(self.path)

    # --- caller threads ----------------------------------------------------------------

    def read_through(self, keys: Sequence[bytes]) -> ReadThrough:
        """Hash every byte of these records through the map, copying nothing: the
        floor under ``get`` (benchmarks compare against it)."""
        with self._users.using(), self._env.begin(db=self._tables.dbs.pages, buffers=True) as txn:
            return ReadThrough.of([v for v in map(txn.get, keys) if v is not None])

    def _exists(self, key: bytes) -> bool:
        try:
            with self._users.using(), self._env.begin(db=self._tables.dbs.pages, buffers=True) as txn:
                return txn.get(key) is not None
        except lmdb.Error as exc:  # closed, or another process grew the map
            self.failures.report("lookup", exc)
            return False

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """One read transaction for a batch of page lookups: payload views it hands out
        point into the map and stay valid, unchanged by any writer, until it ends."""
        with self._users.using():
            try:
                txn = self._env.begin(db=self._tables.dbs.pages, buffers=True)
            except lmdb.Error as exc:  # closed, or another process grew the map
                self.failures.report("read", exc)
                txn = None
            try:
                yield _LmdbSnapshot(self, txn)
            finally:
                if txn is not None:
                    txn.abort()

    def _fingerprint(self, value: memoryview | bytes) -> int:
        return record_fingerprint(value)

    def _never_fits(self, raw_nbytes: int) -> bool:
        return self._codec == "raw" and (self._record_bytes or raw_nbytes) > self._capacity

    def _close_backend(self) -> None:
        self._env.close()
        self._release()

    def refresh(self) -> None:
        """Reload the store-wide gauges (every process changes them)."""
        try:
            with self._users.using(), self._env.begin() as txn:
                state = self._tables.load_state(txn)
        except lmdb.Error as exc:
            self.failures.report("meta read", exc)
            return
        with self._lock:
            self._capacity = state.capacity
            self.counters = replace(
                self.counters, capacity=state.capacity, bytes_used=state.bytes_used, pages=state.pages
            )

    def census(self) -> Census:
        """The page tables as they are now, read in one transaction (a read-only view for
        consistency checks: tests, diagnostics)."""
        return self._tables.census()

    @property
    def file_bytes(self) -> int:
        """Size of ``data.mdb`` on disk: LMDB reuses freed pages but never shrinks the
        file, so after churn it can exceed the cap (``compact_store`` shrinks it)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    # --- store management (caller threads; each one write transaction) ------------------

    def clear(self, namespaces: set[bytes] | None = None) -> tuple[int, int]:
        """Delete every page (or those of ``namespaces``); (pages, bytes) removed."""
        self.flush()
        removed = clear_pages(self._tables, namespaces)
        self.refresh()
        return removed

    def resize(self, capacity: int) -> int:
        """Set the store's cap and evict down to it; how many pages were evicted (added to
        the store's L3 evictions: no process's own counters saw them)."""
        self.flush()
        evicted = resize_store(self._tables, capacity)
        self.tables.add_persistent_counters({"tiers": {"L3": {"evictions": evicted}}})
        self.refresh()
        return evicted

    # --- writer thread -----------------------------------------------------------------

    def _commit(self, batch: Batch) -> None:
        if self._data_inode() != self._inode:
            self._reopen()
        records = [(p.key, self.encoded(p, _VALUE_AT)) for p in batch.puts]  # encode outside the txn
        evicted = self._fit_disk(records)
        try:
            outcome = self._tables.write(batch, records)
        except lmdb.MapFullError:
            log.warning("L3 map full; evicting and retrying")
            outcome = self._evict_and_retry(batch, records)
        except lmdb.Error:
            if not self._disk_full(records):
                raise
            outcome = self._evict_and_retry(batch, records)
        outcome.evictions += evicted
        self.count(**vars(outcome))
        self.refresh()

    def _fit_disk(self, records: list[tuple[bytes, bytes]]) -> int:
        """Evict before a commit the filesystem may have no room for (a cap can be more
        than the disk holds, and other files fill it too); how many pages went.

        Once the file has no room to grow by twice the batch, the store is held at the
        bytes it has (the disk's cap, below the store's) and every write first evicts
        as much as it brings, so it lands in pages the file already has; when the file
        grows into the reserve all the same (LMDB needs contiguous free pages for a
        large record), that cap shrinks by an eighth; a disk that other files filled
        does not shrink it (LMDB never gives the disk back). It lifts when the disk has
        room again."""
        incoming = sum(self._tables.size(value) for _, value in records)
        room = lmdb_space.room(self.path)
        if not records or room >= 2 * incoming + _MIB:
            self._disk_cap = None
            return 0
        grown, self._disk_file = self.file_bytes > self._disk_file, self.file_bytes
        cap = self.counters.bytes_used if self._disk_cap is None else self._disk_cap
        if self._disk_cap is not None and room < 0 and grown:  # evicting frees pages in the file, not the disk
            cap -= cap // 8
        self._disk_cap = cap
        self._tell(
            "bound",
            "store %s: its filesystem is nearly full; holding L3 at %s (below its cap of %s) "
            "and evicting as much as each write brings",
            format_bytes(cap),
            format_bytes(self._capacity),
        )
        return self._tables.evict_alone(lambda _: cap - incoming)

    def _disk_full(self, records: list[tuple[bytes, bytes]]) -> bool:
        """Whether a failed commit ran out of disk (LMDB reports ENOSPC as an I/O error);
        if so, one warning naming the store."""
        if lmdb_space.usage(self.path).free >= 2 * sum(len(v) for _, v in records) + _MIB:
            return False
        self._tell("full", "store %s: its filesystem is full (ENOSPC); evicting and retrying")
        return True

    def _tell(self, kind: str, message: str, *args: object) -> None:
        """A warning about the store's disk, once per kind in this process's tier."""
        if kind not in self._told:
            self._told.add(kind)
            log.warning(message, self.path, *args)

    def _evict_and_retry(self, batch: Batch, records: list[tuple[bytes, bytes]]) -> Outcome:
        """Evict twice what the batch needs, in a txn of its own (LMDB reuses freed pages
        only in later txns), and retry once; the batch is dropped (counted) if that fails."""
        need = 2 * sum(len(v) for _, v in records) + _MIB
        try:
            evicted = self._tables.evict_alone(lambda state: state.bytes_used - need)
            outcome = self._tables.write(batch, records)
            outcome.evictions += evicted
            return outcome
        except lmdb.Error as exc:
            self.failures.report("write", exc, f" (after evicting; {len(records)} pages dropped)")
            return Outcome(writes_dropped=len(records))

    def _reopen(self) -> None:
        """``data.mdb`` is no longer the file open here (a process that bypassed the
        store's lock replaced it): close this environment once no caller thread is
        inside it and open the new file, so the write goes where every later opener
        looks. Raises (the batch is dropped, counted) when readers stay inside."""
        log.warning("store %s was replaced by another process; reopening it before writing", self.path)
        with self._users.alone(_REOPEN_WAIT_S) as alone:
            if not alone:
                raise StoreError(f"store {self.path} was replaced; readers kept the old one open")
            self._env.close()
            self._open()
