"""Write-through (``StoreConfig.l3_write_through``): a page one store publishes, with room
left in its L1, is in the shared L3 for another store at once, written once, under the
same admission as a spill (and never with a write budget); without it, L3 gets the page
only when it spills or at a flush (write-back)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.links import Link
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, Source, page_keys
from kvtier.tiers.store_config import open_l3_of
from kvtier.tiers.tier import kv_to_host

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .small_pages import GEOMETRY, KEYS, KV, NS, PAGE, page_tokens

PAGES = 3
TOKENS = [t for i in range(PAGES) for t in page_tokens(i)]


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=[pytest.mark.slow, needs_redis])])
def where(request, tmp_path):
    """The shared L3: an LMDB directory (opened once, shared by both stores of this
    process) or a Redis URL (each store connects to it, as a fleet's backends do)."""
    return tmp_path / "l3" if request.param == "lmdb" else request.getfixturevalue("redis_server").url


@contextmanager
def two_stores(where, through: bool, geometry=GEOMETRY, namespace=NS, **fields) -> Iterator[tuple]:
    """Store A (write-through or not) and store B over one L3, L1 and L2 with room for 8
    pages each unless ``fields`` say otherwise."""
    config = StoreConfig(**{"l1_bytes": 8 * PAGE, "l2_bytes": 8 * PAGE, **fields}, store_dir=where)
    shared = open_l3_of(config) if not isinstance(where, str) else None
    a_config = replace(config, l3_write_through=through)
    if shared is not None:
        a_config, config = (replace(c, store_dir=None, shared_l3=shared) for c in (a_config, config))
    a, b = TieredStore(geometry, namespace, a_config), TieredStore(geometry, namespace, config)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        if shared is not None:
            shared.close()


def publish_pages(store: TieredStore) -> None:
    for i in range(PAGES):
        assert store.publish(KEYS[i], page_tokens(i), KV[i], parent=KEYS[i - 1] if i else None)
    store.settle()  # the writer has committed what was queued


def test_a_page_published_with_room_in_l1_is_restored_from_l3_by_another_store(where):
    with two_stores(where, through=True) as (a, b):
        publish_pages(a)
        assert a.accounts.view().l1.pages == PAGES  # still in A's L1: nothing spilled
        assert b.locate(KEYS[:PAGES], TOKENS) == [Source.L3] * PAGES
        restored = b.restore(KEYS[:PAGES], TOKENS)
        assert restored.sources == [Source.L3] * PAGES and restored.num_pages == PAGES
        joined = mx.stack([mx.concatenate([k, v]) for k, v in restored.layers])  # (layers, 2, heads, tokens, dim)
        pages = [kv_to_host(joined[:, :, :, 4 * i : 4 * i + 4, :]) for i in range(PAGES)]
        assert all(np.array_equal(page, kv_to_host(KV[i])) for i, page in enumerate(pages))
        b.release(restored.keys)
        assert a.links[Link.L1_L3].bytes == PAGES * PAGE  # the write-through crossed L1->L3


def test_without_write_through_the_other_store_finds_nothing_until_a_spill(where):
    with two_stores(where, through=False) as (a, b):
        publish_pages(a)
        assert b.locate(KEYS[:PAGES], TOKENS) == []
        assert a.links[Link.L1_L3].bytes == 0


def handed_to_l3(store: TieredStore) -> int:
    """The page writes a store has queued for L3, from either tier."""
    return store.links[Link.L1_L3].pages + store.links[Link.L2_L3].pages


def test_a_page_written_through_is_not_written_again_by_its_spill_or_flush(tmp_path):
    with two_stores(tmp_path / "l3", through=True, l1_bytes=PAGE, l2_bytes=PAGE) as (a, _):
        publish_pages(a)  # each page written through, then moved down to L2 and out of it
        assert handed_to_l3(a) == PAGES and a.accounts.view().l2.pages == 1
        a.keeping.flush()  # every page of L1 and L2 to L3: these are known to be there
        a.settle()
        assert handed_to_l3(a) == PAGES and a.stats().tiers["L3"].inserts == PAGES


def test_a_page_l2_holds_is_written_through_from_l2_and_marked_in_both_tiers(tmp_path):
    """Second-use admission leaves the first sightings unwritten; the page seen again,
    back in L1 beside its L2 copy, is written from L2's host bytes, and neither copy is
    written again."""
    with two_stores(tmp_path / "l3", through=True, l1_bytes=PAGE, l3_admit="second-use") as (a, b):
        for i in range(PAGES):  # unchained pages: L1 evicts each for the next, to L2
            assert a.publish(KEYS[i], page_tokens(i), KV[i])
        assert handed_to_l3(a) == 0 and a.admission.rejected == 0  # refused later, once, when they spill
        assert a.publish(KEYS[0], page_tokens(0), KV[0])  # seen twice: admitted
        a.settle()
        assert (a.links[Link.L1_L3].pages, a.links[Link.L2_L3].pages) == (0, 1)
        assert b.locate(KEYS[:1], TOKENS[:4]) == [Source.L3]
        a.keeping.flush()  # refuses the pages seen once, and asks nothing of the marked one
        a.settle()
        assert handed_to_l3(a) == 1 and a.stats().tiers["L3"].inserts == 1
        assert a.admission.rejected == PAGES - 1


def test_write_through_takes_no_write_budget():
    with pytest.raises(ValueError, match="no write budget"):
        StoreConfig(l3_write_through=True, l3_write_budget=1.0)


def test_second_use_admission_holds_a_write_through_as_a_spill(tmp_path):
    with two_stores(tmp_path / "l3", through=True, l3_admit="second-use") as (a, b):
        publish_pages(a)  # seen once: not admitted yet
        assert b.locate(KEYS[:PAGES], TOKENS) == []


STATE = LayerKind("state", arrays=(("float32", (1, 2, 8)),))
HYBRID = PageGeometry(1, 1, 8, 4, "float32", (STATE, GLOBAL))  # 64-byte snapshots


def test_a_hybrid_models_snapshot_is_written_through_with_its_pages(tmp_path):
    namespace = Namespace("hybrid", "float32", 4, layers=HYBRID.describe_layers())
    keys = page_keys(namespace, TOKENS)
    with two_stores(tmp_path / "l3", True, HYBRID, namespace, snapshot_l1_bytes=1 << 12) as (a, b):
        for i, key in enumerate(keys):
            a.publish(
                key, page_tokens(i), mx.array(np.full(HYBRID.shape, i, np.float32)), parent=keys[i - 1] if i else None
            )
        state = mx.array(np.full(16, 7, np.float32)).view(mx.uint8)
        a.publish_snapshot(keys[-1], page_tokens(PAGES - 1), state)
        a.settle()
        restored = b.restore(keys, TOKENS)  # a restore needs the snapshot after its last page
        assert restored.sources == [Source.L3] * PAGES
        assert np.array_equal(np.asarray(restored.state), np.asarray(state))
        b.release(restored.keys)
