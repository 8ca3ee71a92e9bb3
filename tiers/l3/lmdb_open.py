"""Opening an LMDB store: create or check the environment, refuse a damaged one with one
line (StoreError), create its databases and settle the store's cap.

The cap belongs to the store, not to a process: the first opener sets it, later
openers keep it (a different request is logged and ignored) and ``resize`` changes it,
so one process with a small cap never evicts everyone else's pages.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import msgpack

from ..text import format_bytes, one_line
from .base import StoreError
from .lmdb_space import default_capacity, usage
from .lmdb_txn import Databases, PageTables
from .record import FORMAT_VERSION
from .tables import DamageLog, is_count, unpacked

if TYPE_CHECKING:
    from .lmdb_txn import Database  # the stub's handle type: annotations only

log = logging.getLogger(__name__)

_MIB = 1 << 20
_MIN_MAP = 16 << 30  # address space only: the file grows with the data, not with the map
_DBS = (b"pages", b"lru", b"order", b"counters", b"namespaces", b"chain")


def check_format_version(path: Path, stored: bytes | None) -> None:
    """StoreError when the store holds another format version. A damaged version is one
    warning and taken as this one: every record carries its own, checked on read."""
    readable, version = unpacked(stored)
    if not readable or not (version is None or is_count(version)):
        DamageLog(str(path)).report(
            "meta value format_version", f"taken as {FORMAT_VERSION} (every record's own version is checked on read)"
        )
        return
    if version not in (None, FORMAT_VERSION):
        raise StoreError(f"store at {path} has format version {version}, this kvtier reads version {FORMAT_VERSION}")


def writable_directory(path: Path) -> None:
    """Create the store directory ``path`` if absent; StoreError (one line) when it
    cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create store directory {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(f"store directory {path} is not writable")


def read_only_store(path: Path) -> bool:
    """A store is there (``data.mdb``) that this process cannot write: it can still be
    read, and restored from."""
    data = path / "data.mdb"
    return data.is_file() and not (os.access(path, os.W_OK | os.X_OK) and os.access(data, os.W_OK))


def open_writable(
    path: Path, map_size: int | None, asked: int | None, policy: str, record_bytes: int | None
) -> tuple[PageTables, int]:
    """The store at ``path`` (created if absent) and its cap: the stored one, else
    ``asked``, else the default the filesystem allows (``lmdb_space.default_capacity``).
    The directory exists (``writable_directory``)."""
    capacity, why = default_capacity(path) if asked is None else (asked, "as asked")
    if map_size is None:
        # Generous: if another process later grows the data past this map, every txn
        # here fails with MapResizedError (a miss or a dropped write, logged once). No
        # larger than the filesystem: a cap beyond it cannot be reached, nor mapped.
        data = path / "data.mdb"
        existing = data.stat().st_size if data.exists() else 0
        wanted = min(2 * capacity + 64 * _MIB, usage(path).total)
        map_size = max(wanted, 2 * existing, _MIN_MAP)
    try:
        # sync=True: every commit is durable and a crash never leaves a damaged B-tree;
        # commits are batched on the writer thread, off the request path. readahead
        # stays on: a large value is one contiguous run of pages.
        env = lmdb.open(str(path), map_size=map_size, max_dbs=8, subdir=True, lock=True)
    except lmdb.Error as exc:
        raise StoreError(f"cannot open store at {path}: {one_line(exc)}") from None
    try:
        _check_file_size(path, env)
        env.reader_check()  # free reader slots of killed processes (they pin old pages)
        return _open_dbs(path, env, asked, (capacity, why), policy, record_bytes)
    except BaseException:
        env.close()
        raise


def open_readonly(path: Path, policy: str, record_bytes: int | None) -> PageTables:
    """The existing store (``data.mdb`` is there), opened without writing to it."""
    env = None
    for lock in (True, False):  # without locks only where the lock file cannot be written
        try:
            env = lmdb.open(str(path), readonly=True, max_dbs=8, subdir=True, lock=lock, create=False)
            break
        except lmdb.Error as exc:
            error = exc
    if env is None:
        raise StoreError(f"cannot open store at {path}: {one_line(error)}")
    try:
        _check_file_size(path, env)
        # Without a txn: py-lmdb keeps the handles of a read-only env only when it opens them itself
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            check_format_version(path, txn.get(b"format_version"))
        pages, lru, order, counters = (env.open_db(name, create=False) for name in _DBS[:4])
        namespaces, chain = (_optional_db(env, name) for name in (b"namespaces", b"chain"))
    except lmdb.Error as exc:  # NotFoundError: a database missing
        env.close()
        raise StoreError(f"cannot read store at {path}: {one_line(exc)}") from None
    except BaseException:
        env.close()
        raise
    dbs = Databases(meta, pages, lru, order, counters, namespaces, chain)
    return PageTables(env, dbs, policy, record_bytes, default_capacity(path)[0])  # what a damaged cap reads as


def _optional_db(env: lmdb.Environment, name: bytes) -> Database | None:
    """A read-only store's database that a store no writer has opened since it came lacks."""
    try:
        return env.open_db(name, create=False)
    except lmdb.NotFoundError:
        return None


def _check_file_size(path: Path, env: lmdb.Environment) -> None:
    """Refuse a data file shorter than its meta page says.

    LMDB checks only the meta pages on open and then reads the file through its
    memory map: a page past the end of a truncated file kills the process with
    SIGBUS at the first read. LMDB writes a commit's pages before its meta and never
    shrinks the file, so a sound file always covers ``last_pgno``.
    """
    data = path / "data.mdb"
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # both read the meta only
    have = data.stat().st_size
    if have < need:
        raise StoreError(f"store file {data} is truncated ({have} bytes, its meta needs {need})")


def _open_dbs(
    path: Path,
    env: lmdb.Environment,
    asked: int | None,
    capacity: tuple[int, str],
    policy: str,
    record_bytes: int | None,
) -> tuple[PageTables, int]:
    """Check the format version, create the databases, settle the cap (one transaction)."""
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            check_format_version(path, txn.get(b"format_version", db=meta))
            txn.put(b"format_version", msgpack.packb(FORMAT_VERSION), db=meta)
            fresh = b"namespaces" not in {bytes(k) for k, _ in txn.cursor()}
            dbs = Databases(meta, *(env.open_db(name, txn=txn) for name in _DBS))
            tables = PageTables(env, dbs, policy, record_bytes, capacity[0])
            if fresh:
                tables.count_namespaces(txn)
            return tables, _settle_capacity(path, txn, meta, asked, capacity)
    except lmdb.Error as exc:
        raise StoreError(f"cannot open store at {path}: {one_line(exc)}") from None


def _settle_capacity(
    path: Path, txn: lmdb.Transaction, meta: Database, asked: int | None, chosen: tuple[int, str]
) -> int:
    """The store's cap wins; a store without one takes ``chosen`` (the cap asked for, or
    the default) and says so in one line."""
    capacity, why = chosen
    readable, kept = unpacked(txn.get(b"capacity", db=meta))
    if not readable or not is_count(kept):  # absent, or damaged
        if not readable or kept is not None:
            DamageLog(str(path)).report("meta value capacity", f"taken as {format_bytes(capacity)}")
        else:
            log.info("new store %s: its L3 cap is %s (%s)", path, format_bytes(capacity), why)
        txn.put(b"capacity", msgpack.packb(capacity), db=meta)
        return capacity
    if asked is not None and asked != kept:
        log.warning(
            "store %s keeps its L3 cap of %s; the %s asked for is ignored "
            "(`kvtier store resize --l3-bytes` changes it)",
            path,
            format_bytes(kept),
            format_bytes(asked),
        )
    return kept
