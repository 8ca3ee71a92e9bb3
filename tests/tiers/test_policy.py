"""Eviction policies and the L3 admission filter (tiers/policy.py), and their hooks in
the tiers: victims, aging, pins, accounted page sizes, L3 eviction order."""

import mlx.core as mx
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.policy import CostPolicy, EvictionPolicy, L3Admission, make_policy

NOT_PINNED = lambda key: False  # noqa: E731


def test_lru_evicts_least_recently_used_unpinned():
    lru = EvictionPolicy()
    for key in (b"a", b"b", b"c"):
        lru.added(key)
    lru.used(b"a")
    assert lru.victim(NOT_PINNED) == b"b"
    assert lru.victim(lambda key: key == b"b") == b"c"
    assert lru.victim(lambda key: True) is None


def test_cost_keeps_the_page_used_more_then_ages_it_out():
    cost = CostPolicy()
    cost.added(b"hot")
    cost.used(b"hot")
    cost.used(b"hot")  # priority 3, clock 0
    evicted = []
    for key in (b"x", b"y", b"z"):  # a stream of one-off pages, one slot for them
        cost.added(key)
        victim = cost.victim(NOT_PINNED)
        cost.removed(victim)
        evicted.append(victim)
    # x (1) and y (clock 1 + 1) go first; z ties hot at 3 and hot, the older, leaves
    assert evicted == [b"x", b"y", b"hot"]
    assert cost.clock == 3


def test_cost_keeps_the_page_whose_loss_costs_more():
    cost = CostPolicy()
    cost.added(b"deep", cost=5.0)
    cost.added(b"shallow", cost=1.0)
    assert cost.victim(NOT_PINNED) == b"shallow"
    assert cost.victim(lambda key: key == b"shallow") == b"deep"
    assert cost.victim(lambda key: True) is None
    assert cost.victim(NOT_PINNED) == b"shallow"  # skipped pinned entries are kept


def test_unknown_policy_and_admission_are_refused():
    with pytest.raises(ValueError, match="eviction policy"):
        make_policy("mru")
    with pytest.raises(ValueError, match="admission"):
        L3Admission("never")


def test_second_use_admits_a_page_only_once_seen_twice():
    admit = L3Admission("second-use")
    admit.seen(b"a")
    assert not admit.admits(b"a")
    admit.seen(b"a")
    assert admit.admits(b"a")
    assert not admit.admits(b"b")
    assert admit.rejected == 2
    assert L3Admission("always").admits(b"b")


GEOMETRY = PageGeometry(1, 1, 1, 4, "float16")  # 16 bytes a page
NS = Namespace("policy-test", "float16", 4)
TOKENS = list(range(40))
KEYS = page_keys(NS, TOKENS)
KV = mx.zeros(GEOMETRY.shape, dtype=mx.float16)


def store(policy: str, **caps) -> TieredStore:
    return TieredStore(GEOMETRY, NS, StoreConfig(policy=policy, page_bytes=1000, **caps))


FIRST = [page_keys(NS, TOKENS[4 * i : 4 * i + 4])[0] for i in range(3)]  # three one-page prompts


@pytest.mark.parametrize("policy, kept", [("lru", [1, 2]), ("cost", [0, 2])])
def test_l1_victim_follows_the_policy(policy, kept):
    s = store(policy, l1_bytes=2000, l2_bytes=0)
    for i in (0, 1):
        s.publish(FIRST[i], TOKENS[4 * i : 4 * i + 4], KV)
    for _ in range(3):  # page 0 used more often, page 1 more recently
        s.release(s.restore(FIRST[:1], TOKENS[:4]).keys)
    s.release(s.restore(FIRST[1:2], TOKENS[4:8]).keys)
    s.publish(FIRST[2], TOKENS[8:12], KV)
    assert sorted(FIRST.index(k) for k in s.l1) == kept


def test_caps_count_accounted_page_bytes():
    s = store("lru", l1_bytes=2500, l2_bytes=1000)  # room for 2 pages of 1000 in L1, 1 in L2
    for i in range(4):
        s.publish(KEYS[i], TOKENS[4 * i : 4 * i + 4], KV)
    tiers = s.stats().tiers
    assert (tiers["L1"].pages, tiers["L1"].bytes_used) == (2, 2000)
    assert (tiers["L2"].pages, tiers["L2"].bytes_used) == (1, 1000)
    assert (tiers["L1"].evictions, tiers["L2"].evictions) == (2, 1)  # no L3: the oldest is gone


def test_l3_admission_refuses_a_page_seen_once(tmp_path):
    s = TieredStore(GEOMETRY, NS, StoreConfig(l1_bytes=16, l2_bytes=0, store_dir=tmp_path, l3_admit="second-use"))
    s.publish(KEYS[0], TOKENS[:4], KV)
    s.publish(KEYS[1], TOKENS[4:8], KV)  # page 0 leaves L1 having been seen once: not written
    s.publish(KEYS[0], TOKENS[:4], KV)  # seen again (recomputed); page 1 leaves unseen twice
    s.publish(KEYS[1], TOKENS[4:8], KV)  # page 0 leaves, seen twice: written
    s.settle()
    assert s.stats().tiers["L3"].inserts == 1
    assert s.locate(KEYS[:1], TOKENS) == ["L3"]
    assert s.admission.rejected == 2
    s.close()


def put(tier: DiskTier, key: bytes) -> None:
    tier.put(key, b"ns", [1], b"payload", wait=True)
    tier.flush()


def use(tier: DiskTier, key: bytes) -> None:
    assert tier.get(key, b"ns", [1], 7) is not None
    tier.flush()


@pytest.mark.parametrize("policy, evicted", [("lru", b"b"), ("cost", b"a")])
def test_l3_evicts_by_policy_and_counts_record_bytes(tmp_path, policy, evicted):
    tier = DiskTier(tmp_path, 2000, record_bytes=1000, policy=policy)
    put(tier, b"a")
    put(tier, b"b")
    assert tier.counters.bytes_used == 2000
    use(tier, b"b")
    use(tier, b"b")
    use(tier, b"a")  # a: most recent; b: more uses
    put(tier, b"c")
    assert not tier.contains(evicted) and tier.contains(b"c")
    assert (tier.counters.bytes_used, tier.counters.pages) == (2000, 2)
    tier.close()


def test_l3_cost_order_ages_a_hot_page_out(tmp_path):
    """hot is used 3 times; one-off pages pass through the other slot, each leaving
    raises the clock, until a newcomer ties hot and hot, the older, leaves."""
    tier = DiskTier(tmp_path, 2000, record_bytes=1000, policy="cost")
    put(tier, b"hot")
    use(tier, b"hot")
    use(tier, b"hot")
    for key in (b"x", b"y", b"z"):
        put(tier, key)
    assert tier.contains(b"hot")
    put(tier, b"w")
    assert not tier.contains(b"hot") and tier.contains(b"z") and tier.contains(b"w")
    tier.close()


def test_published_cost_orders_l1():
    s = store("cost", l1_bytes=2000, l2_bytes=0)
    s.publish(KEYS[0], TOKENS[:4], KV, cost=5.0)  # deeper in a prompt: dearer to recompute
    s.publish(KEYS[1], TOKENS[4:8], KV, cost=1.0)
    s.publish(KEYS[2], TOKENS[8:12], KV, cost=1.0)
    assert sorted(KEYS.index(k) for k in s.l1) == [0, 2]


def test_second_use_forgets_the_least_recently_seen_beyond_its_memory():
    admit = L3Admission("second-use", memory=2)
    for key in (b"a", b"a", b"b", b"c", b"b"):  # a, seen twice, is forgotten when c arrives
        admit.seen(key)
    assert not admit.admits(b"a") and admit.admits(b"b")


def test_a_restore_counts_as_a_sighting(tmp_path):
    s = TieredStore(GEOMETRY, NS, StoreConfig(l1_bytes=16, l2_bytes=0, store_dir=tmp_path, l3_admit="second-use"))
    s.publish(KEYS[0], TOKENS[:4], KV)
    s.release(s.restore(KEYS[:1], TOKENS).keys)  # seen a second time
    s.publish(KEYS[1], TOKENS[4:8], KV)  # page 0 leaves L1: written
    s.settle()
    assert s.stats().tiers["L3"].inserts == 1
    s.close()
