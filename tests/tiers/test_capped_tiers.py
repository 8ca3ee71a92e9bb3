"""Reliability of the store (issue 6): full and capped tiers, and processes sharing one store."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.tier import kv_to_host

from .disk_pages import NS, TOKENS, assert_consistent, key, payload
from .lmdb_files import write_lock

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


GEOMETRY = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
NAMESPACE = Namespace("reliability", "float32", 4)
PAGE = GEOMETRY.nbytes


def page_kv(i: int) -> mx.array:
    kv = mx.array(np.random.default_rng(1000 + i).standard_normal(GEOMETRY.shape).astype(np.float32))
    mx.eval(kv)
    return kv


def sequences(n: int, pages: int) -> list[tuple[list[int], list[bytes]]]:
    """n token sequences of ``pages`` full pages each; the later ones share prefixes."""
    out = []
    for s in range(n):
        shared = (s // 2) * 2  # sequences 2k and 2k+1 share their first pages
        tokens = [shared * 1000 + t for t in range(4 * pages // 2)]
        tokens += [s * 1000 + 500 + t for t in range(4 * pages - len(tokens))]
        out.append((tokens, page_keys(NAMESPACE, tokens)))
    return out


def test_l3_full_evicts_and_stays_under_its_cap(tmp_path: Path) -> None:
    record = PAGE + 100  # header is under 100 bytes
    cap = 3 * record
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, cap, tmp_path))
    tokens = list(range(4 * 30))
    keys = page_keys(NAMESPACE, tokens)
    for i, k in enumerate(keys):
        store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i))
        store.disk.flush()
        assert store.disk.counters.bytes_used <= cap and store.disk.counters.pages <= 3
    assert store.disk.counters.evictions >= 30 - 2 - 3
    assert len(store.restore(keys, tokens).keys) == 0  # the first pages were evicted: a miss
    store.close()
    assert_consistent(tmp_path, cap)


def test_l3_smaller_than_a_page_drops_and_counts_every_write(tmp_path: Path) -> None:
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, PAGE // 2, tmp_path))
    tokens = list(range(4 * 10))
    keys = page_keys(NAMESPACE, tokens)
    for i, k in enumerate(keys):
        store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i))
    store.close()  # flush sends the pages still in L1 and L2: all 10 reached L3 once
    assert store.disk.counters.writes_dropped == 10 and store.disk.counters.inserts == 0
    assert assert_consistent(tmp_path, PAGE // 2)["pages"] == 0


def test_requests_never_wait_for_a_stuck_l3(tmp_path: Path) -> None:
    """L3 cannot commit (another transaction holds LMDB's write lock): publishes and
    restores still return at once; the spills that find the queue full are dropped and counted."""
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, 1 << 20, tmp_path))
    tokens = list(range(4 * 200))
    keys = page_keys(NAMESPACE, tokens)
    hits = 0
    with write_lock(tmp_path):
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i % 16))
            for first in (0, i):  # a prefix that went down to the stuck L3, and the newest page
                restored = store.restore(keys[first : i + 1], tokens[4 * first :])
                store.release(restored.keys)
                hits += len(restored.keys)
        elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"requests stalled behind L3 ({elapsed:.1f} s)"
    assert store.disk.counters.writes_dropped > 0 and hits >= len(keys)
    store.close()
    assert_consistent(tmp_path, 1 << 20)


def test_caps_hold_and_bytes_survive_a_long_mixed_workload(tmp_path: Path) -> None:
    """Publish, restore (pinning), release and flush at random over shared prefixes:
    L1, L2 and L3 stay under their caps at every step, and every restore is exact."""
    rng = random.Random(23)
    l1, l2, l3 = 3 * PAGE, 5 * PAGE, 12 * (PAGE + 100)
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(l1, l2, l3, tmp_path))
    seqs = sequences(10, 8)  # 50 distinct pages: more than the three tiers hold together
    kvs = {k: page_kv(i) for tokens, ks in seqs for i, k in enumerate(ks)}
    pinned: list[list] = []
    peak = {"L1": 0, "L2": 0}
    sources: set = set()
    for _ in range(800):
        tokens, ks = rng.choice(seqs)
        op = rng.random()
        if op < 0.4:  # a request that computed its first pages publishes them (stored ones: no-op)
            for i in range(rng.randint(1, len(ks))):
                store.publish(ks[i], tokens[4 * i : 4 * i + 4], kvs[ks[i]])
        elif op < 0.7:
            restored = store.restore(ks[: rng.randint(1, len(ks))], tokens)
            for i, k in enumerate(restored.keys):
                page = mx.stack(
                    [
                        mx.concatenate([kk[:, :, 4 * i : 4 * i + 4], vv[:, :, 4 * i : 4 * i + 4]])
                        for kk, vv in restored.layers
                    ]
                )
                assert np.array_equal(kv_to_host(page), kv_to_host(kvs[k]))
            sources.update(restored.sources)
            pinned.append(restored.keys)
        elif op < 0.95:
            if pinned:
                store.release(pinned.pop(rng.randrange(len(pinned))))
        else:
            store.disk.flush()
            assert store.disk.counters.bytes_used <= l3
        for tier, cap in ((store.l1, l1), (store.l2, l2)):
            assert tier.counters.bytes_used == len(tier.entries) * PAGE <= cap
            peak[tier.name] = max(peak[tier.name], tier.counters.bytes_used)
    assert peak == {"L1": l1, "L2": l2}  # the workload did fill both
    assert len(sources) == 3 and store.disk.counters.evictions > 0  # pages came from every tier
    assert all(t.evictions > 0 for t in (store.l1.counters, store.l2.counters))
    store.close()
    assert_consistent(tmp_path, l3)


_WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.tiers.disk_pages import NS, TOKENS, key, payload
from kvtier.tiers.l3.lmdb_store import DiskTier
tier = DiskTier(Path(sys.argv[2]), 1 << 24, codec=sys.argv[3])
order = list(range(int(sys.argv[4])))
if sys.argv[5] == "reverse":
    order.reverse()
for n, i in enumerate(order):
    tier.put(key(i), NS, TOKENS, payload(i), wait=True)
    got = tier.get(key(order[n // 2]), NS, TOKENS, 4096)
    assert got is None or got[0] == payload(order[n // 2])
tier.close()
assert tier.counters.checksum_failures == 0
print(tier.counters.inserts)
"""


def test_four_processes_write_one_store_at_once(store: Path) -> None:
    n = 150
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(REPO), str(store), codec, str(n), order],
            stdout=subprocess.PIPE,
            text=True,
        )
        for codec, order in (("raw", "forward"), ("zstd", "reverse"), ("zstd-shuffle", "forward"), ("raw", "reverse"))
    ]
    inserts = [int(child.communicate(timeout=120)[0]) for child in children]
    assert [child.returncode for child in children] == [0] * 4
    assert sum(inserts) == n  # write-once across processes
    s = assert_consistent(store, 1 << 24)
    assert s["pages"] == n
    tier = DiskTier(store, 1 << 24)
    assert all(tier.get(key(i), NS, TOKENS, 4096)[0] == payload(i) for i in range(n))
    tier.close()
