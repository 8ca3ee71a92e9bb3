"""A restored request's round trips to Redis are a constant, whatever its pages and
whatever the network's delay (``tests.redis_servers.SlowProxy`` counts them; the small
generated model; ``bench/redis_latency.py`` measures the seconds)."""

from __future__ import annotations

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from ..redis_servers import SlowProxy, needs_redis, redis_server  # noqa: F401
from .conftest import mlx_lm_greedy, text_prompt

pytestmark = [pytest.mark.slow, needs_redis]  # starts a redis-server

PAGE = 16
PARAMS = SamplingParams(max_tokens=2)


def round_trips(loaded, port: int, url: str, prompt: list[int], delay: float) -> tuple[int, int]:
    """(round trips, tokens from L3) of ``prompt`` run by an engine of its own through a
    proxy adding ``delay``, after another engine computed it into Redis."""
    first = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=url)))
    first.generate([prompt], PARAMS)
    first.close()
    proxy = SlowProxy(port, delay)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=proxy.url)))
    before = proxy.round_trips
    (request,) = engine.generate([prompt], PARAMS)
    trips = proxy.round_trips - before
    assert request.output == mlx_lm_greedy(loaded, prompt, 2)
    engine.close()
    proxy.close()
    return trips, request.sources()["L3"]


def test_a_restored_request_costs_a_constant_number_of_round_trips(loaded, redis_server):
    counts = {}
    for pages in (2, 12):
        for delay in (0.0, 0.05):
            prompt = text_prompt(loaded, pages * PAGE + 1, seed=pages + int(delay * 100))
            counts[pages, delay] = round_trips(loaded, redis_server.port, redis_server.url, prompt, delay)
    assert counts[2, 0.0][0] == counts[12, 0.0][0] == 1, counts  # one MGET whatever the pages
    assert counts[12, 0.0][1] == 12 * PAGE, (
        counts
    )  # every page restored (2 pages may be recomputed: their deadline is short)
    for pages in (2, 12):  # slower: one more round trip at most (a restore abandoned for recompute asks no more)
        assert counts[pages, 0.05][0] <= counts[pages, 0.0][0] + 1
