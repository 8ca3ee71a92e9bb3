"""A sliding-window model's pages read ahead from L3 (LMDB, Redis): the records a restore
of the run reads whole are read whole, the others only up to the end of their global
rows (LMDB copies no more out of its map; Redis sends no more); a shorter restore reads
the rest of the window pages it needs, and a record read in part that fails its check
is deleted like any other."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, page_keys

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .lmdb_files import damage_first_payload_byte

WINDOW = LayerKind("window", window=8)
GEOMETRY = PageGeometry(2, 1, 2048, 4, "float32", (GLOBAL, WINDOW))  # 128 KiB pages: more than a Redis head
TOKENS = list(range(200, 225))  # 6 full pages (and the last token)
PAGES = 6


@dataclass
class Backend:
    location: str  # StoreConfig.store_dir: a directory or a redis:// URL
    damage: Callable[[list[bytes]], None]  # flip the first payload byte of these records (the store closed)
    sent: Callable[[], int]  # bytes the backend has sent so far (Redis), or 0


def redis_damage(server) -> Callable[[list[bytes]], None]:
    def damage(keys: list[bytes]) -> None:
        with server.client() as client:
            for key in keys:
                name = b"kvtier:p:" + key  # the store's default prefix (tiers.l3.redis_store)
                value = bytearray(client.get(name))
                value[4 + int.from_bytes(value[:4], "little")] ^= 0xFF
                client.set(name, bytes(value))

    return damage


def redis_sent(server) -> Callable[[], int]:
    def sent() -> int:
        with server.client() as client:
            return int(client.info("stats")["total_net_output_bytes"])

    return sent


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=needs_redis)])
def backend(request, tmp_path) -> Iterator[Backend]:
    if request.param == "lmdb":
        yield Backend(str(tmp_path), lambda keys: damage_first_payload_byte(tmp_path, keys), lambda: 0)
        return
    server = request.getfixturevalue("redis_server")
    yield Backend(server.url, redis_damage(server), redis_sent(server))


def page_kv(i: int, base: float = 0.0) -> np.ndarray:
    return np.arange(GEOMETRY.nbytes // 4, dtype=np.float32).reshape(GEOMETRY.shape) + 1000 * i + base


def store(backend: Backend) -> TieredStore:
    namespace = Namespace("window", "float32", 4, layers=GEOMETRY.describe_layers())
    return TieredStore(GEOMETRY, namespace, StoreConfig(1 << 16, 1 << 16, store_dir=backend.location))


def stored(backend: Backend, base: float = 0.0) -> list:
    """The pages in L3 only (a store closed after publishing them); ``base`` is added to
    every value (a test whose check reads memory left by another's pages sees other bytes)."""
    first = store(backend)
    keys = page_keys(first.namespace, TOKENS)[:PAGES]
    for i, key in enumerate(keys):
        kv = mx.array(page_kv(i, base))
        first.publish(key, TOKENS[4 * i : 4 * i + 4], kv, parent=keys[i - 1] if i else None)
    first.close()
    return keys


def read(again: TieredStore, keys: list):
    done = again.read_ahead(keys, time.perf_counter() + 60)
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
    wanted = (*expected_rows(0, list(range(pages))), *expected_rows(1, GEOMETRY.window_pages(pages)))
    for got, want in zip((gk, gv, wk, wv), wanted):
        assert np.array_equal(got, want)


def test_a_read_ahead_reads_the_global_rows_of_pages_the_window_does_not_see(backend):
    keys = stored(backend)
    again = store(backend)
    sent = []
    for whole in (None, GEOMETRY.window_pages):
        before = backend.sent()
        with again.disk.snapshot() as snapshot:
            found, nbytes = snapshot.read_ahead(keys, GEOMETRY.nbytes, whole=whole)
        sent.append((nbytes, backend.sent() - before))
    assert found == keys and GEOMETRY.window_pages(PAGES) == [4, 5]
    (whole_bytes, whole_sent), (part_bytes, part_sent) = sent
    window_rows = GEOMETRY.segments[1]
    assert whole_bytes - part_bytes == 4 * window_rows  # the window rows of pages 0-3 were not read
    if "redis" in backend.location:  # nor sent (less a second round's reply framing)
        assert whole_sent - part_sent > 4 * window_rows - 1024
    again.close()


@pytest.mark.parametrize("restored_pages", [PAGES, 4, 3])
def test_a_restore_from_a_read_ahead_equals_what_was_stored(backend, restored_pages):
    """Of the whole run read, or of a shorter one, whose window sees pages the read took
    only the global rows of: their window rows are read then, and nothing is rejected."""
    keys = stored(backend)
    again = store(backend)
    ahead = read(again, keys)
    restored = again.restore(keys[:restored_pages], TOKENS, read=ahead)
    assert restored.num_pages == restored_pages and again.stats().tiers["L3"].checksum_failures == 0
    assert_restored(restored, restored_pages)
    again.release(restored.keys)
    again.readers.end(ahead)
    again.close()


def test_a_record_read_in_part_that_fails_its_check_is_deleted(backend):
    keys = stored(backend, base=0.5)
    backend.damage([keys[2]])  # a global row of a page read in part
    again = store(backend)
    ahead = read(again, keys)
    restored = again.restore(keys, TOKENS, read=ahead)
    assert restored.num_pages == 2 and again.stats().tiers["L3"].checksum_failures == 1
    again.release(restored.keys)
    again.readers.end(ahead)
    again.close()  # the writer commits the delete: the fingerprint named the stored value's checked part
    third = store(backend)
    assert third.locate(keys, TOKENS) == ["L3", "L3"]  # the damaged record is gone
    third.close()
