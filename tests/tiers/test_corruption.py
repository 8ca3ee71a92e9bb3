"""Reliability of the store (issue 6): random damage in stored records is always detected,
and a record of another format is never served."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.record import RECORD_VERSION, RecordHeader

from .disk_pages import NS, TOKENS, assert_consistent, damage_record, key, payload
from .lmdb_files import raw_env, write_lock

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle"])
def test_random_flips_in_headers_and_payloads_are_all_detected(tmp_path: Path, codec: str) -> None:
    """Random byte flips in 40 of 60 records: every damaged record is a counted miss and
    deleted; every intact one still reads back."""
    store = tmp_path / "store"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    n = 60
    size = [512 * (1 + i % 8) for i in range(n)]
    tier = DiskTier(store, 1 << 24, codec=codec, queue_pages=n)
    for i in range(n):
        tier.put(key(i), NS, TOKENS, payload(i, size[i]))
    tier.close()
    damaged = set(rng.sample(range(n), 40))
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for i in damaged:
                txn.put(key(i), damage_record(bytes(txn.get(key(i), db=pages)), rng, in_header=i % 2 == 1), db=pages)
    tier = DiskTier(store, 1 << 24)
    for i in range(n):
        got = tier.get(key(i), NS, TOKENS, size[i])
        assert got is None if i in damaged else got[0] == payload(i, size[i])
    assert tier.counters.checksum_failures == len(damaged)
    tier.flush()
    assert tier.counters.pages == n - len(damaged)
    assert not any(tier.contains(key(i)) for i in damaged)
    tier.close()
    assert_consistent(store, 1 << 24)


def test_rejected_page_can_be_stored_again_before_its_delete_commits(store: Path) -> None:
    """Between a rejected get and the commit of its delete, the page reads as absent and
    a recomputed copy is accepted (the writer deletes before it inserts)."""
    with DiskTier(store, 1 << 20) as tier:
        tier.put(key(0), NS, TOKENS, payload(0))
    with raw_env(store) as (env, pages, _), env.begin(write=True) as txn:
        value = bytearray(txn.get(key(0), db=pages))
        value[-1] ^= 0x40
        txn.put(key(0), bytes(value), db=pages)
    tier = DiskTier(store, 1 << 20)
    with write_lock(store):  # the writer cannot commit the delete yet
        assert tier.get(key(0), NS, TOKENS, 4096) is None
        assert not tier.contains(key(0))
        assert tier.get(key(0), NS, TOKENS, 4096) is None  # a second look: counted once
        assert tier.put(key(0), NS, TOKENS, payload(0))  # the recomputed page
    tier.flush()
    assert tier.counters.checksum_failures == 1
    assert tier.get(key(0), NS, TOKENS, 4096)[0] == payload(0)
    tier.close()
    assert_consistent(store, 1 << 20)


def test_records_of_another_format_version_are_never_served(store: Path) -> None:
    tier = DiskTier(store, 1 << 20, queue_pages=4)
    for i in range(4):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for i in (1, 3):
                value = bytes(txn.get(key(i), db=pages))
                header, offset = RecordHeader.unpack(memoryview(value))
                other = RecordHeader(
                    RECORD_VERSION + 1,
                    *[getattr(header, f) for f in ("key", "namespace", "tokens", "codec", "raw_len", "checksum")],
                )
                padded = other.pack(offset - len(header.pack()))  # the record keeps its length
                txn.put(key(i), padded + value[offset:], db=pages)
    tier = DiskTier(store, 1 << 20)
    got = [tier.get(key(i), NS, TOKENS, 4096) for i in range(4)]
    assert got[1] is None and got[3] is None and got[0][0] == payload(0) and got[2][0] == payload(2)
    assert tier.counters.checksum_failures == 2
    tier.close()
    assert set(assert_consistent(store, 1 << 20)["sizes"]) == {key(0), key(2)}


_OPEN_AND_READ = """
import hashlib, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_store import DiskTier
n = int(sys.argv[2])
keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]  # test_disk.key
for store in sys.argv[3:]:
    print(store, end=": ", flush=True)
    try:
        tier = DiskTier(Path(store), 1 << 24)
    except StoreError as err:
        print("refused", err, flush=True)
        continue
    found = sum(tier.get(k, b"N" * 16, list(range(8)), 4096) is not None for k in keys)
    tier.close()
    print("opened", found, flush=True)
"""


def test_truncated_store_file_is_refused_not_a_crash(tmp_path: Path) -> None:
    """LMDB checks only the meta pages: a data file cut short opens, and the first read past
    its end kills the process (SIGBUS). Every cut must be refused with a StoreError, or
    (an empty file) opened as a new store. The opens run in a child: a crash kills it, not pytest."""
    n = 64
    source = tmp_path / "source"
    tier = DiskTier(source, 1 << 24, queue_pages=n)
    for i in range(n):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    size = (source / "data.mdb").stat().st_size
    cuts = (0, 4096, 8192, 3 * 4096, size // 2, size - 4096, size - 1)
    stores = []
    for cut in cuts:
        stores.append(tmp_path / f"cut-{cut}")
        shutil.copytree(source, stores[-1])
        os.truncate(stores[-1] / "data.mdb", cut)
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_AND_READ, str(REPO), str(n), *map(str, stores)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stdout.splitlines()[-1:], done.stderr[-500:])
    outcomes = [line.split(": ", 1)[1] for line in done.stdout.splitlines()]
    assert outcomes[0] == "opened 0"  # LMDB treats an empty file as a new environment
    assert all(o.startswith("refused cannot open store") or o.startswith("refused store file") for o in outcomes[1:]), (
        outcomes
    )
    assert len(outcomes) == len(cuts)
