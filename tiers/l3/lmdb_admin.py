"""Administration of an LMDB store: clearing and resizing an open one (each one write
transaction over its page tables, ``tiers.l3.lmdb_txn``), and compacting one that no
process has open.

Kept apart from the data path (``lmdb_store``): compaction takes the store's lock
(``tiers.l3.lmdb_lock``) exclusively and replaces its file, which no open ``DiskTier``
may see happen.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import lmdb

from ..text import one_line
from .base import StoreError
from .lmdb_lock import PARTIAL_PREFIX, StoreLock, remove_partial_copies
from .lmdb_open import check_format_version
from .lmdb_txn import PageTables
from .record import header_or_none


def clear_pages(tables: PageTables, namespaces: set[bytes] | None) -> tuple[int, int]:
    """Delete every page (or those of ``namespaces``) in one transaction; (pages, bytes)
    removed."""
    with tables.env.begin(write=True, buffers=True) as txn:
        state = tables.load_state(txn)
        doomed = []
        for key, value in txn.cursor(db=tables.dbs.pages):
            header = header_or_none(value)
            if namespaces is None or (header is not None and header.namespace in namespaces):
                doomed.append(bytes(key))
        before = (state.pages, state.bytes_used)
        for page in doomed:
            tables.remove(txn, state, page, txn.get(page, db=tables.dbs.pages))
        tables.save_state(txn, state)
    return before[0] - state.pages, before[1] - state.bytes_used


def resize_store(tables: PageTables, capacity: int) -> int:
    """Set the store's cap and evict down to it (one transaction); how many pages went."""
    return tables.evict_alone(lambda _: capacity, capacity)


def compact_store(path: Path) -> tuple[int, int]:
    """Rewrite ``data.mdb`` without its free pages (LMDB copy with compaction); the file
    sizes before and after. StoreError when another process has the store open.

    The store's lock (``tiers.l3.lmdb_lock``) is held exclusively from the first read to
    the swap, so no process opens the old file meanwhile: every opener takes it shared
    and waits. LMDB's own lock on ``lock.mdb`` is tried too, which also finds a process
    that opened the files without kvtier. The copy is made in ``STORE/compact-XXXX``; a
    compaction killed before the swap leaves it there, and the next opener removes it.
    """
    path = Path(path)
    data = path / "data.mdb"
    if not data.is_file():
        raise StoreError(f"no kvtier store at {path}")
    held = StoreLock.exclusive(path)
    try:
        _refuse_lmdb_users(path)
        remove_partial_copies(path)
        before = data.stat().st_size
        tmp = Path(tempfile.mkdtemp(dir=path, prefix=PARTIAL_PREFIX))
        try:
            _copy_compacted(path, tmp)
            os.replace(tmp / "data.mdb", data)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return before, data.stat().st_size
    finally:
        held.release()


def _refuse_lmdb_users(path: Path) -> None:
    """StoreError when a process holds LMDB's shared lock on ``lock.mdb`` (every open
    environment does): one that bypassed the store's lock."""
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise StoreError(f"cannot lock store {path}: {exc.strerror}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    except OSError:
        raise StoreError(f"store {path} is open in another process; stop it before compacting") from None
    finally:
        os.close(fd)  # drops the probe's lock: the store's lock keeps everyone out


def _copy_compacted(path: Path, into: Path) -> None:
    try:
        env = lmdb.open(str(path), max_dbs=8, subdir=True, lock=True, create=False)
    except lmdb.Error as exc:
        raise StoreError(f"cannot open store at {path}: {one_line(exc)}") from None
    try:
        with env.begin() as txn:
            check_format_version(path, txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False)))
        env.copy(str(into), compact=True)
    except lmdb.Error as exc:
        raise StoreError(f"cannot compact store at {path}: {one_line(exc)}") from None
    finally:
        env.close()
