"""The tier invariants of tiers/hierarchy.py (restore, placement, links), one test (or more) each."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import lmdb
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvtier.tiers.restore as restore_module
from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import Namespace, Source, page_keys
from kvtier.tiers.tier import kv_to_host

from .small_pages import (
    KEYS,
    KV,
    MANY_THREADS,
    NS,
    PAGE,
    SMALL,
    TOKENS,
    joined,
    make_store,
    page_tokens,
    publish,
    same_bytes,
)


def test_spill_order_l1_to_l2_to_l3(tmp_path):
    store = make_store(1, 1, tmp_path)
    publish(store, 0, 1, 2)
    store.disk.flush()
    assert KEYS[2] in store.l1 and KEYS[1] in store.l2 and store.disk.contains(KEYS[0])
    assert KEYS[0] not in store.l1 and KEYS[0] not in store.l2
    assert store.links["L1->L2"].bytes == 2 * PAGE
    assert store.links["L2->L3"].bytes == PAGE
    assert np.array_equal(store.l2.read(KEYS[1]), kv_to_host(KV[1]))
    assert store.locate(KEYS[:4], TOKENS) == [Source.L3, Source.L2, Source.L1]
    store.close()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("tier", ["L1", "L2", "L3"])
def test_round_trip_is_byte_identical(tmp_path, tier, codec):
    l1, l2 = {"L1": (4, 4), "L2": (0, 4), "L3": (0, 0)}[tier]
    store = make_store(l1, l2, tmp_path, codec=codec)
    publish(store, 0, 1)
    if tier == "L3":  # a new process finds the pages only in L3
        store.close()
        store = make_store(l1, l2, tmp_path, codec=codec)
    restored = store.restore(KEYS[:2], TOKENS)
    assert restored.sources == [Source(tier)] * 2
    assert same_bytes(joined(restored), mx.concatenate([KV[0], KV[1]], axis=3))
    store.release(restored.keys)
    store.close()


def restore(store: TieredStore, keys, ahead: bool):
    """A restore in one call, or begun with the raw L3 pages checked ahead (as an
    overlapped restore does on its loader thread) and then finished."""
    return store.finish(store.begin(keys, TOKENS, ahead=True)) if ahead else store.restore(keys, TOKENS)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_bad_l3_page_ends_the_prefix_and_frees_what_it_held(tmp_path, codec, ahead):
    store = make_store(0, 0, tmp_path, codec=codec, limits=MANY_THREADS)
    publish(store, *range(6), data=SMALL)
    store.close()
    env = lmdb.open(str(tmp_path), max_dbs=8, map_size=1 << 30)
    with env.begin(write=True) as txn:
        pages = env.open_db(b"pages", txn=txn)
        value = bytearray(txn.get(KEYS[2], db=pages))
        value[-1] ^= 0xFF  # payload damaged: fails its checksum (or does not decode)
        txn.put(KEYS[2], bytes(value), db=pages)
    env.close()
    store = make_store(0, 8, tmp_path, codec=codec, limits=MANY_THREADS)
    restored = restore(store, KEYS[:6], ahead)
    assert restored.sources == [Source.L3] * 2
    assert same_bytes(joined(restored), mx.concatenate(SMALL[:2], axis=3))
    assert store.disk.counters.checksum_failures == 1
    assert KEYS[2] not in store.l2
    if codec == "raw":  # read from the map: nothing kept in L2, a hit counted per page checked good
        assert not store.l2.entries and store.disk.counters.hit_pages == 2
    else:  # three threads decoded two pages each: the third's pages, past the cut, are kept
        assert set(store.l2) == {KEYS[0], KEYS[1], KEYS[4], KEYS[5]}
    for key in store.l2:  # pages past the cut that a thread decoded whole are kept, intact
        assert np.array_equal(store.l2.read(key), kv_to_host(SMALL[KEYS.index(key)]))
    assert [k for k in KEYS[:6] if store.keeping.pinned(k)] == KEYS[:2]
    assert len(store.l2.entries) + len(store.l2.free_slots) == store.l2.max_pages
    store.release(restored.keys)
    store.close()


@pytest.mark.parametrize("l1_pages", [4, 0])
def test_l3_hit_placement(tmp_path, l1_pages):
    """A raw L3 page goes straight into the request's KV (L3->L1) and is not kept in L2;
    a compressed one is decoded into L2 and kept there (L3->L2, then L2->L1). Either
    is then kept in L1 when L1 has room: the next restore is an L1 hit."""
    for codec, links, below in (("raw", {"L3->L1"}, Source.L3), ("zstd", {"L3->L2", "L2->L1"}, Source.L2)):
        store = make_store(0, 0, tmp_path / codec, codec=codec)
        publish(store, 0, data=SMALL)
        store.close()
        store = make_store(l1_pages, 4, tmp_path / codec, codec=codec)
        restored = store.restore(KEYS[:1], TOKENS)
        assert restored.sources == [Source.L3]
        assert same_bytes(joined(restored), SMALL[0])
        assert {name for name, link in store.links.items() if link.pages} == links
        assert all(store.links[name].pages == 1 for name in links)
        assert (KEYS[0] in store.l2) == (below is Source.L2)
        assert (KEYS[0] in store.l1) == bool(l1_pages)
        store.release(restored.keys)
        again = store.restore(KEYS[:1], TOKENS)
        assert again.sources == [Source.L1 if l1_pages else below]
        assert same_bytes(joined(again), SMALL[0])
        store.release(again.keys)
        store.close()


def test_a_page_restored_from_l2_is_kept_in_l1_once():
    """An L2 page restored into a request is copied into L1 (L2 keeps its copy: placement
    is inclusive); restoring it again reads L1 and adds no copy."""
    store = make_store(1, 2)
    publish(store, 0, 1)  # page 0 is pushed down to L2 by page 1
    assert store.locate(KEYS[:2], TOKENS) == [Source.L2, Source.L1]
    restored = store.restore(KEYS[:1], TOKENS)
    store.release(restored.keys)
    assert KEYS[0] in store.l1 and KEYS[0] in store.l2 and KEYS[1] in store.l2
    assert store.l1.counters.bytes_used == PAGE, "L1's cap holds: page 1 made room"
    again = store.restore(KEYS[:1], TOKENS)
    assert again.sources == [Source.L1] and same_bytes(joined(again), KV[0])
    assert store.links["L2->L1"].pages == 1
    store.release(again.keys)
    store.close()


@pytest.mark.parametrize("below", [Source.L2, Source.L3])
def test_a_page_computed_over_one_stored_below_l1_is_kept_in_l1(tmp_path, below):
    """A request that computes pages L2 or L3 hold (its plan computes the first pages
    while the later ones load, or loads only some) publishes them into L1 like the pages
    it restored: the next request finds every page in L1, none read from below twice."""
    if below is Source.L3:
        store = make_store(0, 0, tmp_path)
        publish(store, 0, 1)
        store.close()
        store = make_store(4, 4, tmp_path)  # a restart: L1 and L2 empty
    else:
        store = make_store(2, 4)
        publish(store, 0, 1, 2, 3)  # pages 2 and 3 pushed pages 0 and 1 down to L2
    loaded = store.finish(store.begin(KEYS[:2], TOKENS, first=1))  # page 0 computed meanwhile
    store.release(loaded.keys)
    assert store.publish(KEYS[0], page_tokens(0), KV[0], parent=NS.digest())
    assert store.locate(KEYS[:2], TOKENS) == [Source.L1, Source.L1]
    assert not store.publish(KEYS[0], page_tokens(0), KV[0]), "L1 has it: nothing to add"
    again = store.restore(KEYS[:2], TOKENS)
    assert again.sources == [Source.L1, Source.L1] and same_bytes(joined(again), mx.concatenate(KV[:2], axis=3))
    store.release(again.keys)
    store.close()


def test_begin_leaves_l1_pages_to_the_joining_thread(tmp_path):
    """``begin`` runs beside the model (an overlapped restore's loader): it must not read
    device arrays. An L1 page's bytes are read by ``finish``, on the model's thread."""
    store = make_store(4, 4, tmp_path)
    publish(store, 0, 1)  # in L1
    store.keeping.flush()
    reads = []
    real = restore_module.kv_to_host
    restore_module.kv_to_host = lambda kv: reads.append(threading.current_thread()) or real(kv)
    try:
        with ThreadPoolExecutor(1) as loader:
            pending = loader.submit(store.begin, KEYS[:2], TOKENS, 0, True).result()
        assert reads == []
        restored = store.finish(pending)
    finally:
        restore_module.kv_to_host = real
    assert reads == [threading.current_thread()] * 2
    assert restored.sources == [Source.L1] * 2
    assert same_bytes(joined(restored), mx.concatenate(KV[:2], axis=3))
    store.release(restored.keys)
    store.close()


@pytest.mark.parametrize("stage", ["begin", "finish"])
def test_a_failing_restore_leaves_nothing_pinned(tmp_path, monkeypatch, stage):
    store = make_store(4, 4, tmp_path)
    publish(store, 0, 1, 2)

    def broken(*args, **kwargs):
        raise OSError("injected")

    monkeypatch.setattr(store.restorer, "decode_compressed" if stage == "begin" else "join", broken)
    with pytest.raises(OSError):
        store.restore(KEYS[:3], TOKENS)
    assert store.accounts.view().pins == {}
    store.close()


def test_pins_block_eviction():
    store = make_store(2, 0)
    publish(store, 0, 1)
    restored = store.restore(KEYS[:1], TOKENS)
    publish(store, 2, 3, 4)
    assert KEYS[0] in store.l1, "a pinned page was evicted"
    store.release(restored.keys)
    publish(store, 5, 6)
    assert KEYS[0] not in store.l1, "an unpinned page must become evictable"


def test_all_pinned_tier_refuses_instead_of_overflowing():
    store = make_store(1, 0)
    publish(store, 0)
    store.restore(KEYS[:1], TOKENS)
    publish(store, 1)  # no room anywhere: dropped and counted
    assert store.l1.counters.bytes_used <= PAGE
    assert KEYS[1] not in store.l1 and store.l2.counters.writes_dropped == 1


def test_spilling_a_page_already_in_l3_writes_nothing(tmp_path):
    store = make_store(0, 1, tmp_path)
    publish(store, 0)
    store.keeping.flush()
    written = store.links["L2->L3"].bytes + store.links["L1->L3"].bytes
    assert written == PAGE
    publish(store, 1)  # evicts page 0 from L2; L3 has it already
    assert store.links["L2->L3"].bytes + store.links["L1->L3"].bytes == written
    store.close()


def test_close_flushes_more_pages_than_the_write_queue_holds(tmp_path):
    tokens = list(range(4 * 100))
    keys = page_keys(NS, tokens)
    store = make_store(100, 0, tmp_path)
    for i, key in enumerate(keys):
        store.publish(key, tokens[4 * i : 4 * i + 4], KV[i % 16])
    store.close()
    reopened = make_store(0, 0, tmp_path)
    assert len(reopened.locate(keys, tokens)) == 100
    assert reopened.disk.counters.writes_dropped == 0
    reopened.close()


def test_namespaces_never_share_pages(tmp_path):
    store = make_store(4, 4, tmp_path)
    publish(store, 0, 1)
    store.close()
    salted = Namespace("test-model", "bfloat16", 4, cache_salt="tenant-b")
    other = make_store(4, 4, tmp_path, namespace=salted)
    assert other.locate(page_keys(salted, TOKENS)[:2], TOKENS) == []
    other.close()
    same = make_store(4, 4, tmp_path)
    assert same.locate(KEYS[:2], TOKENS) == [Source.L3, Source.L3]
    same.close()


def test_token_mismatch_is_a_miss():
    store = make_store(4, 4)
    publish(store, 0)
    wrong = [7] * 4 + TOKENS[4:]
    assert store.locate(KEYS[:1], wrong) == []
    assert store.restore(KEYS[:1], wrong).num_pages == 0


def test_counters_persist_across_reopen(tmp_path):
    store = make_store(1, 1, tmp_path)
    publish(store, 0, 1, 2)
    store.close(extra_counters={"engine": {"requests": 3}})
    store = make_store(1, 1, tmp_path)
    publish(store, 3, 4, 5)
    store.close(extra_counters={"engine": {"requests": 2}})
    store = make_store(1, 1, tmp_path)
    saved = store.disk.tables.persistent_counters()
    assert saved["engine"]["requests"] == 5
    assert saved["tiers"]["L1"]["inserts"] == 6
    assert store.disk.counters.pages == 6
    store.close()


class TierMachine(RuleBasedStateMachine):
    """Random publish / restore / release: caps hold and pinned pages stay put."""

    def __init__(self):
        super().__init__()
        self.store = make_store(3, 2)
        self.pinned: list[list] = []  # one list of keys per outstanding restore
        self.resident: dict = {}  # pinned key -> tier set it must stay in

    @rule(i=st.integers(0, 15))
    def publish(self, i):
        publish(self.store, i)

    @rule(n=st.integers(1, 6))
    def restore(self, n):
        restored = self.store.restore(KEYS[:n], TOKENS)
        for key in restored.keys:
            tier = self.store.l1 if key in self.store.l1 else self.store.l2 if key in self.store.l2 else None
            if tier is not None:
                self.resident.setdefault(key, tier)
        self.pinned.append(restored.keys)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def release(self, data):
        keys = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.store.release(keys)
        for key in keys:
            if not self.store.keeping.pinned(key):
                self.resident.pop(key, None)

    @invariant()
    def caps_hold(self):
        for tier in (self.store.l1, self.store.l2):
            assert tier.counters.bytes_used <= tier.counters.capacity
            assert len(tier.entries) * PAGE == tier.counters.bytes_used

    @invariant()
    def pinned_pages_stay(self):
        for key, tier in self.resident.items():
            assert key in tier, f"pinned page left {tier.name}"


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_locate_sees_every_tier(tmp_path):
    store = make_store(1, 1, tmp_path)
    publish(store, 0, 1, 2)  # 2 in L1, 1 in L2, 0 spilled to L3
    store.keeping.flush()
    assert store.locate(KEYS[:4], TOKENS) == [Source.L3, Source.L2, Source.L1]
    assert [store.has(k) for k in KEYS[:4]] == [True, True, True, False]
    assert KEYS[0] not in store.l1 and KEYS[0] not in store.l2
    store.close()


# -- partial pages: the shared start of an L1 page ---------------------------------


def test_a_partial_match_is_the_longest_shared_start_after_a_page():
    store = make_store(8, 8)
    store.publish(KEYS[0], page_tokens(0), KV[0], parent=NS.digest())
    store.publish(KEYS[1], page_tokens(1), KV[1], parent=KEYS[0])
    tail = KV[2][:, :, :, :3]
    assert store.partials.publish(KEYS[1], page_tokens(2)[:3], tail)
    assert not store.partials.publish(KEYS[1], page_tokens(2)[:3], tail), "already there"
    other = [page_tokens(2)[0], 7, 7]  # shares one token only
    assert store.partials.publish(KEYS[1], other, KV[3][:, :, :, :3])

    match = store.partials.match(KEYS[1], page_tokens(2)[:2] + [9, 9])
    assert match.num_tokens == 2 and same_bytes(match.kv, KV[2][:, :, :, :2])
    assert store.partials.match(KEYS[1], [5]) is None, "no token shared"
    assert store.partials.match(KEYS[0], page_tokens(2)) is None, "another parent's pages are not candidates"
    # a full page is a candidate too: a prompt that leaves page 1 midway shares its start
    match = store.partials.match(KEYS[0], page_tokens(1)[:3] + [1])
    assert match.key == KEYS[1] and same_bytes(match.kv, KV[1][:, :, :, :3])
    assert store.l1.counters.hit_tokens == 2 + 3


def test_partial_pages_stay_in_l1_evicted_they_are_dropped_never_flushed(tmp_path):
    store = make_store(2, 4, tmp_path)
    store.publish(KEYS[0], page_tokens(0), KV[0], parent=NS.digest())
    store.partials.publish(KEYS[0], page_tokens(1)[:2], KV[1][:, :, :, :2])
    store.keeping.flush()
    assert store.stats().tiers["L3"].inserts == 1, "only the full page goes down"
    publish(store, 2, 3)  # L1 holds 2 pages: both earlier ones leave it
    assert store.l1.counters.pages == 2 and store.l2.counters.pages == 1, "the partial page was dropped"
    assert store.partials.match(KEYS[0], page_tokens(1)) is None
    assert store.l1.following(KEYS[0]) == store.l1.following(NS.digest()) == []
    store.close()


def test_the_l1_follower_index_forgets_parents_whose_pages_left():
    """L1's index of pages by their previous page holds a parent only while one of its
    pages is in L1: pages coming and going under ever new parents never grow it."""
    store = make_store(2, 0)
    for i in range(6):  # each page evicts the one before last: L1 holds 2 pages
        store.publish(KEYS[i], page_tokens(i), KV[i], parent=KEYS[i - 1] if i else NS.digest())
        store.partials.publish(KEYS[i], page_tokens(i + 1)[:2], KV[i + 1][:, :, :, :2])
        view = store.accounts.view().l1
        assert view.follower_pages == view.pages == 2
        assert view.follower_parents <= view.pages
    for key in list(store.l1):
        store.l1.pop(key)
    assert store.accounts.view().l1 == replace(view, pages=0, bytes_used=0, follower_parents=0, follower_pages=0)
