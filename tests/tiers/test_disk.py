"""L3 (DiskTier): one test per invariant in the DiskTier docstring, plus the failure table.

Tests that read or edit records directly open the store's files with the ``lmdb``
package (``tests.tiers.lmdb_files``: the layout is the store format), the tier closed,
or read the tier's ``census`` view while it is open.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from xxhash import xxh3_64_intdigest

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.record import (
    FORMAT_VERSION,
    RAW_PAYLOAD_OFFSET,
    RECORD_VERSION,
    CorruptRecord,
    RecordHeader,
    decode_record,
)

from .disk_pages import NS, RECORD_VALUES, TOKENS, assert_consistent, key, payload, poke
from .lmdb_files import raw_env, write_lock

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd-shuffle"])
def test_round_trip_is_byte_identical_and_reports_stored_size(store: Path, codec: str) -> None:
    tier = DiskTier(store, 1 << 20, codec=codec)
    data = payload(1)
    assert tier.put(key(1), NS, TOKENS, memoryview(bytearray(data)))
    tier.flush()
    raw, stored = tier.get(key(1), NS, TOKENS, len(data))
    assert raw == data
    assert stored == tier.counters.bytes_used and tier.counters.pages == 1
    assert (stored > len(data)) if codec == "raw" else (stored < len(data))
    assert (tier.counters.lookups, tier.counters.hit_pages, tier.counters.hit_tokens) == (1, 1, 8)
    assert tier.get(key(2), NS, TOKENS, len(data)) is None
    tier.close()


def test_raw_payloads_in_the_map_start_where_l2_slots_do_modulo_64(store: Path) -> None:
    """A raw page of several 4 KiB pages sits in LMDB's map at RAW_PAYLOAD_OFFSET modulo
    64 (tiers.l3.record.encode_record), whatever its header's length, and reads back whole."""
    tier = DiskTier(store, 1 << 20)
    for i, tokens in enumerate(list(range(n)) for n in range(1, 80)):  # every header length modulo 64
        data = payload(i, 3 * 4096)
        assert tier.put(key(i), NS, tokens, memoryview(bytearray(data)))
        tier.flush()
        with tier.snapshot() as snap:
            record = snap.find(key(i), NS, tokens, len(data))
            assert bytes(record.payload) == data
            assert np.frombuffer(record.payload, np.uint8).ctypes.data % 64 == RAW_PAYLOAD_OFFSET % 64
    tier.close()


@pytest.mark.parametrize(
    "data", [payload(1)[:-1], np.random.default_rng(0).bytes(4096), b""], ids=["odd-length", "incompressible", "empty"]
)
def test_codec_falls_back_losslessly(store: Path, data: bytes) -> None:
    tier = DiskTier(store, 1 << 20, codec="zstd-shuffle")
    tier.put(key(1), NS, TOKENS, data)
    tier.flush()
    assert tier.get(key(1), NS, TOKENS, len(data))[0] == data
    tier.close()


def test_put_copies_the_callers_buffer(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    buf = bytearray(payload(1))
    tier.put(key(1), NS, TOKENS, memoryview(buf))
    buf[:] = bytes(len(buf))  # caller reuses its buffer before the writer runs
    tier.flush()
    assert tier.get(key(1), NS, TOKENS, len(buf))[0] == payload(1)
    tier.close()


def test_write_once(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    tier.put(key(1), NS, TOKENS, payload(1))
    tier.put(key(1), NS, TOKENS, payload(1))  # still queued
    tier.flush()
    used = tier.counters.bytes_used
    assert tier.put(key(1), NS, TOKENS, payload(2))  # already stored: nothing written
    tier.flush()
    assert (tier.counters.inserts, tier.counters.bytes_used, tier.counters.pages) == (1, used, 1)
    assert tier.get(key(1), NS, TOKENS, 4096)[0] == payload(1)
    tier.close()


def test_capacity_is_never_exceeded_under_random_puts(store: Path) -> None:
    capacity = 64 * 1024
    tier = DiskTier(store, capacity, codec="zstd")
    rng = random.Random(7)
    for i in range(300):
        tier.put(key(i), NS, TOKENS, payload(i, 2 * rng.randint(256, 6000)))
        if i % 25 == 0:
            tier.flush()
            assert 0 < tier.counters.bytes_used <= capacity
    tier.close()
    s = assert_consistent(store, capacity)
    assert tier.counters.evictions > 0
    assert tier.counters.inserts - tier.counters.evictions == len(s["sizes"])


def test_eviction_is_least_recently_used_and_get_counts_as_use(store: Path) -> None:
    record = len(payload(0)) + 200  # header and its padding are under 200 bytes here
    tier = DiskTier(store, 4 * record)
    for i in range(4):
        tier.put(key(i), NS, TOKENS, payload(i))
        tier.flush()
    assert tier.get(key(0), NS, TOKENS, 4096) is not None  # 0 is now the most recent
    tier.flush()
    for i in (4, 5):
        tier.put(key(i), NS, TOKENS, payload(i))
        tier.flush()
    assert [tier.contains(key(i)) for i in range(6)] == [True, False, False, True, True, True]
    assert tier.counters.evictions == 2
    tier.close()
    assert_consistent(store, 4 * record)


def test_a_use_wakes_no_writer_and_is_committed_with_the_next_write(store: Path) -> None:
    """A restore's use of an L3 page is queued without waking the writer (tiers.l3.writer:
    a GIL hand-over on the restore's thread); the next write commits it before it evicts."""
    record = len(payload(0)) + 200
    tier = DiskTier(store, 4 * record)
    for i in range(4):
        tier.put(key(i), NS, TOKENS, payload(i))
        tier.flush()
    assert tier.get(key(0), NS, TOKENS, 4096) is not None
    time.sleep(0.3)  # a woken writer commits a use alone after 0.05 s; an idle one looks once a second
    assert tier.writer.state().queued_touches == 1
    for i in (4, 5):
        tier.put(key(i), NS, TOKENS, payload(i))
        tier.flush()
    assert tier.writer.state().queued_touches == 0
    assert [tier.contains(key(i)) for i in range(6)] == [True, False, False, True, True, True]
    tier.close()


def test_record_larger_than_capacity_is_dropped(store: Path) -> None:
    tier = DiskTier(store, 1000)
    tier.put(key(1), NS, TOKENS, payload(1))
    tier.flush()
    assert not tier.contains(key(1))
    assert tier.counters.writes_dropped == 1 and tier.counters.bytes_used == 0
    tier.close()


@pytest.mark.slow  # another process holds the write lock
def test_full_queue_drops_and_counts(store: Path) -> None:
    tier = DiskTier(store, 1 << 20, queue_pages=1)
    with write_lock(store):  # the writer blocks on LMDB's write lock
        assert tier.put(key(0), NS, TOKENS, payload(0))
        deadline = time.monotonic() + 5
        while not tier.writer.state().committing and time.monotonic() < deadline:
            time.sleep(0.001)
        assert tier.put(key(1), NS, TOKENS, payload(1))  # fills the one-page queue
        assert not tier.put(key(2), NS, TOKENS, payload(2))
        assert not tier.put(key(3), NS, TOKENS, payload(3))
    tier.flush()
    assert tier.counters.writes_dropped == 2
    assert [tier.contains(key(i)) for i in range(4)] == [True, True, False, False]
    tier.close()


def test_map_full_never_reaches_the_caller(store: Path) -> None:
    tier = DiskTier(store, 8 << 20, map_size=1 << 20)  # the map is far smaller than capacity
    for i in range(64):
        assert tier.put(key(i), NS, TOKENS, payload(i, 64 * 1024)) is True  # queued: the flush emptied the queue
        tier.flush()
    assert tier.counters.evictions + tier.counters.writes_dropped > 0
    assert tier.counters.inserts + tier.counters.writes_dropped == 64  # each put committed or dropped
    got = tier.get(key(63), NS, TOKENS, 64 * 1024)
    assert got is None or got[0] == payload(63, 64 * 1024)
    tier.close()
    assert_consistent(store, 8 << 20)


def _store_records(store: Path, n: int, codec: str) -> dict[int, int]:
    """n records; returns each one's stored value length."""
    tier = DiskTier(store, 1 << 24, codec=codec, queue_pages=n)
    for i in range(n):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    with raw_env(store) as (env, pages, _):
        with env.begin() as txn:
            return {i: len(txn.get(key(i), db=pages)) for i in range(n)}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_corrupt_header_or_payload_is_a_miss_deleted_and_counted(store: Path, codec: str) -> None:
    sizes = _store_records(store, 1, codec)
    with raw_env(store) as (env, pages, _):
        with env.begin() as txn:
            value = txn.get(key(0), db=pages)
    header_len = 4 + int.from_bytes(value[:4], "little")
    rng = random.Random(3)
    # Every header byte (XOR 0xFF never yields an equivalent msgpack encoding), and payload
    # bytes at the ends and at random.
    positions = list(range(header_len)) + [header_len, sizes[0] - 1]
    positions += rng.sample(range(header_len, sizes[0]), 8)
    n = len(positions)
    _store_records(store, n, codec)
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for i, pos in enumerate(positions):
                damaged = bytearray(txn.get(key(i), db=pages))
                damaged[min(pos, len(damaged) - 1)] ^= 0xFF
                txn.put(key(i), bytes(damaged), db=pages)
    tier = DiskTier(store, 1 << 24, codec=codec)
    assert all(tier.get(key(i), NS, TOKENS, 4096) is None for i in range(n))
    assert tier.counters.checksum_failures == n
    tier.flush()
    assert not any(tier.contains(key(i)) for i in range(n))
    assert tier.counters.pages == 0 and tier.counters.bytes_used == 0
    tier.close()
    assert_consistent(store, 1 << 24)


def test_namespace_token_or_length_mismatch_is_a_miss(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    for i in range(3):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.flush()
    assert tier.get(key(0), b"M" * 16, TOKENS, 4096) is None
    assert tier.get(key(1), NS, TOKENS[::-1], 4096) is None
    assert tier.get(key(2), NS, TOKENS, 4094) is None
    assert tier.counters.checksum_failures == 3
    tier.flush()
    assert tier.counters.pages == 0
    tier.close()


def test_a_raw_payload_of_the_wrong_length_is_refused_at_every_layer(store: Path) -> None:
    """A raw record whose header is right for the page (raw length 4096, checksum of
    its own payload) but whose payload is 4000 bytes: only a length check catches it.
    The snapshot lookup refuses it (the restore would shape the map's bytes as a
    page), and so does the record decoder, with or without a buffer to decode into."""
    short = payload(0)[:4000]
    tokens = np.asarray(TOKENS, "<u4").tobytes()
    value = RecordHeader(RECORD_VERSION, key(0), NS, tokens, "raw", 4096, xxh3_64_intdigest(short)).pack() + short
    for out in (None, np.empty(4096, np.uint8)):
        with pytest.raises(CorruptRecord):
            decode_record(key(0), memoryview(value), NS, tokens, 4096, out)
    DiskTier(store, 1 << 20).close()
    poke(store, key(0), value)
    tier = DiskTier(store, 1 << 20)
    with tier.snapshot() as snap:
        assert snap.find(key(0), NS, TOKENS, 4096) is None
    assert tier.counters.checksum_failures == 1
    tier.close()


def test_arbitrary_record_values_never_raise(store: Path) -> None:
    DiskTier(store, 1 << 20).close()

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(value=RECORD_VALUES)
    def check(value: bytes) -> None:
        poke(store, key(0), value)
        with DiskTier(store, 1 << 20) as tier:  # close commits the delete before the next poke
            assert tier.get(key(0), NS, TOKENS, 64) is None

    check()
    with DiskTier(store, 1 << 20) as tier:
        assert not tier.contains(key(0))
    assert_consistent(store, 1 << 20)


def test_other_format_version_is_refused_with_one_clear_line(store: Path) -> None:
    DiskTier(store, 1 << 20).close()
    with raw_env(store) as (env, _, meta):
        with env.begin(write=True) as txn:
            txn.put(b"format_version", msgpack.packb(FORMAT_VERSION + 98), db=meta)
    with pytest.raises(StoreError) as err:
        DiskTier(store, 1 << 20)
    message = str(err.value)
    assert message == (
        f"store at {store} has format version {FORMAT_VERSION + 98}, this kvtier reads version {FORMAT_VERSION}"
    )
    # the refused store was closed again: this process can open it raw
    with raw_env(store):
        pass


def test_unwritable_directory_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create store directory") as err:
        DiskTier(tmp_path / "file" / "store", 1 << 20)
    assert "\n" not in str(err.value)


def test_damaged_environment_is_a_store_error(store: Path) -> None:
    store.mkdir()
    (store / "data.mdb").write_bytes(b"this is not lmdb" * 1024)
    with pytest.raises(StoreError, match="cannot open store at") as err:
        DiskTier(store, 1 << 20)
    assert "\n" not in str(err.value)


def test_persistent_counters_and_meta_survive_reopen(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    assert tier.tables.persistent_counters() == {} and tier.tables.get_meta("profile") is None
    tier.tables.add_persistent_counters({"L3": {"inserts": 2}, "tokens": 5})
    tier.tables.put_meta("profile", {"links": {"L3->L2": [1e-4, 2.5e9]}})
    tier.close()
    tier = DiskTier(store, 1 << 20)
    tier.tables.add_persistent_counters({"L3": {"inserts": 3, "evictions": 1}, "seconds": 0.5})
    assert tier.tables.persistent_counters() == {"L3": {"inserts": 5, "evictions": 1}, "tokens": 5, "seconds": 0.5}
    assert tier.tables.get_meta("profile") == {"links": {"L3->L2": [1e-4, 2.5e9]}}
    tier.close()


def test_reopen_finds_every_page(store: Path) -> None:
    tier = DiskTier(store, 1 << 22, codec="zstd-shuffle")
    for i in range(40):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    tier = DiskTier(store, 1 << 22)  # the codec of each record is in its header
    assert tier.counters.pages == 40
    assert all(tier.get(key(i), NS, TOKENS, 4096)[0] == payload(i) for i in range(40))
    tier.close()


def test_closed_tier_misses_and_refuses_writes(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    tier.close()
    tier.close()
    assert tier.get(key(0), NS, TOKENS, 4096) is None and not tier.contains(key(0))
    assert not tier.put(key(0), NS, TOKENS, payload(0))


def test_reads_and_caller_writes_run_while_the_writer_works(store: Path) -> None:
    tier = DiskTier(store, 1 << 24, queue_pages=512)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(5):
                for i in range(100):
                    got = tier.get(key(i), NS, TOKENS, 4096)
                    assert got is None or got[0] == payload(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(100):
        tier.put(key(i), NS, TOKENS, payload(i))
        tier.tables.add_persistent_counters({"n": 1})
    for t in threads:
        t.join()
    tier.close()
    assert not errors and tier.counters.checksum_failures == 0
    assert assert_consistent(store, 1 << 24)["pages"] == 100


_WRITER_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.tiers.disk_pages import NS, TOKENS, key, payload
from kvtier.tiers.l3.lmdb_store import DiskTier
tier = DiskTier(Path(sys.argv[2]), 1 << 24, codec=sys.argv[4])
for i in range(int(sys.argv[3])):
    assert tier.put(key(i), NS, TOKENS, payload(i))
    if i % 10 == 9:
        tier.flush()
tier.close()
print(tier.counters.inserts)
"""


def test_two_processes_share_one_store(store: Path) -> None:
    n = 200
    tier = DiskTier(store, 1 << 24, codec="zstd")
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(REPO), str(store), str(n), "raw"], stdout=subprocess.PIPE, text=True
    )
    while child.poll() is None:
        for i in range(n):
            got = tier.get(key(i), NS, TOKENS, 4096)
            if got is not None:
                assert got[0] == payload(i)  # never a partial or uncommitted page
            elif i % 5 == 0:
                tier.put(key(i), NS, TOKENS, payload(i))  # both processes write some keys
        tier.flush()
    child_inserts = int(child.communicate()[0])
    assert child.returncode == 0
    assert all(tier.get(key(i), NS, TOKENS, 4096)[0] == payload(i) for i in range(n))
    tier.refresh()
    assert tier.counters.pages == n and tier.counters.checksum_failures == 0
    assert tier.counters.inserts + child_inserts == n  # write-once across processes
    tier.close()
    assert assert_consistent(store, 1 << 24)["pages"] == n


def test_writer_killed_mid_write_leaves_no_partial_page(store: Path) -> None:
    tier = DiskTier(store, 1 << 26)
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(REPO), str(store), "100000", "zstd"], stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while tier.counters.pages < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
        tier.refresh()
    child.kill()  # SIGKILL: no flush, no close, possibly inside a write transaction
    child.wait()
    tier.refresh()
    present = [i for i in range(tier.counters.pages + 64) if tier.contains(key(i))]
    assert len(present) == tier.counters.pages >= 50
    assert all(tier.get(key(i), NS, TOKENS, 4096)[0] == payload(i) for i in present)
    tier.close()
    assert_consistent(store, 1 << 26)


def test_read_through_touches_every_stored_byte(tmp_path):
    """It hashes each stored record whole (header and payload), as it is in the map."""
    disk = DiskTier(tmp_path, 1 << 20)
    for i in range(2):
        disk.put(key(i), NS, TOKENS, payload(i, 1000))
    disk.flush()
    read = disk.read_through([key(0), b"missing-key-0000", key(1)])
    assert read.nbytes == disk.counters.bytes_used
    disk.close()
    with raw_env(tmp_path) as (env, pages, _), env.begin(db=pages) as txn:
        stored = {bytes(k): bytes(v) for k, v in txn.cursor()}
    assert read.digests == (xxh3_64_intdigest(stored[key(0)]), xxh3_64_intdigest(stored[key(1)]))
