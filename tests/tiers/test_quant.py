"""The quantizing page codecs (tiers/quant.py) in L2 and L3: their error bound, the
namespace that keeps their pages apart, their checksums, and how the planner prices them."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvtier.costmodel.models import LinkModel
from kvtier.costmodel.plan import plan_restore, restore_seconds
from kvtier.costmodel.profile import Profile
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.record import RecordHeader
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, Source, page_keys, snapshot_key
from kvtier.tiers.quant import BITS, GROUP, PageCodec, namespace_codecs, stored_nbytes
from kvtier.tiers.tier import kv_to_host

from .lmdb_files import raw_env

GEOMETRY = PageGeometry(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype="bfloat16")
PAGE = GEOMETRY.nbytes
TOKENS = list(range(100, 100 + 4 * 8))


def page(i: int, geometry: PageGeometry = GEOMETRY) -> mx.array:
    values = np.random.default_rng(i).standard_normal(geometry.shape).astype(np.float32) * (1 + i)
    kv = mx.array(values).astype(getattr(mx, geometry.dtype))
    mx.eval(kv)
    return kv


def as_float(data: np.ndarray, geometry: PageGeometry = GEOMETRY) -> np.ndarray:
    """Page bytes as float32 values, (layers, 2, values)."""
    stored = np.frombuffer(data, geometry.storage_dtype)
    values = (stored.astype(np.uint32) << 16).view(np.float32) if geometry.dtype == "bfloat16" else stored
    return values.astype(np.float32).reshape(geometry.num_layers, 2, -1)


def namespace(l3: str = "raw", l2: str = "raw") -> Namespace:
    return Namespace("test-model", "bfloat16", 4, codecs=namespace_codecs(l3, l2))


def store(tmp_path, l3: str = "raw", l2: str = "raw", l2_pages: int = 0, ns: Namespace | None = None) -> TieredStore:
    config = StoreConfig(0, l2_pages * PAGE, 256 * PAGE, tmp_path, l3, l2_codec=l2)
    return TieredStore(GEOMETRY, ns or namespace(l3, l2), config)


def publish(s: TieredStore, pages: int) -> list:
    keys = page_keys(s.namespace, TOKENS)[:pages]
    for i, key in enumerate(keys):
        s.publish(key, TOKENS[4 * i : 4 * i + 4], page(i))
    s.keeping.flush()
    return keys


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("codec", list(BITS))
def test_each_codec_round_trips_within_one_step_of_its_group(codec, dtype):
    """Every value decodes within one quantization step of its group (the group's range
    over 2^bits - 1), plus, for bfloat16, the rounding of the group's scale, bias and the
    result (2^-7 of the group's largest magnitude); keys and values each with their own
    bits; the payload has the size ``stored_nbytes`` says."""
    geometry = PageGeometry(num_layers=3, num_kv_heads=2, head_dim=64, page_size=4, dtype=dtype)
    pages = PageCodec.of(geometry, codec)
    raw = kv_to_host(page(3, geometry))
    payload = pages.encode(codec, raw)
    assert len(payload) == stored_nbytes(codec, len(raw), dtype) < len(raw)
    decoded, original = as_float(pages.decode(payload), geometry), as_float(raw, geometry)
    rounding = 2.0**-7 if dtype == "bfloat16" else 0.0
    for half, bits in enumerate(BITS[codec]):
        groups = original[:, half].reshape(-1, GROUP)
        step = (groups.max(axis=1) - groups.min(axis=1)) / (2**bits - 1)
        error = np.abs(decoded[:, half].reshape(-1, GROUP) - groups)
        assert (error <= (step + rounding * np.abs(groups).max(axis=1))[:, None]).all()
        assert error.max() > 0  # lossy: it is not the raw page back


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", list(BITS))
def test_a_decoded_page_is_mx_dequantize_s_bytes(codec, dtype):
    """The codec's own decode gives the bytes ``mx.dequantize`` gives for the groups
    ``mx.quantize`` made of each layer's K and V (a page of 11 layers of 64 KiB halves:
    decoded a few layers at a time, the last chunk short), into a slot or new memory,
    from a payload at any address."""
    geometry = PageGeometry(num_layers=11, num_kv_heads=2, head_dim=64, page_size=128, dtype=dtype)
    pages = PageCodec.of(geometry, codec)
    kv = page(5, geometry)
    expected = []
    for layer in range(geometry.num_layers):
        halves = []
        for half, bits in enumerate(BITS[codec]):
            groups = kv[layer, half].reshape(-1, GROUP)
            halves.append(mx.dequantize(*mx.quantize(groups, GROUP, bits), GROUP, bits).reshape(kv.shape[2:]))
        expected.append(mx.stack(halves))
    slot = np.zeros(geometry.nbytes, np.uint8)
    payload = pages.encode(codec, kv_to_host(kv))
    assert pages.decode(payload, slot) is slot
    odd = memoryview(b"\0" + payload)[1:]  # at an odd address, as in LMDB's map
    assert slot.tobytes() == kv_to_host(mx.stack(expected)).tobytes() == pages.decode(odd).tobytes()


def test_a_page_that_does_not_split_into_groups_is_refused_at_open(tmp_path):
    odd = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")  # 32 values
    with pytest.raises(ValueError, match="groups of 64"):
        TieredStore(odd, Namespace("m", "bfloat16", 4, codecs="L3:q8"), StoreConfig(0, 0, 1 << 20, tmp_path, "q8"))


def test_a_namespace_must_name_its_store_s_lossy_codecs(tmp_path):
    with pytest.raises(ValueError, match="quantizing codec"):
        store(tmp_path, "q8", ns=namespace())
    with pytest.raises(ValueError, match="quantizing codec"):
        store(tmp_path, "raw", ns=namespace("q8"))


def test_quantized_pages_are_read_by_a_reader_of_their_codec_only(tmp_path):
    """A q8 store's pages are L3 hits to a q8 reader, and not even found by a raw, q4
    or L2-quantizing one: their keys chain from another namespace."""
    writer = store(tmp_path, "q8")
    publish(writer, 3)
    writer.close()
    for l3, l2, found in (("raw", "raw", 0), ("q4", "raw", 0), ("q8", "q8", 0), ("zstd", "raw", 0), ("q8", "raw", 3)):
        reader = store(tmp_path, l3, l2, l2_pages=4)
        keys = page_keys(reader.namespace, TOKENS)[:3]
        assert reader.locate(keys, TOKENS) == [Source.L3] * found, (l3, l2)
        reader.close()


def test_a_quantized_l3_restore_decodes_into_l2_and_counts_stored_bytes(tmp_path):
    writer = store(tmp_path, "k8v4")
    keys = publish(writer, 3)
    writer.close()
    reader = store(tmp_path, "k8v4", l2_pages=4)
    restored = reader.restore(keys, TOKENS)
    assert restored.sources == [Source.L3] * 3
    assert all(key in reader.l2 for key in keys)  # decoded into L2, kept there
    links = reader.stats().links
    stored = stored_nbytes("k8v4", PAGE, "bfloat16")
    assert 3 * stored <= links["L3->L2"].bytes < 3 * (stored + 256)  # the records: payload and header
    assert links["L2->L1"].bytes == 3 * PAGE and links["L3->L1"].bytes == 0
    first = np.stack(
        [
            np.concatenate([np.asarray(k.astype(mx.float32)), np.asarray(v.astype(mx.float32))])
            for k, v in restored.layers
        ]
    )[:, :, :, :4]
    assert np.abs(first.reshape(2, 2, -1) - as_float(kv_to_host(page(0)))).max() < 0.5  # 4-bit values, sd 1
    reader.release(restored.keys)
    reader.close()


def test_a_corrupted_quantized_record_is_rejected_and_its_pages_recomputed(tmp_path):
    """A flipped byte in a quantized payload's packed words decodes to other values
    without error: only the checksum over the stored bytes catches it."""
    writer = store(tmp_path, "q8")
    keys = publish(writer, 4)
    writer.close()
    with raw_env(tmp_path) as (env, pages, _), env.begin(write=True) as txn:
        value = bytearray(txn.get(keys[2], db=pages))
        value[len(value) // 2] ^= 0x01  # inside K's packed words
        txn.put(keys[2], bytes(value), db=pages)
    reader = store(tmp_path, "q8", l2_pages=8)
    restored = reader.restore(keys, TOKENS)
    assert restored.sources == [Source.L3] * 2  # the prefix ends before the bad page: the rest is recomputed
    assert reader.disk.counters.checksum_failures == 1
    reader.release(restored.keys)
    reader.keeping.flush()
    assert not reader.disk.contains(keys[2])  # deleted
    reader.close()


@pytest.mark.parametrize("l3", ["q8", "k8v4"])
def test_a_page_restored_from_l3_into_an_l2_of_its_codec_keeps_its_stored_bytes(tmp_path, l3):
    """An L3 record of L2's own codec goes into L2 as stored: a second restore, from L2,
    gives the KV the first gave from L3 (quantizing a decoded page again would not give
    its bytes back: the codecs are lossy)."""
    writer = store(tmp_path, l3, l3)
    keys = publish(writer, 3)
    writer.close()
    reader = store(tmp_path, l3, l3, l2_pages=8)
    first = reader.restore(keys, TOKENS)
    reader.release(first.keys)
    again = reader.restore(keys, TOKENS)
    reader.release(again.keys)
    assert (first.sources, again.sources) == ([Source.L3] * 3, [Source.L2] * 3)
    for (k1, v1), (k2, v2) in zip(first.layers, again.layers):
        assert kv_to_host(k1).tobytes() == kv_to_host(k2).tobytes()
        assert kv_to_host(v1).tobytes() == kv_to_host(v2).tobytes()
    reader.close()


def test_a_quantizing_l2_holds_more_pages_in_the_same_bytes(tmp_path):
    l2 = store(tmp_path, "raw", "q8", l2_pages=4)
    assert l2.l2.max_pages == 4 * PAGE // stored_nbytes("q8", PAGE, "bfloat16") >= 1.7 * 4
    keys = publish(l2, 7)
    assert [key in l2.l2 for key in keys] == [True] * 7
    restored = l2.restore(keys, TOKENS)
    assert restored.sources == [Source.L2] * 7
    k, _ = restored.layers[0]  # (1, heads, tokens, head dim)
    first = np.asarray(k[0, :, :4].astype(mx.float32)).reshape(-1)
    assert 0 < np.abs(first - as_float(kv_to_host(page(0)))[0, 0]).max() < 0.1  # 8-bit keys, sd 1: lossy, close
    l2.release(restored.keys)
    l2.close()


def profile(l3_l2_gib_s: float) -> Profile:
    """Restores from L3: raw pages at 1 GiB/s, decoded ones at ``l3_l2_gib_s`` of stored
    bytes; prefill 1 ms a token."""
    p = Profile.defaults()
    p.links["L3->L1"] = LinkModel.of(1e-4, 1 << 30)
    p.links["L2->L1"] = LinkModel.of(1e-4, 4 << 30)
    p.links["L3->L2"] = LinkModel.of(1e-4, l3_l2_gib_s * (1 << 30))
    return p


def test_the_planner_recomputes_where_decoding_is_slower_than_prefill():
    """8 pages of 1.5 MiB (SmolLM2's size at 128 tokens), 1 ms a token to recompute: a
    quantized page's decode at 1 GiB/s of stored bytes is worth restoring, at 128 KiB/s
    it is not (not even beside the prefill of the others), though the same pages raw
    would be."""
    size, page_bytes, pages = 128, 1_572_864, 8
    stored = stored_nbytes("q8", page_bytes, "bfloat16")

    def plan(gib_s: float, codec: str = "q8"):
        matched = [Source.L3] * pages
        return plan_restore(matched, pages * size + 1, size, page_bytes, profile(gib_s), codec, stored_bytes=stored)

    assert plan(1.0).restore_pages == pages and plan(1 / 8192, "raw").restore_pages == pages
    assert plan(1 / 8192).restore_pages == 0


def test_the_planner_prices_a_quantized_page_at_its_stored_bytes():
    """A decoded page moves its stored bytes on L3->L2 (its decode priced by that link's
    fit) and its raw bytes on L2->L1."""
    page_bytes, p = 1_572_864, profile(0.2)
    stored = stored_nbytes("q4", page_bytes, "bfloat16")
    expected = p.links["L3->L2"].predict(8 * stored) + p.links["L2->L1"].predict(8 * page_bytes)
    assert restore_seconds([Source.L3] * 8, page_bytes, p, "q4", stored) == pytest.approx(expected)
    assert stored < 0.3 * page_bytes


def test_a_hybrid_model_s_snapshots_stay_raw_under_a_quantizing_l3(tmp_path):
    """Pages are stored q8, the recurrent-state snapshot after them raw: restored, the
    state is the bytes computed, exactly."""
    kinds = (LayerKind("state", arrays=(("float32", (1, 2, 8)),)), GLOBAL)
    geometry = PageGeometry(1, 1, 64, 4, "float32", kinds)
    ns = Namespace("hybrid", "float32", 4, layers=geometry.describe_layers(), codecs=namespace_codecs("q8"))
    config = StoreConfig(0, 0, 1 << 20, tmp_path, "q8", snapshot_l1_bytes=0, snapshot_l2_bytes=0)
    keys = page_keys(ns, TOKENS)[:2]
    state = mx.array(np.random.default_rng(5).standard_normal(16).astype(np.float32)).view(mx.uint8)
    writer = TieredStore(geometry, ns, config)
    for i, key in enumerate(keys):
        writer.publish(key, TOKENS[4 * i : 4 * i + 4], page(i, geometry), parent=keys[i - 1] if i else ns.digest())
    writer.publish_snapshot(keys[1], TOKENS[4:8], state)
    writer.close()
    with raw_env(tmp_path) as (env, pages, _), env.begin() as txn:
        codecs = {key: RecordHeader.unpack(txn.get(key, db=pages))[0].codec for key in (*keys, snapshot_key(keys[1]))}
    assert codecs == {keys[0]: "q8", keys[1]: "q8", snapshot_key(keys[1]): "raw"}
    reader = TieredStore(geometry, ns, replace(config, l2_bytes=1 << 16, snapshot_l2_bytes=1 << 12))
    restored = reader.restore(keys, TOKENS)
    assert restored.sources == [Source.L3] * 2
    assert np.array_equal(np.asarray(restored.state), np.asarray(state))
    reader.release(restored.keys)
    reader.close()
