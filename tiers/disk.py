"""L3: pages in an LMDB environment on disk, shared by every process on the machine.

Record (DESIGN §4) in the ``pages`` database: key = 16-byte page key, value =
``u32 little-endian header length | msgpack header | payload``. The header is
``{"v": format version, "ns": namespace digest, "tok": token ids as <u4 bytes,
"codec": "raw" | "zstd" | "zstd-shuffle", "n": raw length, "xxh": xxh3_64 of the raw
bytes}``; dtype and shape are implied by the namespace and the raw length. The
payload is the raw bytes or a zstd frame (of the 2-byte planes for zstd-shuffle).

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

import fcntl
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import lmdb
import msgpack
import numpy as np
import zstandard
from xxhash import xxh3_64_intdigest

from kvtier.tiers.counters import TierCounters, add_into
from kvtier.tiers.policy import POLICIES

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_CAPACITY = 32 << 30  # the cap of a new store when none is asked for
CODECS = ("raw", "zstd", "zstd-shuffle")
_LEN, _SEQ = struct.Struct("<I"), struct.Struct(">Q")
_MIB = 1 << 20
_MIN_MAP = 16 << 30  # address space only: the file grows with the data, not with the map
_TOUCH_DELAY_S = 0.05  # LRU touches alone wait this long, so many share one commit
_MAX_TOUCHES = 4096  # touches are hints: past this many pending, the oldest are dropped


_DBS = (b"pages", b"lru", b"order", b"counters", b"namespaces")


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``12 KiB``, ``512 B``: sizes as people read them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class StoreError(Exception):
    """L3 cannot be used (unwritable dir, damaged env, other format version)."""


class _Corrupt(ValueError):
    """A stored record that must not be served; the message says why."""


@dataclass(frozen=True)
class RecordHeader:
    version: int
    namespace: bytes
    tokens: bytes
    codec: str
    raw_len: int
    checksum: int

    def pack(self) -> bytes:
        head = msgpack.packb(dict(zip(("v", "ns", "tok", "codec", "n", "xxh"), astuple(self))))
        return _LEN.pack(len(head)) + head

    @classmethod
    def unpack(cls, value: memoryview) -> tuple[RecordHeader, int]:
        """The header of a stored value and the payload offset; _Corrupt if malformed."""
        end = _LEN.size + (_LEN.unpack_from(value)[0] if len(value) >= _LEN.size else len(value))
        if end > len(value):
            raise _Corrupt("header runs past the record")
        try:
            f = msgpack.unpackb(value[_LEN.size:end])
            values = (f["v"], f["ns"], f["tok"], f["codec"], f["n"], f["xxh"])
        except Exception as exc:  # msgpack raises many types on garbage
            raise _Corrupt(f"header does not parse ({type(exc).__name__})") from None
        if tuple(map(type, values)) != (int, bytes, bytes, str, int, int):
            raise _Corrupt("header field of the wrong type")
        return cls(*values), end


def _check_header(header: RecordHeader, namespace: bytes, tokens: bytes, raw_nbytes: int) -> None:
    """_Corrupt unless the header describes this page of this namespace."""
    for ok, reason in ((header.version == FORMAT_VERSION, "format version differs"),
                       (header.namespace == namespace, "namespace digest differs"),
                       (header.tokens == tokens, "token ids differ"),
                       (header.raw_len == raw_nbytes, "raw length differs"),
                       (header.codec in CODECS, "unknown codec")):
        if not ok:
            raise _Corrupt(reason)


def verify_payload(header: RecordHeader, payload: memoryview, out: np.ndarray | None = None) -> memoryview | np.ndarray | bytes:
    """The raw bytes of a payload under a checked header (see ``decode_payload`` for
    ``out``); _Corrupt unless they have the header's length and checksum."""
    raw = decode_payload(header.codec, payload, header.raw_len, out)
    if len(raw) != header.raw_len or xxh3_64_intdigest(raw) != header.checksum:
        raise _Corrupt("checksum mismatch")
    return raw


def decode_record(value: memoryview, namespace: bytes, tokens: bytes, raw_nbytes: int,
                  out: np.ndarray | None = None) -> memoryview | np.ndarray | bytes:
    """The raw page of a stored value, checked against the page it should hold
    (namespace, token ids as <u4 bytes, raw length); _Corrupt otherwise."""
    header, offset = RecordHeader.unpack(value)
    _check_header(header, namespace, tokens, raw_nbytes)
    return verify_payload(header, value[offset:], out)


@dataclass
class StoredRecord:
    """A page record found in a snapshot: header checked, payload not yet verified."""

    key: bytes
    header: RecordHeader
    value: memoryview  # the whole record, in the map
    payload: memoryview

    @property
    def stored(self) -> int:
        """Bytes read from L3 for this page (D of the L3 link)."""
        return len(self.value)

    @property
    def compressed(self) -> bool:
        return self.header.codec != "raw"


class Snapshot:
    """Page lookups inside one LMDB read transaction (``DiskTier.snapshot``)."""

    def __init__(self, disk: DiskTier, txn: lmdb.Transaction | None) -> None:
        self.disk, self.txn = disk, txn

    def find(self, key: bytes, namespace_digest: bytes, tokens: Sequence[int],
             raw_nbytes: int) -> StoredRecord | None:
        """The record of ``key`` if its header matches this page, else None (a record
        with a bad header is rejected). Counts the lookup."""
        disk = self.disk
        disk._count(lookups=1)
        if self.txn is None or disk._doomed(key):
            return None  # a rejected record whose delete is not committed yet: a miss
        try:
            value = self.txn.get(key)
        except lmdb.Error as exc:
            disk._failed("read", exc)
            return None
        if value is None:
            return None
        try:
            header, offset = RecordHeader.unpack(value)
            _check_header(header, namespace_digest, _token_bytes(tokens), raw_nbytes)
            if header.codec == "raw" and len(value) - offset != raw_nbytes:
                raise _Corrupt("raw payload length differs from the raw length")
        except _Corrupt as exc:
            disk._reject(key, xxh3_64_intdigest(value), str(exc))
            return None
        return StoredRecord(bytes(key), header, value, value[offset:])


@dataclass
class _PendingPut:
    key: bytes
    namespace: bytes
    tokens: bytes
    payload: bytes


@dataclass
class _Batch:
    """Everything the writer commits in one write transaction."""

    puts: list[_PendingPut]
    touches: list[bytes]
    deletes: dict[bytes, int]  # page key -> xxh3 of the bad value that get saw


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


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)  # 10x faster than numpy for a page


def _uses(stamp: memoryview | bytes) -> int:
    """Use count of an ``lru`` entry (entries written before counts were kept: 1)."""
    return _LEN.unpack_from(stamp, _SEQ.size)[0] if len(stamp) >= _SEQ.size + _LEN.size else 1


def _header_or_none(value: memoryview | bytes) -> RecordHeader | None:
    try:
        return RecordHeader.unpack(value)[0]
    except _Corrupt:
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _shuffle(raw: bytes) -> bytes:
    """Low bytes of the 2-byte values, then high bytes (bf16 sign+exponent compress well)."""
    words = np.frombuffer(raw, "<u2")
    return np.concatenate([(words & 0xFF).astype(np.uint8), (words >> 8).astype(np.uint8)]).tobytes()


def _unshuffle(planes: bytes) -> bytes:
    low, high = np.frombuffer(planes, np.uint8).reshape(2, -1)  # ValueError when odd
    return (low | high.astype("<u2") << 8).tobytes()


_local = threading.local()  # zstd (de)compressors are not thread-safe: one per thread


def encode_payload(codec: str, raw: bytes, level: int) -> tuple[str, bytes]:
    """The codec actually used and the payload; raw when compression does not pay."""
    codec = "zstd" if codec == "zstd-shuffle" and len(raw) % 2 else codec
    if codec == "raw":
        return codec, raw
    if getattr(_local, "level", None) != level:
        _local.compressor, _local.level = zstandard.ZstdCompressor(level=level), level
    packed = _local.compressor.compress(_shuffle(raw) if codec == "zstd-shuffle" else raw)
    return (codec, packed) if len(packed) < len(raw) else ("raw", raw)


def decode_payload(codec: str, payload: memoryview, raw_len: int,
                   out: np.ndarray | None = None) -> memoryview | bytes | np.ndarray:
    """Raw bytes of a payload, written into ``out`` when given; without ``out`` a raw
    payload is returned as it is (a view into the map); _Corrupt if it cannot be decoded."""
    if out is not None:
        if len(payload) != raw_len and codec == "raw":
            raise _Corrupt("raw payload length differs from the raw length")
        raw = payload if codec == "raw" else decode_payload(codec, payload, raw_len)
        np.copyto(out, np.frombuffer(raw, np.uint8))
        return out
    if codec == "raw":
        return payload
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    try:
        if zstandard.frame_content_size(payload) != raw_len:  # bounds memory before decoding
            raise _Corrupt("zstd frame size differs from the raw length")
        data = _local.decompressor.decompress(payload)
        return _unshuffle(data) if codec == "zstd-shuffle" else data
    except (zstandard.ZstdError, ValueError) as exc:
        raise _Corrupt(f"payload does not decode ({exc})") from None


def _check_version(path: Path, stored: bytes | None) -> None:
    version = FORMAT_VERSION if stored is None else msgpack.unpackb(stored)
    if version != FORMAT_VERSION:
        raise StoreError(f"store at {path} has format version {version}, "
                         f"this kvtier reads version {FORMAT_VERSION}")


def _ns_row() -> dict:
    return {"pages": 0, "bytes": 0, "tokens": 0, "last_use": 0.0, "about": {}}


def _describe(row: dict) -> str:
    about = row.get("about") or {}
    return f"model {about.get('model', '?')}, page size {about.get('page_size', '?')}"


def compact_store(path: Path) -> tuple[int, int]:
    """Rewrite ``data.mdb`` without its free pages (LMDB copy with compaction); the file
    sizes before and after. StoreError when another process has the store open.

    LMDB holds a shared lock on the first byte of ``lock.mdb`` in every process with the
    store open; taking it exclusively here proves nobody else has, and makes any process
    that opens the store meanwhile wait until the new file is in place.
    """
    path = Path(path)
    data = path / "data.mdb"
    if not data.is_file():
        raise StoreError(f"no kvtier store at {path}")
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise StoreError(f"cannot lock store {path}: {exc.strerror}") from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError:
            raise StoreError(f"store {path} is open in another process; stop it before compacting") from None
        before = data.stat().st_size
        with tempfile.TemporaryDirectory(dir=path, prefix="compact-") as tmp:
            try:
                env = lmdb.open(str(path), max_dbs=8, subdir=True, lock=True, create=False)
            except lmdb.Error as exc:
                raise StoreError(f"cannot open store at {path}: {_one_line(exc)}") from None
            try:  # closing the env drops this process's locks on lock.mdb (POSIX locks are
                # per process and file): the new file goes in place before that
                with env.begin() as txn:
                    _check_version(path, txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False)))
                env.copy(tmp, compact=True)
                os.replace(Path(tmp) / "data.mdb", data)
            except lmdb.Error as exc:
                raise StoreError(f"cannot compact store at {path}: {_one_line(exc)}") from None
            finally:
                env.close()
        return before, data.stat().st_size
    finally:
        os.close(fd)


class DiskTier:
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

    def __init__(self, path: Path, capacity_bytes: int | None = None, *, codec: str = "raw",
                 zstd_level: int = 3, queue_pages: int = 64, map_size: int | None = None,
                 readonly: bool = False, record_bytes: int | None = None, policy: str = "lru") -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown L3 codec {codec!r}; expected one of {', '.join(CODECS)}")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.path = Path(path)
        self.readonly = readonly
        self._capacity = DEFAULT_CAPACITY if capacity_bytes is None else capacity_bytes  # until meta says
        self.counters = TierCounters(capacity=self._capacity)
        self._codec, self._level = codec, zstd_level
        self._queue_pages = max(1, queue_pages)
        self._record_bytes = record_bytes  # what a record counts against the cap; None: its size
        self._policy = policy  # eviction order: "lru", or "cost" (see _stamp)
        self._env = self._open_readonly() if readonly else self._open_env(map_size, capacity_bytes)
        self._lock = threading.Lock()  # guards counters and the pending work below
        self._wake = threading.Condition(self._lock)
        self._puts: dict[bytes, _PendingPut] = {}
        self._touches: dict[bytes, None] = {}  # insertion order = access order
        self._deletes: dict[bytes, int] = {}
        self._deleting: frozenset[bytes] = frozenset()  # deletes of the batch being committed
        self._in_flight = self._closing = self._stopped = readonly
        self._closed = False
        self._flushers = 0
        self._failures_seen: set[tuple[str, type]] = set()
        self.refresh()
        self._writer = threading.Thread(target=self._run_writer, name="kvtier-l3-writer", daemon=True)
        if not readonly:
            self._writer.start()

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
            raise StoreError(f"cannot open store at {self.path}: {_one_line(exc)}") from None
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
            raise StoreError(f"cannot open store at {self.path}: {_one_line(error)}")
        try:
            self._check_file_size(env)
            # Without a txn: py-lmdb keeps the handles of a read-only env only when it opens them itself
            self._meta = env.open_db(b"meta", create=False)
            with env.begin(db=self._meta) as txn:
                _check_version(self.path, txn.get(b"format_version"))
            self._pages, self._lru, self._order, self._counters_db = (
                env.open_db(name, create=False) for name in _DBS[:4])
            try:
                self._namespaces = env.open_db(b"namespaces", create=False)
            except lmdb.NotFoundError:  # a store no writer has opened since the table came
                self._namespaces = None
        except lmdb.Error as exc:  # NotFoundError: a database missing
            env.close()
            raise StoreError(f"cannot read store at {self.path}: {_one_line(exc)}") from None
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
                _check_version(self.path, txn.get(b"format_version", db=self._meta))
                txn.put(b"format_version", msgpack.packb(FORMAT_VERSION), db=self._meta)
                fresh = b"namespaces" not in {bytes(k) for k, _ in txn.cursor()}
                self._pages, self._lru, self._order, self._counters_db, self._namespaces = (
                    env.open_db(name, txn=txn) for name in _DBS)
                if fresh:
                    self._count_namespaces(txn)
                self._settle_capacity(txn, capacity)
        except (lmdb.Error, ValueError) as exc:  # ValueError: msgpack, on a damaged version
            raise StoreError(f"cannot open store at {self.path}: {_one_line(exc)}") from None

    def _settle_capacity(self, txn: lmdb.Transaction, asked: int | None) -> None:
        """The store's cap wins; a store without one takes the cap asked for."""
        stored = txn.get(b"capacity", db=self._meta)
        if stored is None:
            txn.put(b"capacity", msgpack.packb(self._capacity), db=self._meta)
            return
        self._capacity = msgpack.unpackb(stored)
        if asked is not None and asked != self._capacity:
            log.warning("store %s keeps its L3 cap of %s; the %s asked for is ignored "
                        "(`kvtier store resize --l3-bytes` changes it)",
                        self.path, format_bytes(self._capacity), format_bytes(asked))

    def _count_namespaces(self, txn: lmdb.Transaction) -> None:
        """Fill the namespaces table from the records (a store from before it existed)."""
        state = _StoreState()
        for _, value in txn.cursor(db=self._pages):
            if (header := _header_or_none(value)) is not None:
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

    def contains(self, key: bytes) -> bool:
        """A committed record exists and is not being deleted (unverified: get verifies)."""
        if self._doomed(key):
            return False
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
            yield Snapshot(self, txn)
        finally:
            if txn is not None:
                txn.abort()

    def get(self, key: bytes, namespace_digest: bytes, tokens: Sequence[int],
            raw_nbytes: int, out: np.ndarray | None = None) -> tuple[bytes | np.ndarray, int] | None:
        """Verified raw payload and the stored record size D (bytes read), or None.

        With ``out`` (uint8, ``raw_nbytes`` long) the payload is written there and
        ``out`` returned; on a miss its content is unspecified.
        """
        with self.snapshot() as snap:
            record = snap.find(key, namespace_digest, tokens, raw_nbytes)
            raw = None if record is None else self.verified(record, out)
            if raw is None:
                return None
            return (bytes(raw) if isinstance(raw, memoryview) else raw), record.stored

    def verified(self, record: StoredRecord, out: np.ndarray | None = None) -> memoryview | np.ndarray | bytes | None:
        """The record's raw bytes once its checksum holds; else None, and it is rejected.

        A raw payload comes back as the map view itself (no copy) unless ``out`` is
        given; a compressed one is decoded into ``out`` (or new memory). Safe on any
        thread while the record's snapshot is open; counts the hit and the LRU use.
        """
        try:
            raw = verify_payload(record.header, record.payload, out)
        except _Corrupt as exc:
            self._reject(record.key, xxh3_64_intdigest(record.value), str(exc))
            return None
        self._hit(record)
        return raw

    def accept(self, record: StoredRecord, digest: int) -> bool:
        """Whether a raw record's payload, hashed by the caller while it copied it (the
        snapshot still open), matches its checksum; counted like ``verified``."""
        if digest != record.header.checksum:  # find checked the length
            self._reject(record.key, xxh3_64_intdigest(record.value), "checksum mismatch")
            return False
        self._hit(record)
        return True

    def _hit(self, record: StoredRecord) -> None:
        with self._lock:
            self.counters.hit_pages += 1
            self.counters.hit_tokens += len(record.header.tokens) // 4
            self._touches.pop(record.key, None)
            self._touches[record.key] = None
            if len(self._touches) > _MAX_TOUCHES:
                del self._touches[next(iter(self._touches))]
            if len(self._touches) == 1:
                self._wake.notify_all()  # later touches ride along (see _next_batch)

    def _doomed(self, key: bytes) -> bool:
        """A get rejected this record and its delete has not committed yet.

        Such a key reads as absent, so a caller recomputes the page and may store it
        again at once (the writer commits deletes before puts); answering "present"
        would make put skip the fresh copy as already written.
        """
        with self._lock:
            return key in self._deletes or key in self._deleting

    def _reject(self, key: bytes, fingerprint: int, reason: str) -> None:
        log.warning("L3 record %s rejected (%s); deleting it", bytes(key).hex(), reason)
        with self._lock:
            self.counters.checksum_failures += 1
            self._deletes[bytes(key)] = fingerprint
            self._wake.notify_all()

    def put(self, key: bytes, namespace_digest: bytes, tokens: Sequence[int],
            payload: bytes | memoryview, *, wait: bool = False) -> bool:
        """Queue a write-once page write; False (and counted) when the queue is full.

        ``wait=True`` waits for room instead of dropping (for flushes, off the request path).
        """
        if key in self._puts or self.contains(key):
            return True  # write-once: nothing to copy or write
        pending = _PendingPut(bytes(key), bytes(namespace_digest), _token_bytes(tokens), bytes(payload))
        with self._lock:
            if self._codec == "raw" and self._size(payload) > self._capacity:  # can never fit: nothing crosses to L3
                self.counters.writes_dropped += 1
                return False
            while wait and not self._closing and len(self._puts) >= self._queue_pages:
                self._wake.wait()
            if self._closing or len(self._puts) >= self._queue_pages:
                self.counters.writes_dropped += 1
                return False
            self._puts.setdefault(pending.key, pending)
            self._wake.notify_all()
        return True

    def flush(self) -> None:
        """Block until every queued write, delete and LRU touch is committed."""
        with self._lock:
            self._flushers += 1
            self._wake.notify_all()
            while (self._has_work() or self._in_flight) and not self._stopped:
                self._wake.wait()
            self._flushers -= 1
        self.refresh()

    def close(self) -> None:
        """Flush, stop the writer, close the environment; idempotent."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._writer.is_alive():
            self._writer.join()  # the writer drains all pending work before it stops
        with self._lock:
            already, self._closed = self._closed, True
        if not already:
            self._env.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            log.warning("store %s holds no pages for this model and page size (%s), only %d of "
                        "other namespaces (%s): nothing here will be reused",
                        self.path, _describe({"about": about}), sum(r["pages"] for r in others.values()),
                        "; ".join(seen))

    def clear(self, namespaces: set[bytes] | None = None) -> tuple[int, int]:
        """Delete every page (or those of ``namespaces``); (pages, bytes) removed."""
        self.flush()
        with self._env.begin(write=True, buffers=True) as txn:
            state = self._load_state(txn)
            doomed = []
            for key, value in txn.cursor(db=self._pages):
                header = _header_or_none(value)
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

    def _has_work(self) -> bool:
        return bool(self._puts or self._touches or self._deletes)

    def _next_batch(self) -> _Batch | None:
        with self._lock:
            while not self._has_work() and not self._closing:
                self._wake.wait()
            if not (self._puts or self._deletes or self._closing or self._flushers):
                self._wake.wait(_TOUCH_DELAY_S)  # only touches: let more arrive
            if not self._has_work():
                self._stopped = True  # closing and drained
                self._wake.notify_all()
                return None
            batch = _Batch(list(self._puts.values()), list(self._touches), dict(self._deletes))
            self._puts, self._touches, self._deletes = {}, {}, {}
            self._deleting = frozenset(batch.deletes)
            self._in_flight = True
            return batch

    def _run_writer(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._commit(batch)
            except Exception as exc:  # the writer must survive: lose the batch, not the tier
                self._failed("write", exc, f" ({len(batch.puts)} pages dropped)")
                self._count(writes_dropped=len(batch.puts))
            finally:
                with self._lock:
                    self._in_flight = False
                    self._deleting = frozenset()
                    self._wake.notify_all()

    def _commit(self, batch: _Batch) -> None:
        records = [(p.key, self._encode(p)) for p in batch.puts]  # encode outside the txn
        try:
            outcome = self._write(batch, records)
        except lmdb.MapFullError:
            outcome = self._retry_map_full(batch, records)
        self._count(**vars(outcome))
        self.refresh()

    def _retry_map_full(self, batch: _Batch, records: list[tuple[bytes, bytes]]) -> _Outcome:
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

    def _encode(self, put: _PendingPut) -> bytes:
        codec, body = encode_payload(self._codec, put.payload, self._level)
        header = RecordHeader(FORMAT_VERSION, put.namespace, put.tokens, codec,
                              len(put.payload), xxh3_64_intdigest(put.payload))
        return b"".join((header.pack(), body))

    def _write(self, batch: _Batch, records: list[tuple[bytes, bytes]]) -> _Outcome:
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
                    if (header := _header_or_none(txn.get(key, db=self._pages) or b"")) is not None:
                        state.used.add(header.namespace)
            for key, value in records:
                self._insert(txn, state, key, value, outcome)
            self._save_state(txn, state)
        return outcome

    def _insert(self, txn: lmdb.Transaction, state: _StoreState, key: bytes, value: bytes,
                outcome: _Outcome) -> None:
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
                key = bytes(cursor.key())[_SEQ.size:]
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
            header = _header_or_none(value)
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
        rank = state.access_seq if self._policy == "lru" else \
            (state.clock + uses) << 32 | (state.access_seq & 0xFFFFFFFF)
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

    def _failed(self, what: str, exc: BaseException, detail: str = "") -> None:
        """Log a failure: the first of each kind as a warning, repeats at debug level."""
        kind = (what, type(exc))
        level = logging.DEBUG if kind in self._failures_seen else logging.WARNING
        self._failures_seen.add(kind)
        log.log(level, "L3 %s failed: %s%s", what, _one_line(exc), detail)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)
