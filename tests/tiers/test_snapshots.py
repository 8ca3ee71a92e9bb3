"""Snapshots of a hybrid model's recurrent state: never restored apart from their pages."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.links import Link
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, page_keys

STATE = LayerKind("state", arrays=(("float32", (1, 2, 8)),))
GEOMETRY = PageGeometry(1, 1, 8, 4, "float32", (STATE, GLOBAL))  # 256-byte pages, 64-byte snapshots
TOKENS = list(range(100, 120))  # 5 pages


def config(store_dir=None) -> StoreConfig:
    return StoreConfig(1 << 16, 1 << 16, store_dir=store_dir, snapshot_l1_bytes=1 << 12, snapshot_l2_bytes=1 << 12)


def store_with_pages(tmp_path=None) -> tuple[TieredStore, list]:
    namespace = Namespace("hybrid", "float32", 4, layers=GEOMETRY.describe_layers())
    store = TieredStore(GEOMETRY, namespace, config(tmp_path))
    keys = page_keys(namespace, TOKENS)
    for i, key in enumerate(keys):
        kv = mx.array(np.full(GEOMETRY.shape, i, np.float32))
        store.publish(key, TOKENS[4 * i : 4 * i + 4], kv, parent=keys[i - 1] if i else namespace.digest())
    return store, keys


def state(i: int) -> mx.array:
    return mx.array(np.full(16, i, np.float32)).view(mx.uint8)


def test_pages_without_a_snapshot_are_not_restored():
    store, keys = store_with_pages()
    assert store.locate(keys, TOKENS) == ["L1"] * 5  # the pages are there
    assert store.restore(keys, TOKENS).num_pages == 0  # but no state after any of them
    assert store.finish(store.begin(keys, TOKENS)).num_pages == 0  # however the restore is driven
    assert not store.accounts.view().pins


def test_a_restore_ends_after_its_last_snapshot_with_that_state():
    store, keys = store_with_pages()
    store.publish_snapshot(keys[1], TOKENS[4:8], state(2))
    assert store.restore_points(keys, []) == [2]
    restored = store.restore(keys, TOKENS)
    assert restored.num_pages == 2 and restored.layers[0][0].shape[2] == 8  # the KV of 2 pages' tokens
    assert np.array_equal(np.asarray(restored.state), np.asarray(state(2)))
    assert sorted(store.accounts.view().pins) == sorted(keys[:2])  # the pages after it were let go
    store.release(restored.keys)


def test_a_snapshot_after_the_wrong_tokens_is_not_used():
    store, keys = store_with_pages()
    store.publish_snapshot(keys[1], TOKENS[0:4], state(2))  # filed under page 2 with page 1's tokens
    assert store.restore(keys, TOKENS).num_pages == 0


def test_snapshots_survive_a_restart_in_lmdb(tmp_path):
    store, keys = store_with_pages(tmp_path)
    store.publish_snapshot(keys[3], TOKENS[12:16], state(4))
    store.close()
    again = TieredStore(GEOMETRY, store.namespace, StoreConfig(l1_bytes=1 << 20, l2_bytes=1 << 20, store_dir=tmp_path))
    restored = again.restore(keys, TOKENS)
    assert restored.sources == ["L3"] * 4 and np.array_equal(np.asarray(restored.state), np.asarray(state(4)))
    assert again.stats().snapshots.links[Link.L3_L1].pages == 1
    again.release(restored.keys)
    again.close()


def test_the_last_page_is_labelled_the_slowest_tier_of_its_page_and_its_snapshot(tmp_path):
    store, keys = store_with_pages(tmp_path)
    store.publish_snapshot(keys[2], TOKENS[8:12], state(3))
    store.close()  # pages and snapshot in LMDB
    again, _ = store_with_pages(tmp_path)  # the pages computed again: in L1; the snapshot only in L3
    restored = again.restore(keys, TOKENS)
    assert restored.sources == ["L1", "L1", "L3"]
    again.release(restored.keys)
    again.close()
