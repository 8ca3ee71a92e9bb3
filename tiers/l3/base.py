"""L3, the persistent page store shared beyond one process: the interface every backend
implements (LMDB on this machine, ``tiers.l3.lmdb_store``; Redis / Valkey for a fleet,
``tiers.l3.redis_store``). Each holds the background writer they share
(``tiers.l3.writer``). The factory that picks a backend is ``tiers.l3.open``, above both.

A backend stores records (``tiers.l3.record``) under 16-byte page keys and keeps beside
them the store's format version and its side tables (``tables``, ``tiers.l3.tables``:
``put_meta`` entries such as cost profiles, cumulative counters, a namespaces table).
The hierarchy talks to this interface only:
``contains``, ``snapshot`` (find a run of records, read once), ``check.verified`` /
``check.accept`` (serve or reject a record: ``tiers.l3.check``), ``put`` (write-once,
queued), ``flush``, ``close``.

Invariants kept here for every backend:
- a record failing its header, key, tag or checksum check is never served: it reads as a miss, is
  counted in ``checksum_failures`` and deleted unless it was rewritten meanwhile
  (delete-if-unchanged, by the fingerprint of the bad value).
- ``put`` never waits for the backend, nor asks it anything: a full queue drops the
  write and counts it; the writer thread commits queued writes, deletes and uses in
  batches, off the request path, and skips a page it finds stored (write-once).
- backend errors after open never reach a caller: a failed read is a miss, a failed write
  a dropped write, each kind logged once as a warning (``tiers.l3.failures``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from xxhash import xxh3_64_intdigest

from ..counters import TierStats
from .check import RecordCheck
from .cipher import RecordCipher
from .failures import FailureLog
from .record import CODECS, Quantize, StoredRecord, encode_record, first_segment_end, token_bytes
from .tables import SideTables
from .writer import Batch, PendingPut, Writer


class StoreError(Exception):
    """L3 cannot be used (unwritable dir, damaged env, unreachable server, other format
    version); the message is one line."""


class StoreUnreachable(StoreError):
    """L3's server did not answer (refused, timed out): it may later (``tiers.l3_join``)."""


@dataclass(frozen=True)
class ReadThrough:
    """What ``L3Store.read_through`` read: bytes, and the xxh3_64 of each record found,
    in the order of the keys asked for (so a caller can tell every byte was hashed)."""

    nbytes: int = 0
    digests: tuple[int, ...] = ()

    @classmethod
    def of(cls, values: Sequence[memoryview | bytes]) -> ReadThrough:
        return cls(sum(len(v) for v in values), tuple(xxh3_64_intdigest(v) for v in values))


class Snapshot(ABC):
    """Page lookups against one view of the store (``L3Store.snapshot``): the records it
    hands out stay valid, unchanged by any writer, until it ends."""

    def __init__(self, store: L3Store) -> None:
        self.store = store
        self.read_s = 0.0  # seconds spent reading records from the backend (a network's round trips)
        self.ahead_s = 0.0  # seconds ``read_ahead`` took (on a reader thread, before the restore)
        self._ahead: dict[bytes, memoryview | bytes] = {}
        self._only_ahead = False  # read ahead: a key it did not find is a miss, not asked again
        # values read ahead in part: key -> (the stored value, its copy, bytes copied)
        self._partial: dict[bytes, tuple[memoryview | bytes, memoryview, int]] = {}

    def read_ahead(
        self,
        keys: Sequence[bytes],
        raw_nbytes: int,
        run: bool = True,
        whole: Callable[[int], Collection[int]] | None = None,
    ) -> tuple[list[bytes], int]:
        """Read the values of ``keys`` in order, up to the first absent one (``run``), or
        each that is stored (not ``run``: a hybrid model's snapshots, any page of a
        prefix may have one), and keep them for ``find``, which then reads nothing
        (``tiers.l3_reads``: a reader thread does this before a restore); (the keys
        found, the bytes read). Counts nothing: ``find`` counts the lookups the restore
        makes.

        ``whole(n)``: of a run of ``n`` values found, the indices a restore reads whole
        (None: all). A backend that copies what it reads ahead (``copies``) reads the
        others' first segment only, the global rows of a sliding-window model's page
        (``record.first_segment_end``), since a restore of the run reads their window rows
        never; ``complete`` reads the rest of those a shorter restore does read."""
        self.expect(keys, raw_nbytes)
        values: list[tuple[bytes, memoryview | bytes]] = []
        for key in keys:
            value = None if self.store.check.doomed(key) else self._value(key)
            if value is None and run:
                break
            if value is not None:
                values.append((key, value))
        read_whole = None if whole is None or not self.copies else set(whole(len(values)))
        nbytes = 0
        for i, (key, value) in enumerate(values):
            upto = None if read_whole is None or i in read_whole else first_segment_end(value)
            held = self._ahead[key] = self._owned(value, upto)
            if upto is not None:
                self._partial[key] = (value, memoryview(held), upto)
            nbytes += len(value) if upto is None else upto
        self.read_s = 0.0  # spent here, not by the restore: see ahead_s
        self._only_ahead = True
        return [key for key, _ in values], nbytes

    def complete(self, keys: Collection[bytes]) -> None:
        """Read the rest of each of ``keys`` that ``read_ahead`` read in part (a restore
        shorter than the run read ahead reads other pages' window rows)."""
        for key in keys:
            if (part := self._partial.pop(bytes(key), None)) is not None:
                value, held, upto = part
                held[upto:] = memoryview(value)[upto:]

    copies = False  # whether ``_owned`` copies a value (then it may read one in part)

    def _owned(self, value: memoryview | bytes, upto: int | None = None) -> memoryview | bytes:
        """A value read ahead as the restore will find it: bytes this snapshot holds in
        host memory (a backend whose values are views of something slower copies them,
        and with ``upto`` only their first ``upto`` bytes)."""
        return value

    def expect(self, keys: Sequence[bytes], raw_nbytes: int) -> None:  # noqa: B027 (a no-op unless a backend batches)
        """A hint: ``find`` will be asked for these keys, in this order (a remote backend
        reads them in a few batched round trips)."""

    @abstractmethod
    def _value(self, key: bytes) -> memoryview | bytes | None:
        """The stored value of ``key``, None when absent or unreadable (logged)."""

    def find(self, key: bytes, namespace_digest: bytes, tokens: Sequence[int], raw_nbytes: int) -> StoredRecord | None:
        """The record of ``key`` if its header matches this page, else None (a record
        with a bad header is rejected). Counts the lookup."""
        self.store.count(lookups=1)
        if self.store.check.doomed(key):
            return None  # a rejected record whose delete is not committed yet: a miss
        value = self._ahead.get(key)
        if value is None and not self._only_ahead:
            value = self._value(key)
        if value is None:
            return None
        return self.store.check.found(key, value, namespace_digest, tokens, raw_nbytes)


_Store = TypeVar("_Store", bound="L3Store")  # a backend, as its own class


class L3Store(ABC):
    """One L3 backend: records, meta, counters, the writer (``self.writer``) that
    commits its queued work, and the check (``self.check``) every record read passes.

    Counted here: lookups (by snapshots), hit_pages, hit_tokens, inserts, evictions,
    checksum_failures, writes_dropped. bytes_used, pages and capacity are store-wide
    gauges, reloaded by ``refresh``.
    """

    backend = ""  # "lmdb" or "redis": what stats call this L3
    tables: SideTables  # meta entries, cumulative counters, namespaces (set by the backend)
    tracks_use = True  # the writer records each use (a backend that sees its reads does not)

    def __init__(
        self,
        capacity: int,
        *,
        codec: str,
        zstd_level: int,
        queue_pages: int,
        readonly: bool,
        cipher: RecordCipher | None = None,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown L3 codec {codec!r}; expected one of {', '.join(CODECS)}")
        self.readonly = readonly
        self._capacity = capacity
        self.counters = TierStats(capacity=capacity)  # replaced at each change, under _lock
        self._codec, self._level = codec, zstd_level
        self.cipher = cipher  # set: records are written encrypted and only encrypted ones served
        self._lock = threading.Lock()  # guards the counters
        self._closed = False
        self.failures = FailureLog()
        self.writer = Writer(self._commit, self._lost, queue_pages=queue_pages, readonly=readonly)
        self.check = RecordCheck(self.writer, self._fingerprint, self.count, tracks_use=self.tracks_use, cipher=cipher)

    def _start(self) -> None:
        """Load the gauges and start the writer (a backend calls it once open)."""
        self.refresh()
        self.writer.start()

    # --- what a backend implements ---------------------------------------------------

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the store is (a directory, or the URL without its password)."""

    @abstractmethod
    def _exists(self, key: bytes) -> bool:
        """A record of ``key`` is stored (False when the backend cannot tell, logged)."""

    @abstractmethod
    def snapshot(self) -> AbstractContextManager[Snapshot]:
        """One consistent view for a batch of page lookups."""

    @abstractmethod
    def _fingerprint(self, value: memoryview | bytes) -> object:
        """What identifies a bad value, so its delete spares a rewritten record: a digest
        of its ``record.fingerprinted`` part."""

    @abstractmethod
    def _commit(self, batch: Batch) -> None:
        """Apply a batch (writes once, deletes if unchanged, uses); count the outcome."""

    @abstractmethod
    def _close_backend(self) -> None: ...

    @abstractmethod
    def refresh(self) -> None:
        """Reload the store-wide gauges (every process changes them)."""

    @abstractmethod
    def read_through(self, keys: Sequence[bytes]) -> ReadThrough:
        """Read and hash every byte of these records, keeping nothing: the floor under a
        restore (benchmarks compare against it)."""

    @abstractmethod
    def clear(self, namespaces: set[bytes] | None = None) -> tuple[int, int]: ...

    @abstractmethod
    def resize(self, capacity: int) -> int: ...

    @property
    def file_bytes(self) -> int:
        """What the store takes on its medium (a file on disk, a server's memory)."""
        return self.counters.bytes_used

    # --- caller threads ----------------------------------------------------------------

    def reachable(self) -> bool:
        """Whether the backend answers now (a server backing off after a failure does not)."""
        return True

    def contains(self, key: bytes) -> bool:
        """A record exists and is not being deleted (unverified: a read verifies)."""
        return not self.check.doomed(key) and self._exists(key)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` of each key (a remote backend asks in one round trip)."""
        return [self.contains(key) for key in keys]

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a record (``present``: one round trip remote)."""
        return next((i for i, n in enumerate(self.present(keys)) if not n), len(keys))

    def get(
        self,
        key: bytes,
        namespace_digest: bytes,
        tokens: Sequence[int],
        raw_nbytes: int,
        out: np.ndarray | None = None,
        snapshot: Snapshot | None = None,
    ) -> tuple[bytes | np.ndarray, int] | None:
        """Verified raw payload and the stored record size D (bytes read), or None.

        With ``out`` (uint8, ``raw_nbytes`` long) the payload is written there and
        ``out`` returned; on a miss its content is unspecified. ``snapshot``: look in
        that one (a read ahead's, which asks the backend nothing), not a new one.
        """
        with nullcontext(snapshot) if snapshot is not None else self.snapshot() as snap:
            record = snap.find(key, namespace_digest, tokens, raw_nbytes)
            if record is None or (raw := self.check.verified(record, out)) is None:
                return None
            return (bytes(raw) if isinstance(raw, memoryview) else raw), record.stored

    def put(
        self,
        key: bytes,
        namespace_digest: bytes,
        tokens: Sequence[int],
        payload: bytes | memoryview,
        *,
        wait: bool = False,
        segments: tuple[int, ...] = (),
        quantize: Quantize | None = None,
        parent: bytes | None = None,
    ) -> bool:
        """Queue a write-once page write; False (and counted) when the queue is full.

        ``wait=True`` waits for room instead of dropping (for flushes, off the request path).
        ``segments``: byte lengths of the payload's separately checked segments.
        ``quantize``: how this store's codec, if it quantizes, encodes the page
        (``tiers.quant``); without it the page is stored raw (a snapshot's state).
        ``parent``: the key of the page before this one, when known: L3 then keeps the
        parent while this page stays (leaf-first, ``tiers.l3.lmdb_chain``; Redis: by use).
        """
        if self.writer.queued(key):
            return True  # write-once: nothing to copy or write
        # whether L3 holds it already is the writer's question (one per batch), not the caller's
        pending = PendingPut(
            bytes(key),
            bytes(namespace_digest),
            token_bytes(tokens),
            bytes(payload),
            segments,
            quantize,
            None if parent is None else bytes(parent),
        )
        if self._never_fits(len(payload)) or not self.writer.put(pending, wait=wait):  # never fits: nothing crosses
            self.count(writes_dropped=1)
            return False
        return True

    def encoded(self, pending: PendingPut, at: int | None = None) -> bytes:
        """The record a queued write stores (``at``: see ``record.encode_record``), in this
        store's codec, encrypted when it has a cipher (on the writer thread)."""
        p = pending
        return encode_record(
            p.key, p.namespace, p.tokens, p.payload, self._codec, self._level, at, p.segments, self.cipher, p.quantize
        )

    def _never_fits(self, raw_nbytes: int) -> bool:
        """A page this large can never be stored (checked before it is queued)."""
        return False

    def flush(self) -> None:
        """Block until every queued write, delete and use is committed."""
        self.writer.flush()
        self.refresh()

    def close(self) -> None:
        """Flush, stop the writer, close the backend; idempotent."""
        self.writer.close()  # the writer commits all pending work before it stops
        with self._lock:
            already, self._closed = self._closed, True
        if not already:
            self._close_backend()

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared helpers ------------------------------------------------------------------

    def _lost(self, batch: Batch, exc: Exception) -> None:
        """A batch whose commit raised: its writes are dropped, logged and counted."""
        self.failures.report("write", exc, f" ({len(batch.puts)} pages dropped)")
        self.count(writes_dropped=len(batch.puts))

    def count(self, **deltas: int) -> None:
        """Add to this process's counters (thread-safe)."""
        with self._lock:
            self.counters = self.counters.plus(**deltas)
