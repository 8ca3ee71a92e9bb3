"""S3-FIFO (tiers/policy.py): a scan of one-hit pages passes through the small queue and
leaves the reused pages of the main queue alone; a ghost's return goes straight to main;
pins are never victims; a store with it keeps lru's order in L3."""

import mlx.core as mx

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.policy import EvictionPolicy, S3FifoPolicy, make_policy

NOT_PINNED = lambda key: False  # noqa: E731


def access(policy: EvictionPolicy, held: set[bytes], capacity: int, key: bytes) -> None:
    """One access to a cache of ``capacity`` keys ordered by ``policy`` (as a tier uses it)."""
    if key in held:
        policy.used(key)
        return
    if len(held) >= capacity:
        victim = policy.victim(NOT_PINNED)
        assert victim in held
        policy.removed(victim)
        held.discard(victim)
    policy.added(key)
    held.add(key)


def test_a_scan_of_one_hit_pages_leaves_the_reused_ones():
    hot = [b"hot%d" % i for i in range(6)]
    kept = {}
    for name in ("lru", "s3fifo"):
        policy, held = make_policy(name), set()
        for key in hot * 2:  # each used once after it came
            access(policy, held, 10, key)
        for i in range(100):  # one-hit pages, ten times the cache
            access(policy, held, 10, b"scan%d" % i)
            assert len(held) <= 10
        kept[name] = held & set(hot)
    assert kept == {"lru": set(), "s3fifo": set(hot)}


def test_a_ghost_coming_back_goes_to_the_main_queue():
    policy, held = S3FifoPolicy(), set()
    for key in (b"a", b"b", b"c"):  # a leaves unused: a ghost
        access(policy, held, 2, key)
    assert b"a" not in held and b"a" in policy.ghost
    access(policy, held, 2, b"a")
    assert b"a" in policy.main and b"a" not in policy.ghost


def test_a_pinned_page_is_never_the_victim():
    policy = S3FifoPolicy()
    for key in (b"a", b"b", b"c"):
        policy.added(key)
    assert policy.victim(lambda key: key == b"a") == b"b"
    assert policy.victim(lambda key: True) is None


GEOMETRY = PageGeometry(1, 1, 1, 4, "float16")
NS = Namespace("s3fifo-test", "float16", 4)
TOKENS = list(range(12))
KEYS = page_keys(NS, TOKENS)


def test_a_store_with_s3fifo_keeps_lru_order_in_l3(tmp_path):
    config = StoreConfig(policy="s3fifo", l1_bytes=1000, l2_bytes=0, l3_bytes=2000, page_bytes=1000, store_dir=tmp_path)
    with TieredStore(GEOMETRY, NS, config) as store:
        kv = mx.zeros(GEOMETRY.shape, dtype=mx.float16)
        for i in range(3):  # each pushes the one before down to L3; L3 holds two
            store.publish(KEYS[i], TOKENS[4 * i : 4 * i + 4], kv)
        store.keeping.flush()
        assert [store.has(key) for key in KEYS] == [False, True, True]
