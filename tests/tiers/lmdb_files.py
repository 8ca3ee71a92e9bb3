"""An LMDB store's files opened with the ``lmdb`` package, as any other program would:
the on-disk layout (databases ``pages``, ``meta``, ``lru``, ``order``, ...) is the store
format, so tests read and damage it through that, never through a tier's handles.

py-lmdb refuses to open one environment twice in a process, and LMDB's locks are per
process: ``raw_env`` needs the tier closed; ``write_lock`` holds the store's write lock
from a process of its own while a tier in this one stays open.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb

_HOLD = (
    "import lmdb, sys\n"
    "env = lmdb.open(sys.argv[1], max_dbs=8, subdir=True, lock=True, create=False)\n"
    "txn = env.begin(write=True)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
    "txn.abort()\n"
)


@contextlib.contextmanager
def opened_elsewhere(path: Path) -> Iterator[None]:
    """The store at ``path`` held open by a tier in a process of its own, for the block."""
    script = (
        "import time; from kvtier.tiers.l3.lmdb_store import DiskTier; "
        f"d = DiskTier({str(path)!r}); print('open', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        yield
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def raw_env(path: Path) -> Iterator[tuple[lmdb.Environment, object, object]]:
    """The store at ``path`` (no tier may have it open) and its pages and meta databases."""
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        yield env, env.open_db(b"pages"), env.open_db(b"meta")
    finally:
        env.close()


def followed(env: lmdb.Environment, txn: lmdb.Transaction, keys: Iterable[bytes]) -> set[bytes]:
    """Those of ``keys`` that a stored record follows (``chain``: ``b"c" + key`` -> a
    u32 count; ``tiers.l3.lmdb_chain``): out of the eviction order until it goes."""
    chain = env.open_db(b"chain", txn=txn)
    return {k for k in keys if txn.get(b"c" + k, db=chain) is not None}


def damage_last_byte(path: Path, keys: Iterable[bytes]) -> None:
    """Flip the last byte of each record ``keys`` names in the closed store at ``path``
    (of a page, its last layer's rows: a window row's where the model has window layers)."""
    with raw_env(path) as (env, pages, _), env.begin(write=True) as txn:
        for key in keys:
            value = bytearray(txn.get(key, db=pages))
            value[-1] ^= 0xFF
            txn.put(key, bytes(value), db=pages)


def damage_first_payload_byte(path: Path, keys: Iterable[bytes]) -> None:
    """Flip the first payload byte of each record ``keys`` names in the closed store at
    ``path`` (of a page, its first layer's rows: a global row's)."""
    with raw_env(path) as (env, pages, _), env.begin(write=True) as txn:
        for key in keys:
            value = bytearray(txn.get(key, db=pages))
            value[4 + int.from_bytes(value[:4], "little")] ^= 0xFF  # past the u32 header length and the header
            txn.put(key, bytes(value), db=pages)


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[None]:
    """Another process holds the store's write transaction open until the block ends:
    every commit here waits behind it, as behind a stuck writer elsewhere."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        yield
    finally:
        child.stdin.close()
        child.wait(timeout=30)
