"""Leaf-first in L3 (DESIGN §4, invariant 9): a long shared prefix with many short tails
under L3 pressure keeps the prefix, in LMDB (across a restart too) and, helped by use,
on Redis; and the store hands L3 each page's parent when it spills it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.redis_store import RedisTier
from kvtier.tiers.page import page_keys

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .small_pages import GEOMETRY, KV, NS, PAGE

PREFIX = 6  # pages of the shared prefix
RECORD = 1 << 16  # large beside the few KiB a Redis server's own use varies by
TOKENS = list(range(8))
DIGEST = b"N" * 16


def key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


PAGES = [key(f"prefix {i}") for i in range(PREFIX)]


def put_chain(tier, keys: list[bytes], parent: bytes | None) -> None:
    """Write ``keys`` as a chain after ``parent``, first page first, each on its own."""
    for k in keys:
        tier.put(k, DIGEST, TOKENS, bytes(RECORD), parent=parent)
        tier.flush()
        parent = k


def tails(tier, first: int, n: int) -> list[bytes]:
    """``n`` two-page tails after the prefix (the conversations that share it)."""
    written = []
    for t in range(first, first + n):
        pages = [key(f"tail {t} {i}") for i in range(2)]
        put_chain(tier, pages, PAGES[-1])
        written += pages
    return written


def lmdb(store: Path) -> DiskTier:
    return DiskTier(store, capacity_bytes=10 * RECORD, record_bytes=RECORD)  # 10 records fit


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_a_shared_prefix_outlives_its_tails_under_pressure(tmp_path: Path, policy: str) -> None:
    with DiskTier(tmp_path, capacity_bytes=10 * RECORD, record_bytes=RECORD, policy=policy) as tier:
        put_chain(tier, PAGES, None)
        written = tails(tier, 0, 20)
        assert [tier.contains(k) for k in PAGES] == [True] * PREFIX
        assert tier.contains(written[-1]) and tier.contains(written[-2])  # the newest tail, whole
        assert tier.counters.evictions == len(written) - 4  # the tails went, the prefix stayed


def test_a_chain_leaves_last_page_first(tmp_path: Path) -> None:
    with lmdb(tmp_path) as tier:
        put_chain(tier, PAGES, None)
        for i in range(10):  # other pages fill the store: the chain goes, page by page
            tier.put(key(f"other {i}"), DIGEST, TOKENS, bytes(RECORD))
            tier.flush()
            kept = [tier.contains(k) for k in PAGES]
            assert kept == sorted(kept, reverse=True)  # what is left is its start, never a hole
        assert not any(kept)


def test_the_relation_survives_a_restart(tmp_path: Path) -> None:
    with lmdb(tmp_path) as tier:
        put_chain(tier, PAGES, None)
        tails(tier, 0, 2)
    with lmdb(tmp_path) as tier:  # a new process knows which record follows which
        tails(tier, 2, 20)
        assert [tier.contains(k) for k in PAGES] == [True] * PREFIX
        census = tier.census()
        assert set(PAGES) <= census.followed  # the prefix waits out of the eviction order
        assert census.lru == set(census.order) | census.followed == set(census.sizes)


def test_a_record_whose_followers_came_first_waits_for_them(tmp_path: Path) -> None:
    """L2 spills leaves first: a page often reaches L3 after the pages that follow it."""
    with lmdb(tmp_path) as tier:
        put_chain(tier, PAGES[1:], PAGES[0])  # the followers first
        put_chain(tier, PAGES[:1], None)
        assert PAGES[0] in tier.census().followed
        for k in PAGES[1:]:  # used since: the first page is the least recently used
            assert tier.get(k, DIGEST, TOKENS, RECORD) is not None
        tier.flush()
        others = [key(f"other {i}") for i in range(5)]
        put_chain(tier, others, None)  # 11 records: one must go
        assert tier.contains(PAGES[0])  # the oldest, yet followed: the chain's last page went
        assert not tier.contains(PAGES[-1])


def test_the_store_gives_l3_each_pages_parent(tmp_path: Path) -> None:
    """Through TieredStore: L1 and L2 hold 2 pages, L3 6; a 4-page prefix, then tails of
    one page each after it. L3 keeps the prefix, so every tail's prompt reuses it."""
    tokens = list(range(100, 100 + 4 * 4))
    store = TieredStore(GEOMETRY, NS, StoreConfig(PAGE, PAGE, 6 * PAGE, tmp_path, page_bytes=PAGE))
    prefix = page_keys(NS, tokens)
    for i, k in enumerate(prefix):
        store.publish(k, tokens[i * 4 : (i + 1) * 4], KV[i], parent=prefix[i - 1] if i else None)
    for t in range(10):
        tail = [1000 + 4 * t + j for j in range(4)]
        (k,) = page_keys(NS, tokens + tail)[4:]
        store.publish(k, tail, KV[4 + t % 8], parent=prefix[-1])
    assert store.disk is not None
    store.disk.flush()
    assert len(store.locate(prefix, tokens)) == 4  # found whole, L3 holding what L1 and L2 lack
    assert store.stats().tiers["L3"].evictions > 0
    store.close()


@pytest.mark.slow
@needs_redis
def test_on_redis_a_shared_prefix_outlives_its_tails(redis_server) -> None:  # noqa: F811
    """Redis evicts by its own policy; under LFU the touch of each page's parent makes a
    prefix used more than its tails (log factor 0: every use counts; 64 samples: it sees
    nearly every key, so its choice is the least used)."""
    client = redis_server.client()
    for name, value in (("maxmemory-policy", "allkeys-lfu"), ("lfu-log-factor", "0"), ("maxmemory-samples", "64")):
        client.config_set(name, value)
    with RedisTier(redis_server.url) as tier:
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 24 * RECORD)
        put_chain(tier, PAGES, None)
        written = tails(tier, 0, 30)
        assert tier.counters.evictions > 0
        assert [tier.contains(k) for k in PAGES] == [True] * PREFIX
        assert tier.contains(written[-1])
