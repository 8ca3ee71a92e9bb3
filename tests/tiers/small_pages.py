"""Small pages for the tier tests: a tiny bfloat16 geometry, random pages (``KV``; ``SMALL``
compresses), their keys and tokens, a store of so many pages per tier, and byte checks."""

import mlx.core as mx
import numpy as np

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.join import JoinLimits
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.tier import kv_to_host

GEOMETRY = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")
NS = Namespace("test-model", "bfloat16", 4)
PAGE = GEOMETRY.nbytes
TOKENS = list(range(100, 100 + 4 * 16))
KEYS = page_keys(NS, TOKENS)


def kv(i: int) -> mx.array:
    values = np.random.default_rng(i).standard_normal(GEOMETRY.shape).astype(np.float32)
    page = mx.array(values).astype(mx.bfloat16)
    mx.eval(page)
    return page


KV = [kv(i) for i in range(16)]
# Small integers: every page compresses, so a zstd store keeps every page compressed.
SMALL = [mx.array(np.random.default_rng(i).integers(0, 4, GEOMETRY.shape)).astype(mx.bfloat16) for i in range(16)]

# Join limits under which restores split their reads and joins over threads, and their
# KV into one array per layer, even for tiny pages.
MANY_THREADS = JoinLimits(workers=3, min_share=1, max_buffer=1)


def page_tokens(i: int) -> list[int]:
    return TOKENS[4 * i : 4 * i + 4]


def make_store(
    l1_pages: int, l2_pages: int, store_dir=None, namespace=NS, codec="raw", limits: JoinLimits | None = None
) -> TieredStore:
    config = StoreConfig(l1_pages * PAGE, l2_pages * PAGE, 256 * PAGE, store_dir, codec)
    config.join_limits = limits or config.join_limits
    return TieredStore(GEOMETRY, namespace, config)


def publish(store: TieredStore, *pages: int, data: list[mx.array] = KV) -> None:
    for i in pages:
        store.publish(KEYS[i], page_tokens(i), data[i])


def same_bytes(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(kv_to_host(a), kv_to_host(b))


def joined(restored) -> mx.array:
    """The restored per-layer K/V back in page layout: (layers, 2, heads, tokens, dim)."""
    return mx.stack([mx.concatenate([k, v]) for k, v in restored.layers])
