"""A store never fills its disk (issue 26, item 4): a new store's default cap is the
smaller of 32 GiB and half the free space, said in one line, and a cap beyond what the
disk holds is met by eviction, not by a full disk and dropped writes.

The small filesystem is a stand-in: ``lmdb_space.usage`` (the one place the store asks
its filesystem) answers for a filesystem of ``SIZE`` bytes that holds ``data.mdb`` and
nothing else, so nothing here depends on the real disk's size or needs root to mount one.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from kvtier.tiers.l3 import lmdb_space
from kvtier.tiers.l3.lmdb_store import DiskTier

NS = b"N" * 16
TOKENS = list(range(8))
SIZE = 24 << 20
PAGE_BYTES = 64 << 10


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch) -> Path:
    """A store directory on a stand-in filesystem of SIZE bytes."""
    store = tmp_path / "store"

    def usage(path: Path) -> lmdb_space.Usage:
        data = store / "data.mdb"
        used = data.stat().st_size if data.exists() else 0
        return lmdb_space.Usage(SIZE, used, max(0, SIZE - used))

    monkeypatch.setattr(lmdb_space, "usage", usage)
    return store


def test_a_new_stores_default_cap_is_half_the_free_space_and_says_so(small_disk, caplog):
    with caplog.at_level(logging.INFO, logger="kvtier"), DiskTier(small_disk) as tier:
        assert tier.counters.capacity == SIZE // 2
    said = [r.getMessage() for r in caplog.records if "its L3 cap is" in r.getMessage()]
    assert said == [
        f"new store {small_disk}: its L3 cap is 12.0 MiB (half the free space of its filesystem (24.0 MiB free))"
    ]
    with DiskTier(small_disk) as tier:  # the store keeps it
        assert tier.counters.capacity == SIZE // 2


def test_a_cap_beyond_the_disk_evicts_instead_of_filling_it(small_disk, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier"), DiskTier(small_disk, 1 << 30) as tier:
        for i in range(2 * SIZE // PAGE_BYTES):  # twice what the disk holds
            assert tier.put(key(i), NS, TOKENS, bytes([i % 251]) * PAGE_BYTES, wait=True)
        tier.flush()
        assert tier.file_bytes < SIZE  # the disk never filled
        assert tier.counters.writes_dropped == 0 and tier.counters.evictions > 0
        last = 2 * SIZE // PAGE_BYTES - 1
        assert tier.get(key(last), NS, TOKENS, PAGE_BYTES) is not None  # the newest pages are kept
        assert SIZE // 3 < tier.counters.bytes_used < SIZE  # held, not drained
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(small_disk) in warned[0] and "evicting" in warned[0], warned
