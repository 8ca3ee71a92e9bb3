"""Through the engine (issue 25, item 1): a record put under another page's key, on
LMDB or Redis, is never served; the output is what recomputing gives, and those tokens
are labelled ``recomputed``.

Two prompts share every page but the first: B's record of its second page has the same
tokens and namespace as A's, and a checksum right for its bytes (the swap), or a record
is forged with a right checksum and another key (the forgery).
"""

from __future__ import annotations

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.l3.record import RecordHeader
from kvtier.tiers.page import page_keys

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from ..tiers.test_bound_records import forged, records
from .conftest import mlx_lm_greedy, text_prompt

PAGE = 64
GREEDY = SamplingParams(max_tokens=8)


def make_engine(loaded, store) -> Engine:
    config = StoreConfig(l1_bytes=1 << 30, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=store)
    return Engine(loaded, EngineConfig(page_size=PAGE, store=config))


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=[pytest.mark.slow, needs_redis])])
def location(request, tmp_path):
    return tmp_path / "store" if request.param == "lmdb" else request.getfixturevalue("redis_server").url


@pytest.mark.parametrize("bad", ["swapped", "forged"])
def test_a_record_under_another_key_is_recomputed(loaded, location, bad):
    shared = text_prompt(loaded, 2 * PAGE + 1, seed=3)
    a = text_prompt(loaded, PAGE, seed=1) + shared
    b = text_prompt(loaded, PAGE, seed=2) + shared
    namespace = loaded.namespace(loaded.geometry(PAGE))
    keys_a, keys_b = page_keys(namespace, a), page_keys(namespace, b)
    engine = make_engine(loaded, location)
    engine.generate([a, b], GREEDY)
    engine.close()
    with records(location) as stored:
        good = stored[keys_b[1]]
        stored[keys_a[1]] = good if bad == "swapped" else forged_like(good, keys_b[0])

    engine = make_engine(loaded, location)
    (request,) = engine.generate([a], GREEDY)
    l3 = engine.store.disk.counters
    engine.close()
    assert request.output == mlx_lm_greedy(loaded, a, GREEDY.max_tokens)
    assert request.sources()["L3"] == PAGE and request.sources()["recomputed"] == len(a) - PAGE
    assert l3.checksum_failures == 1


def forged_like(record: bytes, key: bytes) -> bytes:
    """A record with ``record``'s payload, its header naming ``key``, its checksum right."""
    header, offset = RecordHeader.unpack(memoryview(record))
    return forged(key, record[offset:], tokens=header.tokens, namespace=header.namespace)
