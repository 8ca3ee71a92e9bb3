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
from kvtier.tiers.page import page_keys, snapshot_key

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from ..tiers.test_bound_records import forged, records
from .conftest import mlx_lm_greedy, text_prompt
from .test_hybrid_models import PAGE as HYBRID_PAGE
from .test_hybrid_models import lfm2  # noqa: F401
from .test_hybrid_models import make_engine as hybrid_engine
from .test_window_models import PAGE as WINDOW_PAGE
from .test_window_models import gemma  # noqa: F401
from .test_window_models import make_engine as window_engine

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


def _two_prompts(loaded, page: int, pages: int) -> tuple[list[int], list[int]]:
    """Two prompts of ``pages`` full pages and a token, alike but for their first page."""
    shared = text_prompt(loaded, (pages - 1) * page + 1, seed=13)
    return text_prompt(loaded, page, seed=11) + shared, text_prompt(loaded, page, seed=12) + shared


def _swap(store, keys_a: list[bytes], keys_b: list[bytes]) -> None:
    """B's records put under A's keys (the same tokens each)."""
    with records(store) as stored:
        for a, b in zip(keys_a, keys_b):
            stored[a] = stored[b]


def test_a_window_models_page_under_another_key_is_recomputed(gemma, tmp_path):
    a, b = _two_prompts(gemma, WINDOW_PAGE, 9)  # the window (2 pages) sees pages 7 and 8
    engine = window_engine(gemma, tmp_path)
    engine.generate([a, b], GREEDY)
    engine.close()
    keys_a, keys_b = (page_keys(engine.namespace, p) for p in (a, b))
    _swap(tmp_path, [keys_a[8]], [keys_b[8]])  # read in segments: global rows, then window rows
    engine = window_engine(gemma, tmp_path)
    (request,) = engine.generate([a], GREEDY)
    failures = engine.stats().store.tiers["L3"].checksum_failures
    engine.close()
    assert request.output == mlx_lm_greedy(gemma, a, GREEDY.max_tokens) and failures == 1
    assert request.sources()["L3"] == 8 * WINDOW_PAGE and request.sources()["recomputed"] == len(a) - 8 * WINDOW_PAGE


def test_a_hybrid_models_snapshot_under_another_key_is_not_restored(lfm2, tmp_path):
    a, b = _two_prompts(lfm2, HYBRID_PAGE, 9)
    engine = hybrid_engine(lfm2, tmp_path)
    engine.generate([a, b], GREEDY)
    engine.close()
    keys_a, keys_b = (page_keys(engine.namespace, p) for p in (a, b))
    _swap(tmp_path, [snapshot_key(keys_a[8])], [snapshot_key(keys_b[8])])  # the state after page 9
    engine = hybrid_engine(lfm2, tmp_path)
    (request,) = engine.generate([a], GREEDY)
    failures = engine.stats().store.tiers["L3"].checksum_failures
    engine.close()
    assert request.output == mlx_lm_greedy(lfm2, a, GREEDY.max_tokens) and failures == 1
    assert request.sources()["L3"] == 8 * HYBRID_PAGE  # from the snapshot after page 8
