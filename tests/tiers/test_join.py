"""Joining a restore's pages into per-layer K/V (tiers/join.py): threaded and grouped joins,
the file ``mx.load`` reads, where joined arrays start, and the checksums taken on the way."""

import io
import sys

import mlx.core as mx
import numpy as np
import pytest
from xxhash import xxh3_64, xxh3_64_intdigest

import kvtier.tiers.layout as layout
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.join import SLACK, JoinedPages, JoinLimits, join_pages
from kvtier.tiers.page import PageGeometry, Source, page_keys
from kvtier.tiers.tier import kv_to_host

from .small_pages import (
    GEOMETRY,
    KEYS,
    KV,
    MANY_THREADS,
    NS,
    PAGE,
    TOKENS,
    joined,
    make_store,
    publish,
    same_bytes,
)


@pytest.mark.parametrize("tier", ["L2", "L3"])
def test_threaded_restore_is_byte_identical(tmp_path, tier):
    store = make_store(0, 8, tmp_path, limits=MANY_THREADS)
    publish(store, *range(7))
    if tier == "L3":
        store.close()
        store = make_store(0, 8, tmp_path, limits=MANY_THREADS)
    restored = store.restore(KEYS[:7], TOKENS)
    assert restored.sources == [Source(tier)] * 7
    assert same_bytes(joined(restored), mx.concatenate(KV[:7], axis=3))
    store.release(restored.keys)
    store.close()


def test_restored_kv_is_the_requests_own_copy():
    store = make_store(0, 2)
    publish(store, 0)
    restored = store.restore(KEYS[:1], TOKENS)
    expected = np.array(joined(restored).view(mx.uint16))
    store.release(restored.keys)
    publish(store, 1, 2)  # evicts page 0; its slot now holds page 2
    assert np.array_equal(np.array(joined(restored).view(mx.uint16)), expected)


@pytest.mark.parametrize("layers", [range(2), range(1, 2)])
def test_joined_pages_serve_any_read_pattern(layers):
    """The file mx.load reads: reads of any size and offset give a .npy holding the
    join ``start`` bytes in (0 unless the whole payload came in one read), then slack."""
    hosts = [kv_to_host(KV[i]).view(GEOMETRY.storage_dtype).reshape(GEOMETRY.shape) for i in range(3)]
    expected = np.concatenate(hosts, axis=3)[layers.start : layers.stop]
    for step in (1, 7, 100, 1 << 20):
        f = JoinedPages(hosts, GEOMETRY, layers)
        data, chunk = bytearray(), bytearray(step)
        while n := f.readinto(chunk):
            data += chunk[:n]
        flat = np.load(io.BytesIO(bytes(data))).view(np.uint8)
        assert f.start == 0 or step == 1 << 20
        assert len(flat) == expected.nbytes + SLACK
        joined = flat[f.start : f.start + expected.nbytes].view(expected.dtype).reshape(expected.shape)
        assert np.array_equal(joined, expected)


def test_mx_load_reads_the_payload_in_one_call_into_the_arrays_own_memory():
    """The private mlx behaviour ``join_pages`` is built on (pyproject pins mlx to the
    versions checked): ``mx.load`` of a file-like ``.npy`` reads the header in small
    reads, then the whole payload with ONE ``readinto`` whose buffer is the new
    array's own memory, and the array holds exactly those bytes."""
    data = np.arange(3 * 100 * 64, dtype=np.float32).reshape(3, 100, 64)
    npy = io.BytesIO()
    np.save(npy, data)
    raw = npy.getvalue()
    header = len(raw) - data.nbytes
    reads = []

    class File:
        closed, pos = False, 0

        def seek(self, offset, whence=0):
            self.pos = {0: 0, 1: self.pos, 2: len(raw)}[whence] + offset
            return self.pos

        def tell(self):
            return self.pos

        def readinto(self, buffer):
            out = memoryview(buffer).cast("B")
            n = min(len(out), len(raw) - self.pos)
            out[:n] = raw[self.pos : self.pos + n]
            reads.append((self.pos, len(out), np.frombuffer(out, np.uint8).ctypes.data))
            self.pos += n
            return n

    array = mx.load(File(), format="npy")
    mx.eval(array)
    assert np.array_equal(np.array(array), data)
    payload = [(at, n) for at, n, _ in reads if at + n > header]
    assert payload == [(header, data.nbytes)], "the payload must come in one read"
    assert reads[-1][2] == np.asarray(array).ctypes.data, "read straight into the array's memory"


def test_l2_slots_and_joins_start_half_a_page_from_fresh_mlx_buffers_modulo_4k():
    """The layout the join's copies rely on (tiers.layout.slot_arena): every L2 slot of
    pages of 4 KiB or more, and every join of pages, starts SLOT_OFFSET past a 4 KiB
    boundary, half a 4 KiB page from a fresh large mlx buffer; on Linux every mlx array
    starts where the slots do modulo 16 (malloc's alignment, then mlx's 8-byte size)."""
    geometry = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=64, page_size=12, dtype="float32")  # 12 KiB
    store = TieredStore(geometry, NS, StoreConfig(0, 3 * geometry.nbytes))
    tokens = list(range(3 * 12 + 1))
    keys = page_keys(NS, tokens)[:3]
    for i, key in enumerate(keys):
        store.publish(key, tokens[12 * i : 12 * i + 12], mx.zeros(geometry.shape))
    slots = [store.l2.read(key).ctypes.data for key in keys]
    assert len(slots) == 3 and all(address % 4096 == layout.SLOT_OFFSET for address in slots)
    assert (layout.SLOT_OFFSET - layout.MLX_BUFFER_OFFSET) % 4096 == 2048
    for _ in range(3):  # wherever mlx puts the buffer, the join starts where the slots do
        restored = store.restore(keys, tokens)
        assert restored.num_pages == 3 and np.asarray(restored.layers[0][0]).ctypes.data % 4096 == layout.SLOT_OFFSET
        store.release(restored.keys)
    if sys.platform == "linux":
        array = mx.zeros(1 << 20, mx.uint8)
        mx.eval(array)
        assert (slots[0] - np.asarray(array).ctypes.data) % 16 == 0


@pytest.mark.parametrize("pages, groups, chunked", [(1, 1, False), (3, 1, False), (3, 2, False), (3, 1, True)])
def test_join_hashes_the_flagged_pages_as_it_copies(pages, groups, chunked):
    """Digests of the flagged pages equal their xxh3 whichever way the join runs: one
    page, one group of layers, several groups, or each page hashed and copied a layer
    at a time."""
    hosts = [kv_to_host(KV[i]).view(GEOMETRY.storage_dtype).reshape(GEOMETRY.shape) for i in range(pages)]
    chunk = PAGE // GEOMETRY.num_layers if chunked else JoinLimits.hash_chunk
    limits = JoinLimits(max_buffer=pages * PAGE // groups, hash_chunk=chunk)
    flags = [i % 2 == 0 for i in range(pages)]
    result = join_pages(hosts, GEOMETRY, flags, limits)
    assert result.digests == [xxh3_64_intdigest(h) if f else None for h, f in zip(hosts, flags)]
    assert len(result.layers) == GEOMETRY.num_layers
    assert np.array_equal(kv_to_host(joined(result)), kv_to_host(mx.concatenate(KV[:pages], axis=3)))


@pytest.mark.parametrize("step", [7, 1 << 20])
def test_joined_pages_hash_every_flagged_page_whatever_the_reads(step):
    """The file mlx reads hashes each flagged page once by ``hash_rest``, whether its
    payload came in one read (hashed as it was copied) or in pieces (hashed after)."""
    hosts = [kv_to_host(KV[i]).view(GEOMETRY.storage_dtype).reshape(GEOMETRY.shape) for i in range(3)]
    hashers = [xxh3_64(), None, xxh3_64()]
    f = JoinedPages(hosts, GEOMETRY, range(GEOMETRY.num_layers), hashers)
    chunk = bytearray(step)
    while f.readinto(chunk):
        pass
    assert f.hashed == (step == 1 << 20)
    f.hash_rest()
    assert [None if h is None else h.intdigest() for h in hashers] == [
        xxh3_64_intdigest(hosts[0]),
        None,
        xxh3_64_intdigest(hosts[2]),
    ]
