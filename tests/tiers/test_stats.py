"""The store's typed stats: a frozen snapshot that its readers take by attribute, and
whose ``to_json`` is the shape ``--json``, ``/v1/kvtier/stats`` and the README show."""

from __future__ import annotations

import json

from kvtier.tiers.links import Link

from .test_hierarchy import PAGE, make_store, publish

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
