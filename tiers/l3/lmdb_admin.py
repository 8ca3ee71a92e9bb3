"""Administration of an LMDB store: clearing and resizing an open one (each one write
transaction over its page tables, ``tiers.l3.lmdb_txn``), and compacting one that no
process has open.

Kept apart from the data path (``lmdb_store``): compaction takes the store's lock
exclusively and replaces its file, which no open ``DiskTier`` may see happen.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import lmdb

from ..text import one_line
from .base import StoreError
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
                raise StoreError(f"cannot open store at {path}: {one_line(exc)}") from None
            try:  # closing the env drops this process's locks on lock.mdb (POSIX locks are
                # per process and file): the new file goes in place before that
                with env.begin() as txn:
                    check_format_version(
                        path, txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False))
                    )
                env.copy(tmp, compact=True)
                os.replace(Path(tmp) / "data.mdb", data)
            except lmdb.Error as exc:
                raise StoreError(f"cannot compact store at {path}: {one_line(exc)}") from None
            finally:
                env.close()
        return before, data.stat().st_size
    finally:
        os.close(fd)
