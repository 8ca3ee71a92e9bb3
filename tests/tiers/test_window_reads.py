"""A sliding-window model's pages read ahead from LMDB: the records a restore of the run
reads whole are copied whole, the others only up to the end of their global rows; a
shorter restore reads the rest of the window pages it needs, and a record read in part
that fails its check is deleted like any other."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, page_keys

from .lmdb_files import damage_first_payload_byte

WINDOW = LayerKind("window", window=8)
GEOMETRY = PageGeometry(2, 1, 4, 4, "float32", (GLOBAL, WINDOW))  # 128-byte pages: 64 global, 64 window
TOKENS = list(range(200, 225))  # 6 full pages (and the last token)
PAGES = 6


def page_kv(i: int, base: float = 0.0) -> np.ndarray:
    return np.arange(GEOMETRY.nbytes // 4, dtype=np.float32).reshape(GEOMETRY.shape) + 1000 * i + base


def stored(tmp_path, base: float = 0.0) -> tuple[Namespace, list]:
    """The pages in LMDB only (a store closed after publishing them); ``base`` is added to
    every value (a test whose check reads memory left by another's pages sees other bytes)."""
    namespace = Namespace("window", "float32", 4, layers=GEOMETRY.describe_layers())
    store = TieredStore(GEOMETRY, namespace, StoreConfig(1 << 16, 1 << 16, store_dir=tmp_path))
    keys = page_keys(namespace, TOKENS)[:PAGES]
    for i, key in enumerate(keys):
        kv = mx.array(page_kv(i, base))
        store.publish(key, TOKENS[4 * i : 4 * i + 4], kv, parent=keys[i - 1] if i else None)
    store.close()
    return namespace, keys


def reopened(tmp_path, namespace: Namespace) -> TieredStore:
    return TieredStore(GEOMETRY, namespace, StoreConfig(1 << 16, 1 << 16, store_dir=tmp_path))


def read(store: TieredStore, keys: list):
    done = store.read_ahead(keys, time.perf_counter() + 60)
    assert done is not None
    done.future.result(30)
    return done


def expected_rows(row: int, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Row ``row``'s K and V of these pages, joined along tokens, as a restore gives them."""
    kv = np.concatenate([page_kv(i)[row] for i in pages], axis=2)  # (2, heads, tokens, dim)
    return kv[0][None], kv[1][None]


def assert_restored(restored, pages: int) -> None:
    """Every page's global row, and the window row of the pages the window sees."""
    (gk, gv), (wk, wv) = ((np.asarray(k), np.asarray(v)) for k, v in restored.layers)
    for got, want in zip(
        (gk, gv, wk, wv), (*expected_rows(0, list(range(pages))), *expected_rows(1, GEOMETRY.window_pages(pages)))
    ):
        assert np.array_equal(got, want)


def test_a_read_ahead_copies_the_global_rows_of_pages_the_window_does_not_see(tmp_path):
    namespace, keys = stored(tmp_path)
    store = reopened(tmp_path, namespace)
    with store.disk.snapshot() as snapshot:
        found, whole = snapshot.read_ahead(keys, GEOMETRY.nbytes)
    with store.disk.snapshot() as snapshot:
        found, part = snapshot.read_ahead(keys, GEOMETRY.nbytes, whole=GEOMETRY.window_pages)
    assert found == keys and GEOMETRY.window_pages(PAGES) == [4, 5]
    global_rows, window_rows = GEOMETRY.segments
    assert whole - part == 4 * window_rows  # the window rows of pages 0-3 were not read
    store.close()


@pytest.mark.parametrize("restored_pages", [PAGES, 4, 3])
def test_a_restore_from_a_read_ahead_equals_what_was_stored(tmp_path, restored_pages):
    """Of the whole run read, or of a shorter one, whose window sees pages the read took
    only the global rows of: their window rows are read then, and nothing is rejected."""
    namespace, keys = stored(tmp_path)
    store = reopened(tmp_path, namespace)
    ahead = read(store, keys)
    restored = store.restore(keys[:restored_pages], TOKENS, read=ahead)
    assert restored.num_pages == restored_pages and store.stats().tiers["L3"].checksum_failures == 0
    assert_restored(restored, restored_pages)
    store.release(restored.keys)
    store.readers.end(ahead)
    store.close()


def test_a_record_read_in_part_that_fails_its_check_is_deleted(tmp_path):
    namespace, keys = stored(tmp_path, base=0.5)
    damage_first_payload_byte(tmp_path, [keys[2]])  # a global row of a page read in part
    store = reopened(tmp_path, namespace)
    ahead = read(store, keys)
    restored = store.restore(keys, TOKENS, read=ahead)
    assert restored.num_pages == 2 and store.stats().tiers["L3"].checksum_failures == 1
    store.release(restored.keys)
    store.readers.end(ahead)
    store.close()  # the writer commits the delete: the fingerprint named the stored value
    again = reopened(tmp_path, namespace)
    assert again.locate(keys, TOKENS) == ["L3", "L3"]  # the damaged record is gone
    again.close()
