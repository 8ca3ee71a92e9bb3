"""L3 on Redis: the record codec and the backend interface behave as on LMDB, a restore
takes a bounded number of round trips, and no fault of the server fails a request."""

import json
import logging
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

from kvtier.costmodel.calibrate import link_samples
from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import plan_restore
from kvtier.costmodel.profile import Profile
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.open import open_l3
from kvtier.tiers.l3.record import FORMAT_VERSION, RECORD_VERSION, RecordHeader, token_bytes
from kvtier.tiers.l3.redis_store import RedisTier
from kvtier.tiers.l3.writer import PendingPut
from kvtier.tiers.page import Source
from kvtier.tiers.tier import kv_to_host

from .. import cli
from ..redis_servers import SlowProxy, free_port, needs_redis, redis_cluster, redis_server, redis_tls_server  # noqa: F401
from .small_pages import GEOMETRY, KEYS, KV, NS, PAGE, TOKENS

pytestmark = [pytest.mark.slow, needs_redis]


def make_store(url: str, l2_pages: int = 0) -> TieredStore:
    return TieredStore(GEOMETRY, NS, StoreConfig(0, l2_pages * PAGE, None, url))


def fill(url: str, n: int) -> None:
    """Compute pages 0..n-1 in one store and leave them in L3 only."""
    store = make_store(url)
    for i in range(n):
        store.publish(KEYS[i], TOKENS[i * 4 : (i + 1) * 4], KV[i])
    store.close()


def restored_pages(url: str, n: int) -> tuple[list[Source], list[np.ndarray]]:
    """What a fresh store (empty L1, L2) restores of pages 0..n-1: sources and each
    page's bytes in page layout."""
    store = make_store(url, l2_pages=n)
    restored = store.restore(KEYS[:n], TOKENS)
    joined = mx.stack([mx.concatenate([k, v]) for k, v in restored.layers])  # (layers, 2, heads, tokens, dim)
    pages = [kv_to_host(joined[:, :, :, i * 4 : (i + 1) * 4, :]) for i in range(restored.num_pages)]
    store.release(restored.keys)
    store.close()
    return restored.sources, pages


def test_a_second_store_restores_the_exact_pages_and_counters_and_meta_persist(redis_server):
    fill(redis_server.url, 6)
    sources, pages = restored_pages(redis_server.url, 6)
    assert sources == [Source.L3] * 6
    assert all(np.array_equal(page, kv_to_host(KV[i])) for i, page in enumerate(pages))
    with RedisTier(redis_server.url) as tier:
        counters = tier.tables.persistent_counters()
        assert counters["tiers"]["L3"]["inserts"] == 6 and counters["tiers"]["L3"]["hit_pages"] == 6
        tier.tables.put_meta("profile/x", {"a": [1, 2]})
    with RedisTier(redis_server.url, readonly=True) as tier:
        assert tier.tables.get_meta("profile/x") == {"a": [1, 2]} and tier.backend == "redis"


def test_a_tls_url_stores_and_restores(redis_tls_server):
    fill(redis_tls_server.url, 2)
    sources, pages = restored_pages(redis_tls_server.url, 2)
    assert sources == [Source.L3] * 2 and all(np.array_equal(p, kv_to_host(KV[i])) for i, p in enumerate(pages))


def test_write_once_keeps_the_first_value(redis_server):
    with RedisTier(redis_server.url) as tier:
        tier.put(KEYS[0], NS.digest(), TOKENS[:4], b"a" * PAGE)
        tier.flush()
        second = PendingPut(KEYS[0], NS.digest(), token_bytes(TOKENS[:4]), b"b" * PAGE)
        assert tier.writer.put(second, wait=True)  # another host's write of the same page, raced past put's check
        tier.flush()
        assert tier.get(KEYS[0], NS.digest(), TOKENS[:4], PAGE)[0] == b"a" * PAGE
        assert tier.counters.inserts == 1


def test_cluster_url_stores_and_restores(redis_cluster):
    fill(redis_cluster.url, 8)
    sources, pages = restored_pages(redis_cluster.url, 8)
    assert sources == [Source.L3] * 8
    assert all(np.array_equal(page, kv_to_host(KV[i])) for i, page in enumerate(pages))
    spread = [n.client().dbsize() for n in redis_cluster.nodes]
    assert sum(spread) >= 8 and sum(1 for n in spread if n) >= 2  # the pages went to several shards
    with RedisTier(redis_cluster.url) as tier:
        assert tier.clear()[0] == 8 and tier.stored_prefix(KEYS[:8]) == 0


@pytest.mark.parametrize("setting", [("maxmemory", "0"), ("maxmemory-policy", "noeviction")])
def test_a_server_that_will_not_evict_is_warned_about_once(redis_server, caplog, setting):
    redis_server.client().config_set(*setting)
    with caplog.at_level(logging.WARNING):
        RedisTier(redis_server.url).close()
        RedisTier(redis_server.url).close()
    assert len([r for r in caplog.records if "maxmemory-policy allkeys-lru" in r.getMessage()]) == 1


def test_a_restore_takes_a_bounded_number_of_round_trips(redis_server):
    n = 12
    fill(redis_server.url, n)
    client = redis_server.client()
    client.config_resetstat()
    proxy = SlowProxy(redis_server.port)
    store = make_store(proxy.url, l2_pages=n)
    before = proxy.round_trips
    assert store.locate(KEYS[:n], TOKENS) == [Source.L3] * n
    assert proxy.round_trips == before + 1  # one pipelined EXISTS for all pages
    restored = store.restore(KEYS[:n], TOKENS)
    assert restored.num_pages == n
    assert proxy.round_trips == before + 2  # one MGET
    stats = client.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    assert store.links["L3->L1"].pages == n and store.links["L3->L1"].seconds > 0
    store.release(restored.keys)
    store.close()
    proxy.close()


def test_the_server_evicts_under_its_cap_and_an_evicted_page_is_a_miss(redis_server):
    client = redis_server.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (1 << 20))  # 1 MiB of room
    keys = [bytes([i]) * 16 for i in range(40)]
    with RedisTier(redis_server.url, queue_pages=40) as tier:
        for i, key in enumerate(keys):  # 2.5 MiB of pages
            tier.put(key, NS.digest(), [i], bytes([i]) * (64 << 10))
        tier.flush()
        got = [tier.get(key, NS.digest(), [i], 64 << 10) for i, key in enumerate(keys)]
        kept = sum(g is not None for g in got)
        assert 0 < kept < 40 and tier.counters.inserts == 40
        assert all(g is None or g[0] == bytes([i]) * (64 << 10) for i, g in enumerate(got))
        assert tier.counters.evictions >= 40 - kept  # the server's count (it may evict side keys too)
        assert tier.counters.capacity == int(client.config_get("maxmemory")["maxmemory"])


def test_redis_down_at_start_runs_without_l3_until_it_answers(caplog):
    url = f"redis://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING):
        store = make_store(url)
    assert store.disk is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"running without L3 until it answers (retried in the background): cannot use Redis store {url}: "
        f"Error 111 connecting to 127.0.0.1:{url.rsplit(':', 1)[1]}. Connection refused."
    ]
    store.close()
    with pytest.raises(StoreError):
        open_l3(url)


def test_killed_mid_run_misses_then_reconnects(redis_server):
    fill(redis_server.url, 2)
    tier = RedisTier(redis_server.url)
    redis_server.stop()
    assert not tier.contains(KEYS[0])
    assert tier.get(KEYS[0], NS.digest(), TOKENS[:4], PAGE) is None
    assert tier.put(KEYS[2], NS.digest(), TOKENS[8:12], b"x" * PAGE)  # queued, then dropped: counted
    tier.flush()
    assert tier.counters.writes_dropped == 1 and tier.counters.inserts == 0
    redis_server.start()  # back, empty
    time.sleep(0.25)  # past the first back-off
    assert not tier.contains(KEYS[0])  # reconnects on its own
    assert tier.put(KEYS[2], NS.digest(), TOKENS[8:12], b"x" * PAGE)
    tier.flush()
    assert tier.counters.inserts == 1 and tier.get(KEYS[2], NS.digest(), TOKENS[8:12], PAGE)[0] == b"x" * PAGE
    tier.close()


def test_flushall_reads_as_misses(redis_server):
    fill(redis_server.url, 3)
    store = make_store(redis_server.url, l2_pages=3)
    assert store.locate(KEYS[:3], TOKENS) == [Source.L3] * 3
    redis_server.client().flushall()
    restored = store.restore(KEYS[:3], TOKENS)  # vanished between lookup and read: a miss
    assert restored.num_pages == 0 and store.locate(KEYS[:3], TOKENS) == []
    store.close()


def test_a_garbage_value_is_rejected_deleted_and_counted(redis_server):
    fill(redis_server.url, 3)
    client = redis_server.client()
    name = b"kvtier:p:" + KEYS[1]
    value = bytearray(client.get(name))
    value[-1] ^= 0xFF  # payload damaged, header intact: the checksum catches it
    client.set(name, bytes(value))
    store = make_store(redis_server.url, l2_pages=3)
    restored = store.restore(KEYS[:3], TOKENS)
    assert restored.sources == [Source.L3]  # the run stops before the bad page
    store.release(restored.keys)
    store.settle()
    assert store.disk.counters.checksum_failures == 1 and not client.exists(name)
    store.close()


@pytest.mark.parametrize("what", ["version", "namespace", "key"])
def test_another_format_version_namespace_or_key_is_never_served(redis_server, what):
    raw = kv_to_host(KV[0]).tobytes()
    header = RecordHeader(
        RECORD_VERSION + (what == "version"),
        KEYS[1] if what == "key" else KEYS[0],  # "key": a forged record, its checksum right
        NS.digest() if what != "namespace" else b"x" * 16,
        token_bytes(TOKENS[:4]),
        "raw",
        len(raw),
        xxh3_64_intdigest(raw),
    )
    redis_server.client().set(b"kvtier:p:" + KEYS[0], header.pack() + raw)
    store = make_store(redis_server.url, l2_pages=1)
    assert store.restore(KEYS[:1], TOKENS).num_pages == 0
    assert store.disk.counters.checksum_failures == 1 and store.disk.counters.hit_pages == 0
    store.close()


def test_a_store_of_another_format_version_is_refused(redis_server):
    redis_server.client().hset("kvtier:meta", "format_version", FORMAT_VERSION + 1)
    with pytest.raises(StoreError, match="format version"):
        RedisTier(redis_server.url)


def _plan(url: str) -> int:
    """Pages of a 4-page match a plan restores, with L3 calibrated against ``url`` and a
    prefill of 1 ms + 1 ms a token (17 tokens: 18 ms)."""
    profile = Profile(Profile.defaults().links, ComputeModel([1e-3, 1e-3, 0.0]))
    for link, nbytes, seconds in link_samples(GEOMETRY, url, lambda: None, (1, 2, 3, 4)):
        profile.links[link].samples.append((nbytes, seconds))
    for link in profile.links.values():
        link.refit()
    return plan_restore([Source.L3] * 4, 4 * 4 + 1, 4, PAGE, profile).restore_pages


def test_calibration_measures_the_redis_in_use_and_a_slow_one_is_not_restored_from(redis_server):
    assert _plan(redis_server.url) == 4
    proxy = SlowProxy(redis_server.port, delay=0.05)
    try:
        assert _plan(proxy.url) == 0
    finally:
        proxy.close()
    assert redis_server.client().keys("kvtier:scratch-*") == []  # the scratch stores are gone


# -- through the engine and the CLI (the small generated model) ---------------------------

ENGINE_PAGE = 64


def kvtier(home, *args: str, store: str) -> tuple[list[dict], dict, str]:
    """``kvtier run --json`` as one host (its own KVTIER_HOME): results, counters, stderr."""
    from kvtier.engine.models.load import resolve_model_path

    env = {**os.environ, "KVTIER_HOME": str(home)}
    model = str(resolve_model_path(None))
    done = cli.run(
        [
            "run",
            "--json",
            "--max-tokens",
            "8",
            "--page-size",
            str(ENGINE_PAGE),
            "--model",
            model,
            "--store",
            store,
            *args,
        ],
        env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[:-1], lines[-1]["counters"], done.stderr


@pytest.fixture(scope="module")
def loaded():
    from kvtier.engine.models.load import load_model

    return load_model()


def greedy(loaded, tokens: list[int]) -> list[int]:
    from tests.engine.conftest import mlx_lm_greedy

    return mlx_lm_greedy(loaded, tokens, 8)


GREEDY = SamplingParams(max_tokens=8)
PROMPT = " ".join(["the system prompt of an agent with tools and a long history"] * 12)  # pages in any tokenizer


def test_two_hosts_share_one_redis_and_the_second_restores_what_the_first_computed(redis_server, tmp_path, loaded):
    (first,), _, _ = kvtier(tmp_path / "host-a", "--prompt", PROMPT, store=redis_server.url)
    (second,), counters, _ = kvtier(tmp_path / "host-b", "--prompt", PROMPT, store=redis_server.url)
    n = second["prompt_tokens"]
    assert first["sources"]["recomputed"] == n
    assert second["sources"]["L3"] == (n - 1) // ENGINE_PAGE * ENGINE_PAGE > 0
    assert second["output_token_ids"] == first["output_token_ids"] == greedy(loaded, loaded.tokenizer.encode(PROMPT))
    assert counters["l3"] == {"backend": "redis", "location": redis_server.url}


def test_cli_with_redis_down_warns_once_and_exits_0(tmp_path):
    (result,), counters, stderr = kvtier(tmp_path, "--prompt", PROMPT, store=f"redis://127.0.0.1:{free_port()}")
    assert result["sources"]["recomputed"] == result["prompt_tokens"] and "l3" not in counters
    assert [line for line in stderr.splitlines() if "L3" in line or "Redis" in line] == [
        line
        for line in stderr.splitlines()
        if "running without L3 until it answers (retried in the background): cannot use Redis store" in line
    ]
    assert len(stderr.strip().splitlines()) == 1


def engine(loaded, url: str):
    """An engine whose every page goes to L3 (no room in L1 or L2)."""
    from kvtier.engine.engine import Engine, EngineConfig

    return Engine(loaded, EngineConfig(page_size=ENGINE_PAGE, store=StoreConfig(0, 0, None, url)))


def test_garbage_in_every_page_is_recomputed_with_the_same_output(redis_server, loaded):
    prompt = loaded.tokenizer.encode(PROMPT)
    first = engine(loaded, redis_server.url)
    (cold,) = first.generate([prompt], GREEDY)
    first.close()
    client = redis_server.client()
    pages = client.keys("kvtier:p:*")
    for name in pages:
        client.set(name, os.urandom(len(client.get(name))))
    second = engine(loaded, redis_server.url)  # another host
    (again,) = second.generate([prompt], GREEDY)
    second.store.settle()
    assert again.output == cold.output == greedy(loaded, prompt)
    assert again.sources()["recomputed"] == len(prompt)
    assert second.store.disk.counters.checksum_failures == 1  # the run stops at the first bad page
    assert second.store.disk.counters.inserts >= 1  # deleted, then computed and stored again
    second.close()


def test_redis_killed_mid_run_the_engine_recomputes_and_carries_on(redis_server, loaded):
    prompt = loaded.tokenizer.encode(PROMPT)
    one = engine(loaded, redis_server.url)
    (cold,) = one.generate([prompt], GREEDY)
    one.store.settle()
    (warm,) = one.generate([prompt], GREEDY)
    redis_server.stop()
    (down,) = one.generate([prompt], GREEDY)
    redis_server.start()
    time.sleep(0.25)  # past the first back-off
    (back,) = one.generate([prompt], GREEDY)
    one.close()
    assert warm.sources()["L3"] > 0 and down.sources()["recomputed"] == len(prompt)
    assert cold.output == warm.output == down.output == back.output == greedy(loaded, prompt)
