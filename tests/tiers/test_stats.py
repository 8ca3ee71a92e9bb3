"""The store's typed stats: a frozen snapshot that its readers take by attribute, and
whose ``to_json`` is the shape ``--json``, ``/v1/kvtier/stats`` and the README show."""

from __future__ import annotations

import json

from kvtier.tiers.links import Link
from kvtier.tiers.page import Source

from .small_pages import GEOMETRY, KEYS, PAGE, TOKENS, make_store, publish

TIER_KEYS = [
    "capacity",
    "bytes_used",
    "pages",
    "lookups",
    "hit_pages",
    "hit_tokens",
    "inserts",
    "evictions",
    "checksum_failures",
    "writes_dropped",
    "writes_over_budget",
]


def test_stats_are_a_snapshot_and_their_json_keeps_its_keys_in_order(tmp_path):
    store = make_store(1, 1, tmp_path)
    publish(store, 0, 1)  # page 0 leaves L1 for L2
    stats = store.stats()
    publish(store, 2)  # counted after the snapshot was taken
    assert (stats.tiers["L1"].inserts, stats.tiers["L2"].inserts, stats.links[Link.L1_L2].pages) == (2, 1, 1)
    assert store.stats().tiers["L1"].inserts == 3
    shape = json.loads(json.dumps(stats.to_json()))
    assert list(shape) == ["tiers", "links", "l3", "reads_abandoned"]
    assert list(shape["tiers"]) == ["L1", "L2", "L3"]
    assert all(list(row) == TIER_KEYS for row in shape["tiers"].values())
    assert shape["tiers"]["L2"]["bytes_used"] == PAGE
    assert list(shape["links"]) == [link.value for link in Link]
    assert shape["links"]["L1->L2"] == {"bytes": PAGE, "pages": 1, "seconds": stats.links[Link.L1_L2].seconds}
    assert shape["l3"] == {"backend": "lmdb", "location": str(tmp_path)}
    store.close()


def test_a_store_without_l3_has_no_l3_in_its_stats():
    stats = make_store(1, 1).stats()
    assert list(stats.tiers) == ["L1", "L2"] and stats.l3 is None
    assert list(stats.to_json()) == ["tiers", "links"]


def test_a_restore_counts_each_page_looked_up_in_l1_then_in_l2_only_when_l1_lacks_it(tmp_path):
    store = make_store(2, 4, tmp_path)
    publish(store, 0, 1, 2, 3)  # L1 keeps pages 2 and 3; 0 and 1 went down to L2
    before = store.stats().tiers
    restored = store.restore(KEYS[:5], TOKENS)  # page 4 is stored nowhere: the run ends there
    after = store.stats().tiers
    assert restored.sources == [Source.L2, Source.L2, Source.L1, Source.L1]
    delta = {
        tier: (after[tier].lookups - before[tier].lookups, after[tier].hit_pages - before[tier].hit_pages)
        for tier in ("L1", "L2", "L3")
    }
    assert delta == {"L1": (5, 2), "L2": (3, 2), "L3": (1, 0)}
    assert after["L2"].hit_tokens - before["L2"].hit_tokens == 2 * GEOMETRY.page_size
    store.release(restored.keys)
    store.close()
