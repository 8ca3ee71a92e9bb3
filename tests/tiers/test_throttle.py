"""StoreConfig.throttle: reads from a throttled tier take at least bytes / rate, and
the link counters (what the cost model is fed) show that time."""

import time

import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Source
from tests.tiers.small_pages import GEOMETRY, KEYS, NS, PAGE, SMALL, TOKENS, publish

PAGES = 8
RATE = 16 * PAGE * PAGES  # bytes/s: the 8-page prefix (~2 KiB raw) takes >= 1/16 s from a throttled tier


def make_store(l1_pages, l2_pages, store_dir=None, throttle=None, codec="raw") -> TieredStore:
    config = StoreConfig(l1_pages * PAGE, l2_pages * PAGE, 256 * PAGE, store_dir, codec, throttle or {})
    return TieredStore(GEOMETRY, NS, config)


def timed_restore(store):
    t0 = time.perf_counter()
    restored = store.restore(KEYS[:PAGES], TOKENS)
    seconds = time.perf_counter() - t0
    store.release(restored.keys)
    return restored, seconds


@pytest.mark.parametrize("codec, link, joined", [("raw", "L3->L1", None), ("zstd", "L3->L2", "L2->L1")])
def test_l3_throttle_slows_the_read_and_shows_on_the_l3_link(tmp_path, codec, link, joined):
    store = make_store(0, 0, tmp_path, codec=codec)
    publish(store, *range(PAGES), data=SMALL)  # compressible: zstd pages go through L2
    store.close()
    store = make_store(0, PAGES, tmp_path, throttle={"L3": RATE}, codec=codec)
    restored, seconds = timed_restore(store)
    assert restored.sources == [Source.L3] * PAGES
    read = store.links[link]
    assert read.pages == PAGES and read.bytes > 0  # record bytes: header + payload
    floor = read.bytes / RATE
    assert seconds >= floor and read.seconds >= floor
    if joined:
        assert store.links[joined].seconds < floor, "only the L3 link is throttled"
    store.close()


def test_l2_throttle_slows_the_join_and_shows_in_l2_to_l1():
    store = make_store(0, PAGES, throttle={"L2": RATE})
    publish(store, *range(PAGES))
    restored, seconds = timed_restore(store)
    assert restored.sources == [Source.L2] * PAGES
    link = store.links["L2->L1"]
    floor = PAGES * PAGE / RATE
    assert link.bytes == PAGES * PAGE and link.pages == PAGES
    assert seconds >= floor and link.seconds >= floor


def test_unthrottled_and_l1_restores_do_not_wait():
    floor = PAGES * PAGE / RATE
    plain = make_store(0, PAGES)
    publish(plain, *range(PAGES))
    assert timed_restore(plain)[1] < floor
    in_l1 = make_store(PAGES, PAGES, throttle={"L2": RATE, "L3": RATE})
    publish(in_l1, *range(PAGES))
    restored, seconds = timed_restore(in_l1)
    assert restored.sources == [Source.L1] * PAGES and seconds < floor
    assert in_l1.links["L2->L1"].pages == 0


@pytest.mark.parametrize("throttle", [{"L1": 1.0}, {"L3": 0}, {"L2": -5.0}])
def test_bad_throttle_is_refused(throttle):
    with pytest.raises(ValueError):
        make_store(1, 1, throttle=throttle)
