"""Compaction never loses a write (issue 25, item 5): no process opens the store while
``compact_store`` copies it, a process that finds ``data.mdb`` replaced under it reopens
before it writes, and a killed compaction's partial copy is gone at the next open."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_admin import compact_store
from kvtier.tiers.l3.lmdb_store import DiskTier

NS = b"N" * 16
TOKENS = list(range(8))
PAGE_BYTES = 32 << 10

# Short writers, one after another, as `kvtier run`s are: each opens the store, writes
# one page, closes it (committed), and says so; until the test leaves the file `stop`.
_WRITER = f"""
import hashlib, itertools, os, sys
from kvtier.tiers.l3.lmdb_store import DiskTier
for i in itertools.count():
    if os.path.exists(sys.argv[2]):
        break
    with DiskTier(sys.argv[1], 1 << 30) as tier:
        tier.put(hashlib.blake2b(str(i).encode(), digest_size=16).digest(), b"N" * 16, list(range(8)),
                 bytes([i % 251]) * {PAGE_BYTES}, wait=True)
    print(i, flush=True)
"""


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def stored(store: Path, keys: range) -> list[int]:
    with DiskTier(store, readonly=True) as tier:
        return [i for i in keys if tier.get(key(i), NS, TOKENS, PAGE_BYTES) is not None]


@pytest.mark.slow  # starts a writer process
def test_every_page_a_writer_commits_during_compactions_is_kept(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with DiskTier(store, 1 << 30) as tier:  # something to copy: a compaction takes a while
        for i in range(1000, 2500):
            tier.put(key(i), NS, TOKENS, bytes(PAGE_BYTES), wait=True)
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(store), str(stop)], stdout=subprocess.PIPE)
    first = int(writer.stdout.readline())  # a write before the first compaction
    compactions = refusals = 0
    deadline = time.monotonic() + 120  # the writer runs until three compactions got their turn
    while compactions < 3 and writer.poll() is None and time.monotonic() < deadline:
        try:
            compact_store(store)
            compactions += 1
        except StoreError as err:
            assert "is open in another process" in str(err)
            refusals += 1
        time.sleep(0.02)  # the writer's turn: an opener waits for a running compaction
    stop.touch()
    assert writer.wait(timeout=60) == 0
    committed = [first, *(int(line) for line in writer.stdout.read().split())]
    assert compactions == 3, (compactions, refusals)  # compactions ran between the writes
    assert committed == list(range(len(committed)))
    assert stored(store, range(len(committed))) == committed
    assert len(stored(store, range(1000, 2500))) == 1500


@pytest.mark.slow  # replaces the file from a process of its own
def test_a_store_replaced_under_a_process_is_reopened_before_it_writes(tmp_path: Path) -> None:
    """Another program (here: raw LMDB, which takes no kvtier lock) swaps in a compacted
    copy while a tier has the store open: the tier's next write lands in the new file."""
    store = tmp_path / "store"
    tier = DiskTier(store, 1 << 30)
    tier.put(key(0), NS, TOKENS, bytes(PAGE_BYTES), wait=True)
    tier.flush()
    swap = (
        "import lmdb, os, sys, tempfile\n"
        "env = lmdb.open(sys.argv[1], max_dbs=8, create=False)\n"
        "tmp = tempfile.mkdtemp(dir=sys.argv[1])\n"
        "env.copy(tmp, compact=True)\n"
        "os.replace(os.path.join(tmp, 'data.mdb'), os.path.join(sys.argv[1], 'data.mdb'))\n"
        "os.rmdir(tmp)\n"
    )
    subprocess.run([sys.executable, "-c", swap, str(store)], check=True)
    tier.put(key(1), NS, TOKENS, bytes(PAGE_BYTES), wait=True)
    tier.flush()
    assert tier.counters.writes_dropped == 0 and tier.counters.pages == 2
    tier.close()
    assert stored(store, range(2)) == [0, 1]


def test_a_killed_compactions_partial_copy_is_removed_at_the_next_open(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with DiskTier(store, 1 << 20) as tier:
        tier.put(key(0), NS, TOKENS, bytes(PAGE_BYTES), wait=True)
    partial = store / "compact-k1ll3d"  # where compact_store copies to, as a SIGKILL leaves it
    partial.mkdir()
    (partial / "data.mdb").write_bytes(bytes(1 << 20))
    with DiskTier(store, readonly=True) as reader:
        assert reader.counters.pages == 1
    assert not partial.exists()
    assert sorted(p.name for p in store.iterdir()) == ["data.mdb", "lock", "lock.mdb"]
