"""L3 (DiskTier): the store's own cap, namespaces, read-only opens and management (issues 11 and 12).

As ``test_disk``, records are read or edited with the ``lmdb`` package, the tier closed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_admin import compact_store
from kvtier.tiers.l3.lmdb_store import DiskTier

from .disk_pages import NS, TOKENS, assert_consistent, key, payload
from .lmdb_files import opened_elsewhere, raw_env


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_the_cap_is_the_stores_and_a_different_one_is_ignored_with_a_warning(store: Path, caplog) -> None:
    tier = DiskTier(store, 8 * 4096 + 2048)
    for i in range(8):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    small = DiskTier(store, 2 * 4096)  # a second process with a smaller cap
    assert "keeps its L3 cap" in caplog.text and small.counters.capacity == 8 * 4096 + 2048
    small.put(key(99), NS, TOKENS, payload(99))
    small.close()
    s = assert_consistent(store, 8 * 4096 + 2048)
    assert len(s["sizes"]) == 8  # one eviction made room for one page; nothing more went
    assert DiskTier(store).counters.capacity == 8 * 4096 + 2048  # no cap asked: the store's


def test_resize_evicts_least_recently_used_down_to_the_new_cap(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    for i in range(6):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.flush()
    record = tier.counters.bytes_used // 6
    assert tier.resize(2 * record) == 4
    assert tier.counters.capacity == 2 * record and tier.counters.pages == 2
    assert tier.get(key(5), NS, TOKENS, 4096) is not None and tier.get(key(0), NS, TOKENS, 4096) is None
    tier.close()
    assert_consistent(store, 2 * record)


def test_namespaces_are_counted_with_the_records_and_clear_takes_one(store: Path) -> None:
    other = b"O" * 16
    tier = DiskTier(store, 1 << 20)
    tier.tables.describe_namespace(NS, {"model": "m", "page_size": 8})
    for i in range(5):
        tier.put(key(i), NS if i < 3 else other, TOKENS, payload(i))
    tier.flush()
    rows = tier.tables.namespaces()
    assert (rows[NS]["pages"], rows[NS]["tokens"], rows[other]["pages"]) == (3, 24, 2)
    assert rows[NS]["bytes"] + rows[other]["bytes"] == tier.counters.bytes_used
    assert rows[NS]["about"] == {"model": "m", "page_size": 8} and rows[NS]["last_use"] > 0
    assert tier.clear({other}) == (2, rows[other]["bytes"])
    assert tier.get(key(3), other, TOKENS, 4096) is None and tier.get(key(0), NS, TOKENS, 4096) is not None
    assert tier.tables.namespaces()[other]["pages"] == 0 and tier.counters.pages == 3
    assert tier.clear()[0] == 3 and tier.counters.bytes_used == 0
    tier.close()
    assert_consistent(store, 1 << 20)


def test_a_store_holding_only_other_namespaces_says_so(store: Path, caplog) -> None:
    tier = DiskTier(store, 1 << 20)
    tier.tables.describe_namespace(NS, {"model": "a", "page_size": 16})
    tier.put(key(0), NS, TOKENS, payload(0))
    tier.flush()
    tier.tables.describe_namespace(b"O" * 16, {"model": "a", "page_size": 32})
    tier.close()
    warnings = [r.getMessage() for r in caplog.records if "holds no pages for this model" in r.getMessage()]
    assert len(warnings) == 1 and "page size 32" in warnings[0] and "page size 16" in warnings[0]


def test_read_only_open_reads_and_never_writes(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    tier.put(key(1), NS, TOKENS, payload(1))
    tier.tables.add_persistent_counters({"requests": 1})
    tier.close()
    before = (store / "data.mdb").read_bytes()
    reader = DiskTier(store, readonly=True)
    assert reader.get(key(1), NS, TOKENS, 4096)[0] == payload(1)
    assert reader.tables.persistent_counters() == {"requests": 1} and reader.counters.pages == 1
    assert reader.put(key(2), NS, TOKENS, payload(2)) is False
    reader.close()
    reader.close()
    assert (store / "data.mdb").read_bytes() == before
    with pytest.raises(StoreError, match="no kvtier store"):
        DiskTier(store / "missing", readonly=True)
    assert not (store / "missing").exists()


def test_reset_counters(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    tier.tables.add_persistent_counters({"requests": 3})
    tier.tables.reset_counters()
    assert tier.tables.persistent_counters() == {}
    tier.close()


def test_a_page_larger_than_the_cap_is_dropped_at_put(store: Path) -> None:
    tier = DiskTier(store, 0)
    assert tier.put(key(0), NS, TOKENS, payload(0)) is False
    assert tier.counters.writes_dropped == 1
    tier.close()


def test_compact_shrinks_the_file_and_keeps_every_page(store: Path) -> None:
    other = b"O" * 16
    tier = DiskTier(store, 1 << 22)
    for i in range(40):
        tier.put(key(i), other if i < 30 else NS, TOKENS, payload(i, 16384), wait=True)
    tier.flush()
    assert tier.clear({other})[0] == 30  # churn: 30 of 40 pages deleted, the file keeps its size
    tier.close()
    before, after = compact_store(store)
    assert after < before / 2 and (store / "data.mdb").stat().st_size == after
    tier = DiskTier(store)
    assert [i for i in range(40) if tier.get(key(i), NS, TOKENS, 16384) is not None] == list(range(30, 40))
    tier.close()
    assert_consistent(store, 1 << 22)


def test_compact_refuses_while_another_process_has_the_store_open(store: Path) -> None:
    DiskTier(store, 1 << 20).close()
    with opened_elsewhere(store), pytest.raises(StoreError, match="open in another process"):
        compact_store(store)


def test_a_store_from_before_the_namespaces_table_is_counted_on_open(store: Path) -> None:
    tier = DiskTier(store, 1 << 20)
    for i in range(3):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    with raw_env(store) as (env, _, _meta):
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(b"namespaces", txn=txn), delete=True)
    with DiskTier(store, readonly=True) as reader:
        assert reader.tables.namespaces() == {} and reader.counters.pages == 3
    tier = DiskTier(store, 1 << 20)
    row = tier.tables.namespaces()[NS]
    assert (row["pages"], row["tokens"], row["bytes"]) == (3, 24, tier.counters.bytes_used)
    tier.close()


def test_a_read_ahead_holds_its_own_bytes_not_views_of_the_map(store: Path) -> None:
    """What a snapshot read ahead (on a reader thread) is what the restore finds later on
    the step loop, though the map under it changed: its bytes were copied as they were
    read, so the step loop never touches (or faults on) the map for them."""
    tier = DiskTier(store, 1 << 20)
    data = [payload(i, 16384) for i in range(8)]
    for i, d in enumerate(data):
        tier.put(key(i), NS, TOKENS, d)
    tier.flush()
    keys = [key(i) for i in range(8)]
    with tier.snapshot() as snapshot:
        assert snapshot.read_ahead(keys, len(data[0]))[0] == keys
    tier.clear()  # its pages freed once the snapshot ended: LMDB reuses them for the next writes
    for i in range(100, 140):
        tier.put(key(i), NS, TOKENS, payload(i, 16384))
    tier.flush()
    found = [snapshot.find(k, NS, TOKENS, len(d)) for k, d in zip(keys, data)]
    assert [bytes(tier.check.verified(record)) for record in found if record is not None] == data
    tier.close()
