"""Two stores of one process over one open L3 (``StoreConfig.shared_l3``, the fleet
replay's engines): a page one spills the other restores, and closing one store leaves
the L3 open for the other; its opener closes it."""

import mlx.core as mx
import numpy as np

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, Source, page_keys
from kvtier.tiers.store_config import open_l3_of

GEOMETRY = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")
NS = Namespace("test-model", "bfloat16", 4)
TOKENS = list(range(200, 200 + 4 * 3))
KEYS = page_keys(NS, TOKENS)


def kv(i: int) -> mx.array:
    page = mx.array(np.random.default_rng(i).standard_normal(GEOMETRY.shape).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(page)
    return page


def test_a_page_one_store_spilled_the_other_restores_after_the_first_closes(tmp_path):
    config = StoreConfig(l1_bytes=8 * GEOMETRY.nbytes, l2_bytes=0, store_dir=tmp_path / "l3")
    shared = open_l3_of(config)
    one, other = (TieredStore(GEOMETRY, NS, StoreConfig(l1_bytes=config.l1_bytes, shared_l3=shared)) for _ in "ab")
    pages = [kv(i) for i in range(len(KEYS))]
    for i, (key, page) in enumerate(zip(KEYS, pages)):
        assert one.publish(key, TOKENS[4 * i : 4 * i + 4], page)
    one.close()  # flushes its pages to the shared L3, which stays open
    assert other.locate(KEYS, TOKENS) == [Source.L3] * len(KEYS)
    restored = other.restore(KEYS, TOKENS)
    assert restored.sources == [Source.L3] * len(KEYS)
    other.release(restored.keys)
    other.close()
    shared.close()
