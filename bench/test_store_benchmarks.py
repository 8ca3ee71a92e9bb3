"""pytest-benchmark suite for the store's hot paths (not part of the test run).

    .venv/bin/python -m pytest bench/test_store_benchmarks.py --benchmark-only

Pages have the default model's geometry (24 layers, 2 KV heads, head_dim 64,
128 tokens, float32: 3 MiB). Compare runs with ``--benchmark-compare``.
"""

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, page_keys

GEOMETRY = PageGeometry(24, 2, 64, 128, "float32")
NS = Namespace("bench", "float32", 128)
PAGES = 16
TOKENS = list(range(PAGES * 128 + 1))
KEYS = page_keys(NS, TOKENS)[:PAGES]
KV = [mx.array(np.random.default_rng(i).standard_normal(GEOMETRY.shape, dtype=np.float32)) for i in range(PAGES)]


def store(tmp_path, l1_pages: int, l2_pages: int) -> TieredStore:
    size = GEOMETRY.nbytes
    return TieredStore(GEOMETRY, NS, StoreConfig(l1_pages * size, l2_pages * size, 4 * PAGES * size, tmp_path))


def fill(s: TieredStore) -> None:
    for i, key in enumerate(KEYS):
        s.publish(key, TOKENS[i * 128 : (i + 1) * 128], KV[i])


@pytest.mark.parametrize("tier", ["L1", "L2", "L3"])
def test_restore_16_pages(benchmark, tmp_path, tier):
    l1, l2 = {"L1": (PAGES, 0), "L2": (0, PAGES), "L3": (PAGES, 0)}[tier]
    s = store(tmp_path, l1, l2)
    fill(s)
    if tier == "L3":
        s.close()
        s = store(tmp_path, 0, 0)

    def restore():
        s.release(s.restore(KEYS, TOKENS).keys)

    benchmark(restore)
    s.close()


def test_spill_l1_to_l2(benchmark, tmp_path):
    s = store(tmp_path, 1, PAGES + 1)
    fill(s)
    keys = iter(page_keys(NS, list(range(10**6, 10**6 + 128 * 4000)))[1:])

    def spill():  # each publish into a full L1 moves its LRU page down to L2
        s.publish(next(keys), TOKENS[:128], KV[0])

    benchmark.pedantic(spill, rounds=200)
    s.close()


def test_locate_16_pages(benchmark, tmp_path):
    s = store(tmp_path, 4, 4)
    fill(s)
    s.keeping.flush()
    assert len(benchmark(s.locate, KEYS, TOKENS)) == PAGES
    s.close()
