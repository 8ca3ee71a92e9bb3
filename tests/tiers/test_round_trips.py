"""Round trips to a remote L3 are bounded by a constant, not by pages: a restore asks
once and reads in one batch, publishing and spilling ask nothing on the caller's thread,
a page known to be in L3 is never written again, and a server down at start joins when
it answers (``tests/redis_servers.SlowProxy`` counts the round trips)."""

import logging
import time

import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Source

from ..redis_servers import SlowProxy, needs_redis, redis_server  # noqa: F401
from .small_pages import GEOMETRY, KEYS, KV, NS, PAGE, TOKENS

pytestmark = [pytest.mark.slow, needs_redis]  # each starts a redis-server


def store_at(url: str, l1_pages: int, l2_pages: int) -> TieredStore:
    return TieredStore(GEOMETRY, NS, StoreConfig(l1_pages * PAGE, l2_pages * PAGE, None, url, l3_queue_pages=64))


def publish(store: TieredStore, pages: range) -> None:
    for i in pages:
        store.publish(KEYS[i], TOKENS[i * 4 : (i + 1) * 4], KV[i])


@pytest.mark.parametrize("n", [2, 16])
def test_a_restore_costs_the_same_round_trips_whatever_its_pages(redis_server, n):
    with store_at(redis_server.url, 0, 0) as first:
        publish(first, range(n))
    proxy = SlowProxy(redis_server.port)
    store = store_at(proxy.url, n, 0)
    before = proxy.round_trips
    assert store.locate(KEYS[:n], TOKENS) == [Source.L3] * n
    restored = store.restore(KEYS[:n], TOKENS)
    assert restored.num_pages == n
    assert proxy.round_trips - before == 2  # one pipelined EXISTS, one MGET
    store.release(restored.keys)
    store.keeping.flush()  # the restored pages (in L1 now) are known to be in L3: none is written again
    assert store.links["L1->L3"].pages == 0 and store.links["L2->L3"].pages == 0
    store.close()
    proxy.close()


def test_publishing_and_spilling_asks_nothing_on_the_callers_thread(redis_server):
    n = 16
    proxy = SlowProxy(redis_server.port, delay=0.2)  # a synchronous ask per page would show here
    store = store_at(proxy.url, 1, 2)
    before = proxy.round_trips
    publish(store, range(n))  # n - 3 pages spill to L3
    asked = proxy.round_trips - before
    assert asked <= 1, f"{asked} requests reached the server while publishing (the writer sends at most its first)"
    store.settle()
    assert store.disk.counters.inserts == n - 3 and store.links["L2->L3"].pages == n - 3
    store.close()
    proxy.close()


def test_the_writer_does_not_send_a_page_the_server_holds(redis_server):
    with store_at(redis_server.url, 0, 0) as first:
        publish(first, range(4))
    client = redis_server.client()
    client.config_resetstat()
    with store_at(redis_server.url, 0, 0) as second:  # L1 and L2 hold nothing: every page goes to L3
        publish(second, range(6))
        second.settle()
        assert second.disk.counters.inserts == 2
    assert client.info("commandstats")["cmdstat_set"]["calls"] == 2  # pages 4 and 5 only


def test_a_server_down_at_start_joins_when_it_answers(redis_server, caplog):
    redis_server.stop()
    with caplog.at_level(logging.WARNING):
        store = store_at(redis_server.url, 0, 0)
    assert store.disk is None and not store.accounts.view().l3_open and store.accounts.degraded() == ["L3"]
    assert any("retried in the background" in r.getMessage() for r in caplog.records)
    redis_server.start()
    deadline = time.monotonic() + 10
    while not store.accounts.view().l3_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.accounts.view().l3_open and store.accounts.degraded() == []
    publish(store, range(2))
    store.settle()
    assert redis_server.client().exists(b"kvtier:p:" + KEYS[0], b"kvtier:p:" + KEYS[1]) == 2
    store.close()
